"""The composition root of a training run: build every part from the config, train, and take it all down.

`run_training(cfg)` resolves the device, makes the run's decisions once
(`conveyor.trainer.plan.build_run_plan`: logged, saved as plan.json, and
handed to the trainer and every worker), locks the run directory, checks a
resume against the saved config and the checkpoints already in the run
directory before anything is built, writes the resolved config, checks that
the rollout engine can serve the model, loads the tokenizer and prompts, and
builds, in order, the Prometheus endpoint (when enabled), Ray (when the run
needs it), the data plane, the worker groups and the trackers; it runs the
one trainer, `PPOTrainer` (which takes its samples from the source the config
names, `conveyor.trainer.sources`), and closes what it built in reverse order
whatever happens.

This is the one place that knows every part; the trainer gets its parts
injected. What it deliberately does not do: train (the trainer does) or decide
how each part is built (`trainer/setup.py`, `workers/roles.py`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.config import Config, config_to_dict
from conveyor.files import write_text_atomic
from conveyor.metrics.trackers import Tracking
from conveyor.models.loading import load_model_config, load_tokenizer
from conveyor.ray_utils import ensure_ray, needs_ray, shutdown_ray
from conveyor.rollout.base import engine_spec
from conveyor.trainer import checkpoint as ckpt
from conveyor.trainer.distillation import check_teachers
from conveyor.trainer.plan import RunPlan, build_run_plan
from conveyor.trainer.ppo import PPOTrainer
from conveyor.trainer.rollout_dumps import check_replay
from conveyor.trainer.run_dir import check_no_newer_checkpoints, check_resume, open_run_dir, write_config
from conveyor.trainer.setup import (
    build_data_plane,
    check_local_resources,
    load_prompt_records,
    prepare_default_model,
    resolve_device,
)
from conveyor.trainer.signals import Reaper, StopRequested, StopSignals
from conveyor.trainer.vlm_checks import check_vlm_run
from conveyor.workers.placement.recovery import stopped_by_fault
from conveyor.workers.placement.roles import build_worker_groups
from conveyor.workers.ranks.perf import frozen_heap
from conveyor.workers.ranks.reward_model import check_scorer_vocabularies
from conveyor.workers.training.memory_budget import check_memory

logger = logging.getLogger(__name__)

__all__ = ["run_training"]


def run_training(cfg: Config) -> dict[str, float]:
    """Build everything from `cfg`, train, and close the data plane (and workers) whatever happens."""
    import transformers

    # Loading and saving tiny checkpoints is instant; the library's bars are noise in our console.
    transformers.utils.logging.disable_progress_bar()
    device = resolve_device(cfg)  # an unusable device fails before anything is built or written
    plan = build_run_plan(cfg, device)  # every decision of the run, once; a contradiction fails here
    check_local_resources(cfg, plan)  # before Ray starts: ranks this machine's Ray could never hold
    logger.info("%s", plan.describe())
    for warning in (plan.replay_reason, *plan.warnings):
        if warning:
            logger.warning("%s", warning)
    run_dir = cfg.run_dir
    # Outside the training loop (start-up, the last clean-up) a Ctrl-C or SIGTERM stops at once, through
    # every `finally` below: a SIGTERM's default action would end the process before any of them ran,
    # leaving the rollout process, Ray and the data plane to stop by themselves, if ever.
    stops = StopSignals(save_on_interrupt=False, step=lambda: 0).install()
    try:
        lock = open_run_dir(cfg)
        log_file = _log_to_file(run_dir / "train.log")
        try:
            return _train_in(cfg, run_dir, device, plan)
        finally:
            if log_file is not None:
                logging.getLogger().removeHandler(log_file)
                log_file.close()
            lock.release()
    except KeyboardInterrupt as err:
        # A library that catches the stop and raises a plain KeyboardInterrupt in its place (Ray's waits do) loses
        # which signal it was: a SIGTERM must still end the run with 143.
        if getattr(err, "signum", None) is None and stops.last:
            raise StopRequested(stops.last) from err
        raise
    finally:
        stops.restore()


def _log_to_file(path: Path) -> logging.Handler | None:
    """Copy the run's log into `path` (appended to on a resume): a terminal that goes away takes its stderr with it."""
    try:
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:  # an unusable run directory is reported where the config is written, with the key to change
        return None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    return handler


def _resume_check(cfg: Config, run_dir: Path) -> bool:
    """Check the checkpoint a resume would load against this config and the run directory before anything is built
    (True: accepted change)."""
    path = ckpt.resume_path(cfg.trainer, run_dir / "checkpoints")
    state = ckpt.load_checkpoint(path)["trainer_state"] if path is not None else None
    check_no_newer_checkpoints(cfg, run_dir, path, int(state["global_step"]) if state is not None else 0)
    if path is None:
        return False
    return check_resume(cfg, path, state.get("config"))


def _check_engine_serves(cfg: Config, plan: RunPlan, model_config: Any, device: str) -> None:
    """Refuse a model the rollout engine cannot serve on `device` before any worker is built, naming what to change."""
    model = cfg.actor_rollout_ref.model
    ro = cfg.actor_rollout_ref.rollout
    source = (
        f"checkpoint {model.path} (actor_rollout_ref.model.path)"
        if model.path
        else "the tiny model (actor_rollout_ref.model.tiny)"
    )
    length_key = (
        "actor_rollout_ref.rollout.max_model_len"
        if ro.max_model_len is not None
        else "data.max_prompt_length + data.max_response_length"
    )
    engine_spec(ro.name).check_model(
        model_config, device=device, max_model_len=plan.engine_max_model_len, source=source, length_key=length_key
    )


def _train_in(cfg: Config, run_dir: Path, device: str, plan: RunPlan) -> dict[str, float]:
    """run_training's body, with the run directory locked."""
    changed = _resume_check(cfg, run_dir)
    if cfg.trainer.replay_rollouts_from:
        check_replay(cfg)  # a bundle of another model or batch shape is refused before anything is built
    try:
        write_config(cfg, run_dir, keep_previous=changed)
        write_text_atomic(run_dir / "plan.json", json.dumps(plan.to_dict(), indent=2) + "\n")
    except OSError as err:
        raise ValueError(
            f"cannot write {run_dir / 'config.yaml'} ({err.strerror or err}); choose a writable run "
            "directory with trainer.default_local_dir"
        ) from err
    torch.manual_seed(cfg.trainer.seed)
    np.random.seed(cfg.trainer.seed % 2**32)

    model_path = prepare_default_model(cfg)
    trust = cfg.actor_rollout_ref.model.trust_remote_code
    model_config = load_model_config(model_path, trust_remote_code=trust)
    check_vlm_run(cfg, plan, model_config)  # a vision-language policy runs only the paths that carry its images
    _check_engine_serves(cfg, plan, model_config, device)
    check_memory(cfg, plan, model_config, device)  # before any worker claims GPU memory: no OOM at the first wake-up
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path or model_path, trust_remote_code=trust)
    train_records, val_records = load_prompt_records(cfg, tokenizer)  # the run's tokenizer, loaded once
    if plan.use_teacher:
        check_teachers(cfg, tokenizer, model_config)  # a teacher with other tokens is refused before any worker
    if plan.use_reward_model or plan.use_judge:  # from config.json and the tokenizer: before any weights load
        check_scorer_vocabularies(cfg, reward_model=plan.use_reward_model, judge=plan.use_judge)

    registry = server = gauges = None
    if cfg.trainer.prometheus.enabled:
        from prometheus_client import CollectorRegistry

        from conveyor.data_plane.prometheus import serve_registry
        from conveyor.metrics.train_prometheus import TrainingGauges

        registry = CollectorRegistry()
        gauges = TrainingGauges(registry)
        server, port = serve_registry(registry, cfg.trainer.prometheus.host, cfg.trainer.prometheus.port)
        logger.info("training metrics for Prometheus at http://%s:%d/metrics", cfg.trainer.prometheus.host, port)

    data_plane = None
    workers = None
    tracking = None
    failed = True
    ray_started = False
    reaper = None
    try:
        if needs_ray(cfg, plan) and not cfg.ray.address:
            # A local Ray is this run's own: its processes must not outlive a trainer killed outright.
            reaper = Reaper()
        ray_started = ensure_ray(cfg) if needs_ray(cfg, plan) else False
        data_plane = build_data_plane(cfg, registry=registry)
        workers = build_worker_groups(cfg, plan, model_path, data_plane, tokenizer, device)
        tracking = Tracking(
            cfg.trainer.logger,
            run_dir=run_dir,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
            config=config_to_dict(cfg),
        )
        trainer = PPOTrainer(
            cfg,
            plan=plan,
            data_plane=data_plane,
            workers=workers,
            tokenizer=tokenizer,
            train_records=train_records,
            # Validation generates, and a replaying run has no rollout engine.
            val_records=[] if cfg.trainer.replay_rollouts_from else val_records,
            tracking=tracking,
            run_dir=run_dir,
            model_config=model_config,
            prometheus=gauges,
        )
        try:
            with frozen_heap():  # what is built now lives as long as the run: no garbage collection walks it again
                result = trainer.fit()
        except Exception as err:  # a replica past its restarts, a lost rank: one line naming the checkpoint
            newest = ckpt.list_checkpoints(run_dir / "checkpoints")
            fault = stopped_by_fault(err, str(newest[-1][1]) if newest else None)
            if fault is None:
                raise
            raise fault from err
        failed = False
        return result
    finally:
        if tracking is not None:
            tracking.close(failed=failed)
        if workers is not None:
            workers.shutdown()
        if data_plane is not None:
            data_plane.close()
        if server is not None:
            server.shutdown()
        shutdown_ray(ray_started)  # after the data plane: its storage actors live in Ray
        if reaper is not None:
            reaper.release(sweep=failed)
