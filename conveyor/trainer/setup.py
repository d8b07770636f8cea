"""Everything a run needs before its first step: the model checkpoint, the prompts, the data plane, the device.

The workers are built by `conveyor.workers.placement.roles.build_worker_groups`.

The default run needs no files: the tiny model and its character tokenizer are
built from config and warm-started once, then cached (CONVEYOR_CACHE, default
~/.cache/conveyor) under a name derived from every setting that shapes them,
so a changed setting builds a new one and an unchanged one is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from conveyor.config import Config, ConfigError
from conveyor.data_plane import DataPlane, make_data_plane
from conveyor.files import describe_os_error, environment_error, make_dir
from conveyor.ray_utils import data_plane_backend

logger = logging.getLogger(__name__)

__all__ = [
    "cache_dir",
    "check_local_resources",
    "prepare_default_model",
    "load_prompt_records",
    "resolve_device",
    "build_data_plane",
]

# Bump when the warm start or the tiny model's construction changes meaning.
_TINY_RECIPE_VERSION = 1


def cache_dir() -> Path:
    """Where built artefacts (the tiny model) are cached."""
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def resolve_device(cfg: Config) -> str:
    """The torch device of this run's workers."""
    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but no CUDA device is visible; use trainer.device=cpu")
    return cfg.trainer.device


# Ray refuses a bundle of zero resources; the placement gives such a rank this much CPU instead.
_MIN_BUNDLE_CPU = 0.001


def check_local_resources(cfg: Config, plan: Any) -> None:
    """Refuse, before Ray starts, ranks that the Ray this run would start on this machine can never hold.

    A run on Ray without `ray.address` starts a one-node Ray with `ray.num_cpus` CPUs (default: this machine's)
    and the GPUs it sees. Its placement asks one bundle per model rank (`ray.worker_cpus` CPUs and, on GPUs,
    one GPU) and one per rollout replica or reward worker; waiting for Ray to start (seconds) only to be told
    that they cannot fit wastes that wait. A cluster given by `ray.address`, or a Ray already started in this
    process, is checked by the placement once connected.
    """
    from conveyor.workers.placement.group import use_ray

    if not use_ray(cfg) or cfg.ray.address is not None:
        return
    ray = sys.modules.get("ray")  # never imported here for this: Ray's import alone takes seconds
    if ray is not None and ray.is_initialized():
        return  # a Ray someone else started (a notebook, a test) is the run's, with what it has
    t, ro = cfg.trainer, cfg.actor_rollout_ref.rollout
    gpu = t.n_gpus_per_node > 0
    per_node = max(t.n_gpus_per_node, t.num_cpu_workers)
    ranks = t.nnodes * per_node
    ranks_key = "trainer.n_gpus_per_node" if gpu else "trainer.num_cpu_workers"
    # The reward worker, or the rollout replicas it shares a process with (`build_ray_rollout_groups`), as the
    # run plan placed the rollout.
    separate = plan.rollout_placement == "separate"
    others = ro.replicas if separate else 1
    others_what = (
        f"{others} rollout replica(s) (actor_rollout_ref.rollout.replicas)" if separate else "the reward worker"
    )
    cpus_each = max(cfg.ray.worker_cpus, _MIN_BUNDLE_CPU)
    need_cpu = (ranks + others) * cpus_each
    have_cpu = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else os.cpu_count() or 1
    cpu_key = "ray.num_cpus" if cfg.ray.num_cpus is not None else "ray.num_cpus (unset: this machine's cores)"
    if need_cpu > have_cpu + 1e-9:
        raise ConfigError(
            f"{ranks_key}: {ranks} rank(s) (trainer.nnodes={t.nnodes} x {per_node}) and {others_what} at "
            f"ray.worker_cpus={cfg.ray.worker_cpus:g} CPUs each need {need_cpu:g} CPUs, more than the "
            f"{have_cpu:g} of the Ray this run starts on this machine ({cpu_key}); lower {ranks_key}"
            + ("" if t.nnodes == 1 else " or trainer.nnodes")
            + ", lower ray.worker_cpus (fractions are fine), or give a cluster with ray.address"
        )
    if gpu:
        have_gpu = torch.cuda.device_count()
        need_gpu = ranks + (others * ro.tensor_model_parallel_size if separate else 0)
        if need_gpu > have_gpu:
            replicas = f" and {others_what} x {ro.tensor_model_parallel_size}" if separate else ""
            raise ConfigError(
                f"trainer.n_gpus_per_node: {ranks} GPU rank(s) (trainer.nnodes={t.nnodes} x "
                f"trainer.n_gpus_per_node={t.n_gpus_per_node}){replicas} need {need_gpu} GPUs, but the Ray it starts "
                f"here would see {have_gpu}; lower trainer.n_gpus_per_node (0 runs CPU workers), or give a cluster "
                "with ray.address"
            )


def policy_sees_images(cfg: Config) -> bool:
    """Whether the policy is a vision-language model: its checkpoint's config.json has a vision tower."""
    from conveyor.models.loading import read_config_json

    path = cfg.actor_rollout_ref.model.path
    if not path or not (Path(path).expanduser() / "config.json").is_file():
        return False  # the tiny text model, or a path whose problem prepare_default_model names
    return isinstance(read_config_json(path).get("vision_config"), dict)


def _load_files(paths: list[str], media: bool = False) -> tuple[list[dict], list[str]]:
    """The records of parquet files, and where each one came from (file and row), for messages that name it."""
    from conveyor.tasks.parquet import load_parquet_records

    records: list[dict] = []
    origins: list[str] = []
    for path in paths:
        rows = load_parquet_records(path, media=media)
        records.extend(rows)
        origins.extend(f"parquet file {path!r}, row {i}" for i in range(len(rows)))
    return records, origins


def _synthetic(cfg: Config, split: str) -> tuple[list[dict], list[str]]:
    """A split of the built-in task, with an origin per problem."""
    from conveyor.tasks import SYNTHETIC_TASKS

    d, syn = cfg.data, cfg.data.synthetic
    count, seed = (syn.num_train, d.seed) if split == "train" else (syn.num_val, d.seed + 1)
    make = SYNTHETIC_TASKS[syn.task]
    records = make(count, seed=seed, max_operand=syn.max_operand, ops=syn.ops, split=split)
    return records, [f"synthetic {split} problem {i}" for i in range(len(records))]


def _prompt_tokenizer(cfg: Config) -> Any:
    """The tokenizer the run's prompts are tokenized with: the configured one, or the tiny model's characters."""
    m = cfg.actor_rollout_ref.model
    path = m.tokenizer_path or m.path
    if path:
        from conveyor.models.loading import load_tokenizer

        return load_tokenizer(path, trust_remote_code=m.trust_remote_code)
    from conveyor.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()  # what prepare_default_model saves with the tiny model


def _vision_processor(cfg: Config, tokenizer: Any) -> Any:
    """The policy's image half of stage 1 (`conveyor.models.vision`), or None for a text policy."""
    if not policy_sees_images(cfg):
        return None
    from conveyor.models.loading import load_model_config
    from conveyor.models.vision import vision_processor

    m = cfg.actor_rollout_ref.model
    return vision_processor(m.path, tokenizer, load_model_config(m.path, trust_remote_code=m.trust_remote_code))


def _check_prompts(cfg: Config, records: list[dict], origins: list[str], tokenizer: Any) -> None:
    """Every prompt renders, tokenizes to something, and fits data.max_prompt_length (or may be cut); memory fits.

    Done at load, as the trainer will do it for each batch (`render_prompt`, no
    special tokens added), so one bad row stops the run before any model work
    rather than when its batch is drawn, perhaps hours in.
    """
    from conveyor.tasks.dataset import check_prompt_length, render_prompt

    d = cfg.data
    texts = []
    vision = _vision_processor(cfg, tokenizer)
    with_images: set[int] = set()
    for i, (rec, origin) in enumerate(zip(records, origins)):
        try:
            text = render_prompt(rec, tokenizer)
            if vision is not None:
                # Measured as the model will read it: each '<image>' as its image's pad tokens (the images decoded
                # here once, so an unreadable one is named at load).
                _, grids = vision.process(vision.images(rec, origin))
                text = vision.expand(text, grids, origin)
                if grids:
                    with_images.add(i)
            texts.append(text)
        except ValueError as err:
            raise ValueError(err if str(err).startswith(origin) else f"{origin}: {err}") from err
    distinct = list(dict.fromkeys(texts))
    lengths = dict(zip(distinct, (len(ids) for ids in tokenizer(distinct, add_special_tokens=False)["input_ids"])))
    longest, longest_origin = 0, ""
    for i, (text, origin) in enumerate(zip(texts, origins)):
        n = lengths[text]
        if n == 0:
            raise ValueError(f"{origin}: the prompt is empty once tokenized; give it some text")
        if n > d.max_prompt_length and i in with_images:
            raise ValueError(
                f"{origin}: the prompt with its images is {n} tokens, more than data.max_prompt_length="
                f"{d.max_prompt_length}, and a prompt with images is not cut (its image tokens would lose their "
                "pixels); raise data.max_prompt_length"
            )
        if n > d.max_prompt_length:
            try:
                check_prompt_length([0] * n, d.max_prompt_length, d.truncation)  # its one message for this
            except ValueError as err:
                raise ValueError(f"{origin}: {err}") from err
        if n > longest:
            longest, longest_origin = n, origin
    _check_attention_memory(cfg, min(longest, d.max_prompt_length), longest_origin)


def _attention_heads(cfg: Config) -> int:
    """Attention heads of the policy (from config.json for a checkpoint; 1 when it does not say)."""
    m = cfg.actor_rollout_ref.model
    if not m.path:
        return m.tiny.num_heads
    from conveyor.models.loading import read_config_json

    config = read_config_json(m.path)
    for section in (config, config.get("text_config") or {}):
        heads = section.get("num_attention_heads") if isinstance(section, dict) else None
        if isinstance(heads, int) and heads > 0:
            return heads
    return 1


def _check_attention_memory(cfg: Config, prompt_tokens: int, origin: str) -> None:
    """Refuse, before anything is allocated, a sequence whose attention cannot fit in this machine's memory.

    On a CPU the forward builds an L x L attention mask and, per head, L x L
    float32 scores for each sequence of L tokens: L^2 * (1 + 4 * heads) bytes
    is a lower bound of its peak. Beyond the machine's memory the process
    would only be killed by the kernel, with no message. A GPU's attention
    kernels need not hold L x L scores, so no bound is assumed there.
    """
    device = cfg.trainer.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return  # no way to know this machine's memory: nothing to compare with
    length = prompt_tokens + cfg.data.max_response_length
    heads = _attention_heads(cfg)
    need = length * length * (1 + 4 * heads)
    if need > total:
        raise ValueError(
            f"{origin}: its prompt makes sequences of {length} tokens (with data.max_response_length="
            f"{cfg.data.max_response_length}), and attention over one of them on the CPU needs at least "
            f"{need / 2**30:.0f} GiB ({length}^2 x (1 + 4 x {heads} heads) bytes), more than this machine's "
            f"{total / 2**30:.0f} GiB; shorten the prompt, or lower data.max_prompt_length with data.truncation=left"
        )


def load_prompt_records(cfg: Config, tokenizer: Any = None) -> tuple[list[dict], list[dict]]:
    """(train, validation) prompt records: from parquet files when given, else the synthetic task's splits.

    Every prompt is checked here, naming its file and row: it must render and
    tokenize (with `tokenizer`, by default the run's own) to at most
    data.max_prompt_length tokens under data.truncation=error, and its
    data_source must have a reward function.
    """
    d = cfg.data
    media = policy_sees_images(cfg)
    train, train_origins = _load_files(d.train_files, media) if d.train_files else _synthetic(cfg, "train")
    if d.val_files:
        val, val_origins = _load_files(d.val_files, media)
    elif not d.train_files:
        val, val_origins = _synthetic(cfg, "test")
    else:
        val, val_origins = [], []
    if d.val_batch_size is not None:
        val, val_origins = val[: d.val_batch_size], val_origins[: d.val_batch_size]
    if not media and not d.train_files:
        with_images = next((o for r, o in zip(train + val, train_origins + val_origins) if r.get("images")), None)
        if with_images is not None:
            raise ConfigError(
                f"{with_images}: data.synthetic.task={d.synthetic.task} draws images, but the policy is a text model; "
                "set actor_rollout_ref.model.path to a vision-language checkpoint (conveyor build-vlm writes one)"
            )
    _check_prompts(
        cfg, train + val, train_origins + val_origins, tokenizer if tokenizer is not None else _prompt_tokenizer(cfg)
    )
    if not cfg.reward.custom_reward_function.path:
        # Checked now, not at the first reward stage after the model is built and has generated.
        from conveyor.tasks.rewards import get_reward_fn, ground_truth_problem

        checked: set[str] = set()
        for rec, origin in zip(train + val, train_origins + val_origins):
            source = rec.get("data_source")
            if not (isinstance(source, str) and source in checked):
                try:
                    get_reward_fn(source)  # a non-string data_source is refused here too
                except ValueError as err:
                    raise ValueError(f"{origin}: {err}, or set reward.custom_reward_function.path") from err
                checked.add(source)
            # A row its reward can never match would score 0 for every response, or fail its step hours in.
            problem = ground_truth_problem(source, (rec.get("reward_model") or {}).get("ground_truth"))
            if problem:
                raise ValueError(f"{origin}: {problem}")
    return train, val


def _check_max_positions(cfg: Config, path: str) -> None:
    """data.max_prompt_length + data.max_response_length must fit the checkpoint's positions (checked before
    loading)."""
    from conveyor.models.loading import max_positions, read_config_json

    found = max_positions(read_config_json(path))
    if found is None:
        return  # the config does not say; the model itself will tell
    limit, how = found
    d = cfg.data
    total = d.max_prompt_length + d.max_response_length
    if total > limit:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = "
            f"{total} tokens, more than the {limit} positions of the model in {str(path)!r} ({how} in its "
            "config.json); lower data.max_prompt_length (data.truncation=left cuts longer prompts) or "
            "data.max_response_length"
        )


def _tiny_key(cfg: Config) -> str:
    tiny = dataclasses.asdict(cfg.actor_rollout_ref.model.tiny)
    syn = dataclasses.asdict(cfg.data.synthetic)
    if syn.get("task") == "arithmetic":
        del syn["task"]  # the default task keeps the key it had before tasks were selectable
    # The positions the model is built with follow the data's lengths: two runs that differ only there must not
    # share a cached model (the shorter one's would refuse the longer sequences).
    blob = json.dumps(
        {
            "tiny": tiny,
            "task": syn,
            "seed": cfg.data.seed,
            "v": _TINY_RECIPE_VERSION,
            "positions": _tiny_positions(cfg),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _tiny_positions(cfg: Config) -> int:
    """The tiny model's max_position_embeddings: the longest prompt + response, and a few spare."""
    return cfg.data.max_prompt_length + cfg.data.max_response_length + 8


def prepare_default_model(cfg: Config) -> str:
    """The checkpoint directory of the policy: the configured path, or the cached tiny model (built on first use)."""
    # loading.py is the one place that knows what a checkpoint directory needs.
    from conveyor.models.loading import check_checkpoint_dir, check_tokenizer_dir

    model = cfg.actor_rollout_ref.model
    path = model.path
    if path:
        # Everything a checkpoint directory can get wrong is found here, before anything is built.
        check_checkpoint_dir(path, trust_remote_code=model.trust_remote_code)
        check_tokenizer_dir(model.tokenizer_path or path)
        _check_max_positions(cfg, path)
        return str(path)
    tiny = cfg.actor_rollout_ref.model.tiny
    target = cache_dir() / f"tiny-{tiny.arch}-{_tiny_key(cfg)}"
    if (target / "config.json").is_file():
        try:
            check_checkpoint_dir(str(target), trust_remote_code=False)
        except ValueError as err:
            # Not the user's checkpoint to copy again: the cache's own copy was cut short (a full disk, a kill).
            problem = str(err).split(";")[0]  # what is wrong, without the advice meant for a user's own checkpoint
            raise ValueError(
                f"the cached tiny model {target} is damaged ({problem}); delete that folder "
                f"(rm -r {target}) and run again to rebuild it"
            ) from err
        return str(target)
    # Checked before the minutes of building: a cache under a file or on a read-only disk fails at once.
    make_dir(target.parent, "CONVEYOR_CACHE (the model cache)")
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer
    from conveyor.trainer.warmstart import supervised_warmstart

    logger.info("building the tiny %s model (first use) into %s", tiny.arch, target)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        tiny.arch,
        tokenizer,
        seed=tiny.seed,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        num_kv_heads=tiny.num_kv_heads,
        intermediate_size=tiny.intermediate_size,
        num_experts=tiny.num_experts,
        top_k=tiny.top_k,
        max_position_embeddings=_tiny_positions(cfg),
    )
    if tiny.warmstart_steps:
        train, _ = load_prompt_records(cfg) if not cfg.data.train_files else (None, None)
        if train is None:
            raise ConfigError(
                "actor_rollout_ref.model.tiny.warmstart_steps needs the synthetic task; "
                "set it to 0 when using data.train_files, or give actor_rollout_ref.model.path"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tiny.seed)
            supervised_warmstart(
                model,
                tokenizer,
                train,
                steps=tiny.warmstart_steps,
                lr=tiny.warmstart_lr,
                seed=tiny.seed,
                until_accuracy=tiny.warmstart_until_accuracy,
            )
    # Write beside the target and rename into place, so a concurrent or killed
    # build never leaves a half-written checkpoint under the final name.
    try:
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    except OSError as err:
        raise ValueError(
            f"CONVEYOR_CACHE (the model cache): cannot write into {target.parent}: {describe_os_error(err)}"
        ) from err
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written model must not stay to fill the disk
        cause = environment_error(err)
        if cause is None:
            raise
        raise ValueError(
            f"CONVEYOR_CACHE (the model cache): writing the tiny model into {target.parent} failed: "
            f"{describe_os_error(cause)}"
        ) from err
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return str(target)


def build_data_plane(cfg: Config, registry: Any = None) -> DataPlane:
    """The data plane of `transfer_queue.*` (`ray` instead of `memory` when workers run on Ray), metrics in
    `registry`."""
    tq = cfg.transfer_queue
    backend = data_plane_backend(cfg)
    options: dict[str, Any] = {}
    if backend == "ray":
        options = {
            "num_storage_actors": tq.num_storage_actors,
            "actor_cpus": tq.storage_actor_cpus,
            "timeout_s": cfg.ray.timeout_s,
        }
    elif backend == "transferqueue":
        options = {"tq_config": dict(tq.transferqueue), "host": tq.host}
    return make_data_plane(
        backend,
        metrics_enabled=tq.metrics.enabled,
        metrics_port=tq.metrics.port,
        metrics_host=tq.metrics.host,
        registry=registry,
        **options,
    )
