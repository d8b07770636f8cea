"""Starting, attaching to and stopping the TransferQueue package's controller and storage, from its own config.

`resolve_config` merges `transfer_queue.transferqueue.*` over the package's
defaults and refuses what the package does not have (a key, a backend, a
sampler). `TransferQueueLauncher` is the part of `TransferQueueDataPlane`
(conveyor.data_plane.transferqueue) that brings the package's actors up or
finds them by name, and stops what it started.

Ray is needed (the package's controller and storage units are Ray actors): the
adapter starts a local Ray when none is running and asks for a fraction of a
logical CPU per actor, so it fits next to the trainer on a 2-core machine.
Every wait is bounded by `timeout_s`.

The package's listeners (the controller's and each storage unit's ZMQ sockets,
and its metrics exporter) speak unauthenticated pickle: whoever reaches them
can run code in those processes. The package binds them to Ray's node address;
this adapter binds them to `host` instead, 127.0.0.1 by default, and places
the actors on this node, so nothing off the machine reaches them. `host="auto"`
keeps the package's choice (needed when storage spans nodes: a trusted
network only).

It deliberately does not: read or write samples, hold the client or its
event loop, or pickle a plane (conveyor.data_plane.transferqueue does); it
starts and stops what the package's bootstrap would, nothing more.
"""

from __future__ import annotations

import difflib
import logging
import os
import uuid
from collections.abc import Mapping
from importlib import resources
from typing import Any

import ray
import transfer_queue
from omegaconf import DictConfig, OmegaConf
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from transfer_queue.controller import TransferQueueController
from transfer_queue.sampler import BaseSampler
from transfer_queue.storage.bootstrap import StorageBootstrapProvider
from transfer_queue.storage.simple_storage import SimpleStorageUnit
from transfer_queue.utils.common import get_node_round_robin_scheduling_strategies

__all__ = ["AUTO_HOST", "NAMESPACE", "TransferQueueLauncher", "resolve_config"]

logger = logging.getLogger(__name__)

NAMESPACE = "transfer_queue"  # the Ray namespace the package keeps its controller in
_CONFIG_KEY = "transfer_queue.transferqueue"
_RAY_LOCAL_CPUS = 4  # logical CPUs of a Ray started here: a count, not a reservation of cores
AUTO_HOST = "auto"  # `host` that keeps the package's own bind address (Ray's node address)


def _pin_bind_address(cls: type, host: str) -> None:
    """Make the package's code of `cls` in this process take `host` for the node's address, where it binds.

    The package asks `get_node_ip_address()` (a global of its modules) and binds
    its listeners there; each actor runs in a process of its own, so replacing
    that global in the namespaces `cls`'s methods read changes nothing else.
    """
    for klass in cls.__mro__:
        for attr in vars(klass).values():
            namespace = getattr(getattr(attr, "__func__", attr), "__globals__", None)
            if namespace is not None and "get_node_ip_address" in namespace:
                namespace["get_node_ip_address"] = lambda: host


def _listening_on(actor_class: Any, host: str) -> Any:
    """The package's Ray actor class `actor_class`, its listeners bound to `host` (unchanged for "auto")."""
    if host == AUTO_HOST:
        return actor_class
    base = actor_class.__ray_actor_class__

    class Pinned(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _pin_bind_address(base, host)
            super().__init__(*args, **kwargs)

    Pinned.__name__ = Pinned.__qualname__ = base.__name__  # Ray shows the package's name
    return ray.remote(Pinned)


def _default_config() -> DictConfig:
    """The package's own defaults (its config.yaml), objects allowed (a sampler may be an instance)."""
    conf = OmegaConf.create({}, flags={"allow_objects": True})
    return OmegaConf.merge(conf, OmegaConf.load(resources.files("transfer_queue") / "config.yaml"))


def _check_keys(given: Mapping, default: Any, path: str) -> None:
    """Refuse keys the package's config does not have, suggesting the nearest one."""
    if not isinstance(default, Mapping) or not default:
        return  # a free-form entry (e.g. ucx_env_vars, RayStore): anything goes
    for key, value in given.items():
        if key not in default:
            near = difflib.get_close_matches(str(key), [str(k) for k in default], n=1)
            hint = f"; did you mean {path}.{near[0]}?" if near else f"; valid keys: {sorted(default)}"
            raise ValueError(f"{path}.{key} is not a TransferQueue setting{hint}")
        if isinstance(value, Mapping):
            _check_keys(value, default[key], f"{path}.{key}")


def resolve_config(tq_config: Mapping | None) -> DictConfig:
    """The package's defaults merged with `tq_config`, validated (unknown keys, backend, sampler)."""
    if tq_config is not None and not isinstance(tq_config, Mapping):
        raise ValueError(f"{_CONFIG_KEY} must be a mapping of TransferQueue settings, got {type(tq_config).__name__}")
    default = _default_config()
    given = dict(tq_config or {})
    _check_keys(given, default, _CONFIG_KEY)
    conf = OmegaConf.merge(default, OmegaConf.create(given, flags={"allow_objects": True}))
    backends = [k for k in default.backend if k != "storage_backend"]
    if conf.backend.storage_backend not in backends:
        raise ValueError(
            f"{_CONFIG_KEY}.backend.storage_backend={conf.backend.storage_backend!r} is not a TransferQueue "
            f"storage backend; choose one of {backends}"
        )
    units = conf.backend.SimpleStorage.num_data_storage_units
    if not isinstance(units, int) or units < 1:
        raise ValueError(
            f"{_CONFIG_KEY}.backend.SimpleStorage.num_data_storage_units must be an int >= 1, got {units!r}"
        )
    sampler = conf.controller.sampler
    if isinstance(sampler, str):
        sampler = getattr(transfer_queue, sampler, None)
    if not (isinstance(sampler, BaseSampler) or (isinstance(sampler, type) and issubclass(sampler, BaseSampler))):
        raise ValueError(
            f"{_CONFIG_KEY}.controller.sampler={conf.controller.sampler!r} is not a TransferQueue sampler "
            "(e.g. SequentialSampler)"
        )
    return conf


def _plain(node: Any) -> Any:
    """A storage backend's config as plain dicts (objects such as ZMQ server infos kept), detached from the rest."""
    return OmegaConf.to_container(node) if isinstance(node, DictConfig) else node


class TransferQueueLauncher:
    """Starts or attaches to the package's controller and storage, and stops what it started (a plane's base).

    The plane that derives from it sets `controller_name`, `_host`, `_timeout_s`, `_actor_cpus` and the
    state these methods keep (`_controller`, `_storage`, `_started_ray`, `tq_metrics_endpoint`).
    """

    def _ensure_ray(self) -> None:
        if ray.is_initialized():
            return
        cpus = max(_RAY_LOCAL_CPUS, os.cpu_count() or 1)
        logger.info("starting a local Ray for the transferqueue data plane (%d logical CPUs)", cpus)
        ray.init(num_cpus=cpus, include_dashboard=False)
        self._started_ray = True

    def _wait(self, ref: Any, what: str) -> Any:
        """ray.get with the plane's timeout, failing with a message that says what did not come up."""
        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            free = ray.available_resources().get("CPU", 0.0)
            raise RuntimeError(
                f"transferqueue: {what} did not answer within {self._timeout_s:g}s (Ray has {free:g} logical CPUs "
                f"free; each TransferQueue actor asks for {self._actor_cpus:g}). Free Ray resources, lower "
                "actor_cpus, or raise timeout_s."
            ) from err

    def _start(self, conf: DictConfig) -> tuple[Any, str, Any]:
        """Start Ray (if needed), the controller and the storage; return how to reach them."""
        self._ensure_ray()
        backend = conf.backend.storage_backend
        units = int(conf.backend.SimpleStorage.num_data_storage_units) if backend == "SimpleStorage" else 0
        need = self._actor_cpus * (1 + units)
        free = ray.available_resources().get("CPU", 0.0)
        if need > free + 1e-9:
            raise RuntimeError(
                f"transferqueue needs {need:g} logical Ray CPUs for its controller and {units} storage unit(s) "
                f"({self._actor_cpus:g} each) but Ray has {free:g} free; lower actor_cpus or "
                f"{_CONFIG_KEY}.backend.SimpleStorage.num_data_storage_units, or give Ray more CPUs"
            )
        sampler = conf.controller.sampler
        if isinstance(sampler, str):
            sampler = getattr(transfer_queue, sampler)
        self._controller = (
            _listening_on(TransferQueueController, self._host)
            .options(name=self.controller_name, namespace=NAMESPACE, num_cpus=self._actor_cpus, **self._placement())
            .remote(sampler=sampler, polling_mode=bool(conf.controller.polling_mode))
        )
        controller_ready = self._controller.get_zmq_server_info.remote()
        if backend == "SimpleStorage":
            # Started while the controller comes up: the units do not need it to start.
            self._start_simple_storage(conf)
        controller_info = self._wait(controller_ready, "the TransferQueue controller")
        conf.controller.zmq_info = controller_info
        if backend != "SimpleStorage":
            provider = StorageBootstrapProvider.get_provider(backend)
            # RayStore has no bootstrap; Mooncake and Yuanrong start their own processes.
            self._storage = {backend: provider(conf)} if provider is not None else None
        self._wait(self._controller.store_config.remote(conf), "the TransferQueue controller (store_config)")
        if conf.metrics.get("enabled", False):
            self._start_package_metrics(conf)
        return controller_info, backend, _plain(conf.backend[backend])

    def _placement(self) -> dict[str, Any]:
        """Ray options that keep an actor on this node when it listens on a fixed address (none for "auto")."""
        if self._host == AUTO_HOST:
            return {}
        node = ray.get_runtime_context().get_node_id()
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}

    def _start_simple_storage(self, conf: DictConfig) -> None:
        """Start the SimpleStorage units as the package's bootstrap does, with fractional CPUs and no fixed names."""
        su_conf = dict(conf.backend.SimpleStorage)
        su_conf["_run_id"] = uuid.uuid4().hex
        count = int(su_conf["num_data_storage_units"])
        options: dict[str, Any] = {"num_cpus": self._actor_cpus}
        ssd = su_conf.get("ssd_offload") or {}
        if ssd.get("enabled", False) and ssd.get("glibc_mmap_threshold_bytes") is not None:
            threshold = str(int(ssd["glibc_mmap_threshold_bytes"]))
            options["runtime_env"] = {"env_vars": {"MALLOC_MMAP_THRESHOLD_": threshold}}
        if self._host == AUTO_HOST:
            strategies = get_node_round_robin_scheduling_strategies(
                count, required_node_resource=su_conf.get("required_node_resource")
            )
        else:  # an address belongs to one node: every unit listens there
            strategies = [self._placement()["scheduling_strategy"]] * count
        unit_class = _listening_on(SimpleStorageUnit, self._host)
        handles: dict[str, Any] = {}
        self._storage = {"SimpleStorage": handles}  # stopped by close, also if start-up fails below
        for rank in range(count):
            handles[f"TransferQueueStorageUnit#{rank}"] = unit_class.options(
                scheduling_strategy=strategies[rank], **options
            ).remote(config=su_conf)
        infos = self._wait(
            [h.get_zmq_server_info.remote() for h in handles.values()], f"{count} TransferQueue storage unit(s)"
        )
        conf.backend.SimpleStorage.zmq_info = dict(zip(handles, infos))

    def _start_package_metrics(self, conf: DictConfig) -> None:
        """The package's own Prometheus exporter (`metrics.enabled`), on the controller and each storage unit."""
        endpoint = self._wait(self._controller.start_metrics.remote(port=int(conf.metrics.get("port", 0))), "metrics")
        conf.metrics.endpoint = endpoint
        self._wait(self._controller.store_config.remote(conf), "the TransferQueue controller (store_config)")
        units = (self._storage or {}).get("SimpleStorage")
        if units:
            infos = conf.backend.SimpleStorage.zmq_info
            self._wait(self._controller.register_storage_units_for_metrics.remote(infos), "metrics")
            self._wait([h.start_metrics.remote(port=0) for h in units.values()], "storage-unit metrics")
        self.tq_metrics_endpoint = str(endpoint)
        logger.info("TransferQueue metrics at http://%s/metrics", endpoint)

    def _attach(self, name: str) -> tuple[Any, str, Any]:
        """Find a running controller by name and read how to reach its storage."""
        try:
            controller = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError as err:
            raise ValueError(f"no TransferQueue controller named {name!r} in Ray namespace {NAMESPACE!r}") from err
        conf = self._wait(controller.get_config.remote(), f"the TransferQueue controller {name!r}")
        if conf is None:
            raise RuntimeError(
                f"the TransferQueue controller {name!r} has not finished starting (it holds no config yet)"
            )
        backend = conf.backend.storage_backend
        return conf.controller.zmq_info, backend, _plain(conf.backend[backend])

    def _stop_started(self) -> None:
        """Stop the storage, controller and Ray this plane started (nothing for an attached plane)."""
        storage, self._storage = self._storage, None
        for backend, started in (storage or {}).items():
            try:
                self._stop_storage(backend, started)
            except Exception as err:
                logger.warning("stopping TransferQueue %s storage failed: %s", backend, err)
        if self._controller is not None:
            try:
                ray.kill(self._controller)
            except Exception as err:
                logger.warning("stopping the TransferQueue controller failed: %s", err)
            self._controller = None
        if self._started_ray:
            self._started_ray = False
            ray.shutdown()

    def _stop_storage(self, backend: str, started: Any) -> None:
        if started is None:
            return
        if backend == "SimpleStorage":
            handles = list(started.values())
            try:
                ray.get([h.shutdown.remote() for h in handles], timeout=min(self._timeout_s, 15.0))
            except Exception as err:
                logger.warning("TransferQueue storage units did not shut down cleanly: %s", err)
            for h in handles:
                ray.kill(h)
        elif backend == "MooncakeStore":
            procs = started.values() if isinstance(started, dict) else [started]
            for proc in procs:
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=5)
                    except Exception:
                        proc.kill()
        elif backend == "Yuanrong":
            from transfer_queue.utils.yuanrong_utils import cleanup_yuanrong_resources

            cleanup_yuanrong_resources(started)
