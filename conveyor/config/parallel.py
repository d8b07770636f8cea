"""Cross-section checks of the sequence-parallel sizes (`ulysses_sequence_parallel_size` of actor, ref, critic).

Each is a config error naming the key and what to change, raised where the config is loaded, before any rank
starts. It deliberately imports nothing it configures: the model's own heads are checked again by the workers
(`conveyor.workers.training.sequence_parallel.check_sequence_parallel`) for checkpoints this cannot read.
"""

from __future__ import annotations

from typing import Any

from conveyor.config.fields import F, check

__all__ = ["check_sequence_parallel_sizes", "ref_sequence_parallel_size", "ulysses_size_field"]

_HELP = (
    "ranks each packed micro-batch is split over by tokens (DeepSpeed-Ulysses, verl's key): they take the same rows, "
    "attention swaps the token split for a head split by all-to-all, so activations per rank are 1/size; must "
    "divide the role's ranks and the model's attention and key/value heads, and needs packed forwards "
    "(actor_rollout_ref.model.use_remove_padding); 1 = off"
)


def ulysses_size_field(follows_actor: bool = False) -> Any:
    """The `ulysses_sequence_parallel_size` field of a role's config (actor, critic; the reference's, which
    `follows_actor`, defaults to null: the actor's size, as verl's does)."""
    if follows_actor:
        return F(None, f"{_HELP}; null = actor_rollout_ref.actor's", ge=1, resume_neutral=True)
    return F(1, _HELP, ge=1, resume_neutral=True)


def ref_sequence_parallel_size(arr: Any) -> int:
    """The reference's SP size in the `actor_rollout_ref` section `arr`: its own, or the actor's when null."""
    own = arr.ref.ulysses_sequence_parallel_size
    return arr.actor.ulysses_sequence_parallel_size if own is None else own


def check_sequence_parallel_sizes(cfg: Any, world: int) -> None:
    """Each role's SP size divides its ranks (and a tiny model's heads), with packed forwards and a strategy."""
    arr = cfg.actor_rollout_ref
    tiny = arr.model.tiny if arr.model.path is None else None
    roles = (
        ("actor_rollout_ref.actor", arr.actor),
        ("actor_rollout_ref.ref", arr.ref),
        ("critic", cfg.critic),
    )
    sizes = {"actor_rollout_ref.ref": ref_sequence_parallel_size(arr)}
    for prefix, role in roles:
        sp = sizes.get(prefix, role.ulysses_sequence_parallel_size)
        if sp == 1:
            continue
        key = f"{prefix}.ulysses_sequence_parallel_size"
        check(
            world % sp == 0,
            key,
            f"must divide the {world} ranks (trainer.nnodes x trainer.n_gpus_per_node or "
            f"trainer.num_cpu_workers), got {sp}",
        )
        check(
            role.strategy in (None, "fsdp2", "dp"),
            key,
            f"splits sequences over ranks, which strategy {role.strategy} does not have: set "
            f"{prefix}.strategy=fsdp2 or {key}=1",
        )
        check(
            arr.model.use_remove_padding is not False,
            key,
            f"splits packed rows: set actor_rollout_ref.model.use_remove_padding=true (or null) or {key}=1",
        )
        if tiny is not None:
            for name, heads in (("num_heads", tiny.num_heads), ("num_kv_heads", tiny.num_kv_heads)):
                check(
                    heads % sp == 0,
                    key,
                    f"must divide actor_rollout_ref.model.tiny.{name}={heads} (attention runs on heads / {sp} "
                    f"per rank): set {key} to a divisor of {heads}",
                )
    router = arr.actor.router
    check(
        arr.actor.ulysses_sequence_parallel_size == 1 or (router.aux_loss_coef == 0 and router.bias_update_rate == 0),
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "the router's load-balancing controls (router.aux_loss_coef, router.bias_update_rate) do not run under "
        "sequence parallelism yet: set them to 0 or this to 1",
    )
