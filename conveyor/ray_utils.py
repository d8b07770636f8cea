"""Starting and stopping Ray for a run: connect to a cluster, or start a local one sized by config.

A run starts Ray only when its workers or its data plane need it, and stops it
only if it started it (a Ray that was already initialised, e.g. by a notebook
or a test, is left running). It deliberately ships no code or environment to
the cluster (no `runtime_env`): every node must already have conveyor and its
dependencies installed, and see the model checkpoint at the same path.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from conveyor.workers.placement.group import use_ray

__all__ = ["ensure_ray", "shutdown_ray", "needs_ray", "data_plane_backend", "serves_memory_plane"]

logger = logging.getLogger(__name__)


def needs_ray(cfg: Any, plan: Any = None) -> bool:
    """Whether this run uses Ray: workers as Ray actors (all, or the rollout's under `plan`), or the `ray` data
    plane."""
    own = plan is not None and plan.rollout_process == "own"
    return use_ray(cfg) or own or cfg.transfer_queue.backend == "ray"


def _may_span_machines(cfg: Any) -> bool:
    # Several nodes, or a cluster someone else started: actors may land where this machine's socket cannot reach.
    return cfg.trainer.nnodes > 1 or cfg.ray.address is not None


def serves_memory_plane(cfg: Any) -> bool:
    """Whether workers on Ray reach the embedded `memory` data plane (`transfer_queue.backend=memory`), served to them
    over a Unix socket: a Ray the run starts itself on this machine (one node, no `ray.address`), CPU workers."""
    return (
        cfg.transfer_queue.backend == "memory"
        and use_ray(cfg)
        and not _may_span_machines(cfg)
        and cfg.trainer.n_gpus_per_node == 0
    )


def data_plane_backend(cfg: Any) -> str:
    """The data-plane backend of a run: `transfer_queue.backend`, but `ray` for `memory` when workers run on Ray
    beyond what the trainer's process can serve them (`serves_memory_plane`)."""
    backend = cfg.transfer_queue.backend
    if backend != "memory" or not use_ray(cfg):
        return backend
    if serves_memory_plane(cfg):
        # Measured on the default task with two CPU ranks (docs/distributed.md): 1.4-1.8x the steps/s of the object
        # store, whose per-operation cost (round trips, a storage actor's answer) dominates a batch of short rows.
        logger.info(
            "workers run on Ray on this machine: the trainer's process serves them the memory data plane "
            "over a Unix socket"
        )
        return backend
    # The embedded store lives in the trainer's process; actors on other machines cannot reach its socket, and
    # GPU batches, unmeasured through the socket, keep the object store's zero-copy reads.
    logger.info(
        "workers run on Ray: using the ray data plane instead of transfer_queue.backend=memory (%s)",
        "workers may run on other machines"
        if _may_span_machines(cfg)
        else "GPU workers read their batches from Ray's object store",
    )
    return "ray"


def ensure_ray(cfg: Any) -> bool:
    """Initialise Ray unless it already is (connect to `ray.address`, else start a local one); True if we did."""
    try:
        import ray
    except ImportError as err:
        raise ValueError(
            f"this run needs Ray (workers or data plane on Ray): pip install 'conveyor[ray]' ({err})"
        ) from err
    if ray.is_initialized():
        return False
    # Worker output (warnings, tracebacks) belongs in the run's console.
    common: dict[str, Any] = {"log_to_driver": True}
    if cfg.ray.address:
        logger.info("connecting to the Ray cluster at %s", cfg.ray.address)
        _check_reachable(cfg.ray.address, cfg.ray.timeout_s)
        try:
            _init_keeping_stop_handlers(ray, address=cfg.ray.address, **common)
        except ConnectionError as err:
            raise ValueError(
                f"ray.address={cfg.ray.address!r}: cannot connect to a Ray cluster there ({err}); "
                "start one with `ray start --head`, or unset ray.address to start a local one"
            ) from err
    else:
        num_cpus = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else os.cpu_count() or 1
        logger.info("starting a local Ray with %d logical CPUs", num_cpus)
        # address="local": a new Ray of our own, never a cluster some other process started on this machine.
        _init_keeping_stop_handlers(ray, address="local", num_cpus=num_cpus, include_dashboard=False, **common)
    return True


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _init_keeping_stop_handlers(ray: Any, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` with the process's SIGINT/SIGTERM handlers in place before and after it.

    `ray.init` replaces the driver's SIGTERM handler with `sys.exit(15)` while it starts, and its core worker then
    installs a native one that prints a stack and aborts: a stop in that window would exit 15 or 134 and skip the
    run's clean-up. A SIGTERM that Ray's handler turned into `SystemExit` is handed to the handler that was in place,
    and a Ray left half-started by any stop is shut down before the stop goes on.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        ray.init(**kwargs)
        return
    saved = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    _without_native_failure_handler()
    try:
        ray.init(**kwargs)
    except BaseException as err:
        _restore(saved)
        ray.shutdown()  # what had started of it (a no-op when nothing had)
        stopped_by = _stop_signal(err)
        if stopped_by is not None:
            atexit.register(_exit_before_teardown, 128 + stopped_by)
        handler = saved[signal.SIGTERM]
        if isinstance(err, SystemExit) and err.code == signal.SIGTERM and callable(handler):
            handler(signal.SIGTERM, None)  # the run's own reaction to a SIGTERM (a stop with 143)
        raise
    _restore(saved)


def _without_native_failure_handler() -> None:
    """Keep this driver's core worker from installing Ray's native failure-signal handler.

    That handler takes SIGTERM too: a stop while `ray.init` connects printed a native stack
    (`logging.cc ... *** SIGTERM received`) before the run's own handler was back. It is Ray's
    `RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, read from its constants module when the core worker starts; set here
    for this process only (Ray's workers and raylet keep theirs), since the variable itself is read at import.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without that module: its handler stays, and only the window's stack shows
        return
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def _stop_signal(err: BaseException) -> int | None:
    """The stop signal that `err` (raised out of `ray.init`) stands for, or None for any other failure."""
    if isinstance(err, SystemExit) and err.code == signal.SIGTERM:  # Ray's own SIGTERM handler during init
        return int(signal.SIGTERM)
    if isinstance(err, KeyboardInterrupt):
        return int(getattr(err, "signum", signal.SIGINT))
    return None


def _exit_before_teardown(status: int) -> None:
    """At exit, after a stop cut `ray.init` short: run the other exit handlers, then end with `status` at once.

    A core worker stopped half-way through its connection leaves native threads that the interpreter's teardown
    aborts or crashes on (seen as status -6 or -11 instead of 143 on about one stop in five inside that window), so
    the process ends before that teardown: everything of the run's own clean-up has run by then.
    """
    atexit.unregister(_exit_before_teardown)
    atexit._run_exitfuncs()  # the handlers registered before this one, which os._exit would skip
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or gone console: nothing more can be said on it
            pass
    os._exit(status)


def _restore(saved: dict[int, Any]) -> None:
    # signal.signal also replaces a native handler installed below Python (Ray's core worker installs one for SIGTERM).
    for signum, handler in saved.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast on a host:port where nothing listens (Ray itself retries such an address for minutes)."""
    if "://" in address or address == "auto" or ":" not in address:
        return  # "auto" and client addresses fail fast in ray.init on their own
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as err:
        raise ValueError(
            f"ray.address={address!r}: no Ray head answers there ({err}); start one with "
            "`ray start --head --port=6379` on that node, or fix ray.address"
        ) from err


def shutdown_ray(started: bool) -> None:
    """Shut Ray down if `ensure_ray` started it (disconnects from a cluster; stops a local one)."""
    if not started:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
