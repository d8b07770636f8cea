"""The run plan: every decision about what a run does, made once from the config, the device and the engines.

`build_run_plan(cfg, device)` reads the validated config, the device the
workers run on and the rollout engine's declared capabilities
(`conveyor.rollout.base.ROLLOUT_ENGINES[name].capabilities(device)`) and
returns a frozen `RunPlan`: where the old log-probs come from, where the MoE
routing comes from and which replay mode actually runs, whether the
importance weights apply and at which level, whether a critic and a reference
run, and the loss scales. `run_training` builds it before anything else, logs
it and saves it as `plan.json` in the run directory; the trainer and the
workers' settings (`conveyor.workers.ranks.settings`) read their part of it.

The rules:

- replay: R3 replays the routing the rollout recorded. When the engine cannot
  return routing on this device (vLLM on a CPU) R3 runs as R2: the updates
  replay the routing of the old-log-prob forward. R3 with
  `algorithm.rollout_correction.bypass_mode=true` on such an engine is
  refused: R2 needs the forward that bypass mode skips.
- old log-probs: `"rollout"` (bypass: the rollout's log-probs, no forward)
  when bypass_mode says so, or when it is null, the run is on-policy, neither
  R2, rollout_is, rollout_rs nor sum_pi_squared needs the forward, and the engine samples from
  the trainer's own modules (the hf rollout). Otherwise `"update"` when the
  run is off-policy with one optimizer step per batch and no stage needs them
  before the update (no KL in the reward, no rollout_rs, not R2): the
  update's own forward is the proximal policy. Otherwise `"forward"`.
- routing: the rollout captures routing when its engine returns it and R3
  replays it or the load-balance metrics are on (and not R2). Otherwise, with
  the metrics on, the old-log-prob forward records it; R2 always records it
  there. The load-balance metrics then describe the trainer's forward.
- sum_pi_squared: `actor_rollout_ref.actor.calculate_sum_pi_squared`, or when
  null, whether the estimator reads it (the optimal token baselines); it
  turns the old-log-prob forward on like R2 does.
- importance weights: `algorithm.rollout_correction.rollout_is`, or token
  level when null and the run is off-policy.
- roles: each registered role decides whether and where it runs (`Role.decide` in the role table,
  `conveyor.workers.placement.handles` for the built-in ones) into the plan's `roles` map. The critic:
  `critic.enable`, or when null, whether the estimator needs values; the reference: whether a KL term
  (loss or reward) is on, and with LoRA on (`actor_rollout_ref.model.lora_rank > 0`) the actor with its
  adapters disabled (no reference model is built); the teachers: `distillation.enabled`, where
  `distillation.placement` puts them; the reward model: `reward_model.enable`, where
  `reward_model.placement` puts it, except that an asynchronous run on Ray places it apart; the judge:
  `reward_model.judge.enable`, always apart; the rollout replicas when the engines run apart.
- loss scale: the actor's `loss_scale_factor`, else data.max_response_length;
  the critic's own, else the actor's.
- parallelism: one line with the trained roles' ranks, each role's strategy
  and its Ulysses sequence-parallel and expert-parallel sizes above 1.
- a replay (`trainer.replay_rollouts_from`) builds no engine: the configured
  rollout stands for the one that recorded the samples, so the rules above
  decide from it, and the lines say that the old log-probs (under bypass) and
  the captured routing are the recorded ones in the replayed samples.

What it deliberately does not do: check single settings (the config does),
build anything, or change the config.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from conveyor.algos.sampling_mask import rollout_truncation
from conveyor.config import Config, ConfigError
from conveyor.config.parallel import ref_sequence_parallel_size
from conveyor.config.plan import COLOCATED, OLD_LOG_PROB_SOURCES, RunPlan
from conveyor.trainer.faults import faults_survived
from conveyor.trainer.router_plan import auto_replay, check_router_controls
from conveyor.workers.placement.role_table import RoleDecision
from conveyor.workers.placement.roles import ROLES

logger = logging.getLogger(__name__)

__all__ = ["RunPlan", "build_run_plan", "OLD_LOG_PROB_SOURCES", "model_is_moe"]


def model_is_moe(cfg: Config) -> bool:
    """Whether the policy has routed experts, read from the tiny config or config.json (no weights loaded)."""
    model = cfg.actor_rollout_ref.model
    if model.path is None:
        return model.tiny.arch != "qwen3"  # qwen3 is the tiny model's one dense architecture
    from conveyor.models.loading import read_config_json
    from conveyor.models.moe_config import infer_moe_num_experts

    try:
        config = read_config_json(model.path)
    except ValueError:
        return False  # no readable config.json: the checkpoint check names the problem before anything loads
    # transformers 5 writes Qwen3-MoE's (and OLMoE's) expert count as num_local_experts, which
    # infer_moe_num_experts reads for Mixtral and gpt-oss only (its documented contract).
    text = config.get("text_config")  # a vision-language model's text model (Qwen3-VL-MoE) holds its experts
    experts = (
        infer_moe_num_experts(config)
        or config.get("num_local_experts")
        or (text.get("num_local_experts") if isinstance(text, dict) else None)
    )
    return isinstance(experts, int) and experts > 0


def rollout_process(cfg: Config, device: str, placement: str) -> tuple[str, str]:
    """Where the rollout group (and the reward worker) run: ("trainer" | "own", why in words).

    "own": Ray actors of their own (every role of a run on Ray is; an asynchronous run in one process puts these two
    there when `trainer.v1.separate_async.rollout_process=own` asks for it). "trainer": this process, the rollout
    on the asynchronous source's thread (what `auto` picks outside Ray).
    """
    from conveyor.workers.placement.group import use_ray

    if use_ray(cfg):
        return "own", "rollout process: Ray actors (the run is on Ray)"
    v1 = cfg.trainer.v1
    asked = v1.separate_async.rollout_process
    if placement != "separate" or not v1.is_async:
        return "trainer", "rollout process: the trainer's"
    key = "trainer.v1.separate_async.rollout_process"
    if asked == "own":
        ray_missing = importlib.util.find_spec("ray") is None
        if device != "cpu":
            raise ConfigError(
                f"{key}=own on {device}: a rollout process of its own needs a device of its own, which "
                "a run on Ray gives it (trainer.n_gpus_per_node >= 2, or ray.address); set "
                "rollout_process=trainer (or auto) for one device"
            )
        if ray_missing:
            raise ConfigError(
                f"{key}=own puts the rollout in Ray actors, and Ray is not installed: "
                "pip install 'conveyor[ray]', or set rollout_process=trainer"
            )
        return "own", f"rollout process: Ray actors of their own, beside the trainer's ({key}=own)"
    if asked == "trainer":
        return "trainer", f"rollout process: a thread of the trainer's ({key}=trainer)"
    # auto: the thread. Measured on the default run (docs/async.md), processes of their own train faster per step but
    # start about 9 s later (Ray and its actors): the 600-step default run ends sooner on the thread, which also needs
    # no Ray; they pay from about 700 steps on a 2-core machine, and `own` asks for them.
    return "trainer", (
        f"rollout process: a thread of the trainer's ({key}=auto; {key}=own puts the rollout and "
        "reward workers in Ray actors of their own)"
    )


def lone_sample_warning(cfg: Config) -> str | None:
    """What a group-baseline estimator does with one sample a prompt, when the task reward drives the update."""
    from conveyor.algos.advantages import estimator_needs

    algo, n = cfg.algorithm, cfg.actor_rollout_ref.rollout.n
    pure_distillation = cfg.distillation.enabled and not cfg.distillation.distillation_loss.use_task_rewards
    if n > 1 or pure_distillation or not estimator_needs(algo.adv_estimator).group_baseline:
        return None
    # verl accepts it too (a lone sample keeps its raw score), so it is said, not refused.
    return (
        f"advantages: algorithm.adv_estimator={algo.adv_estimator} compares the samples of a prompt, and "
        "actor_rollout_ref.rollout.n=1 gives each prompt one: no baseline (each advantage is its raw score"
        + (", zero for rloo" if algo.adv_estimator == "rloo" else "")
        + "); set rollout.n to 2 or more for one"
    )


def forward_writes_sum_pi_squared(cfg: Config) -> bool:
    """Whether the old-log-prob forward writes sum_pi_squared: the actor's key, or when null, the estimator's need."""
    from conveyor.algos.advantages import estimator_needs

    asked = cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
    return asked if asked is not None else estimator_needs(cfg.algorithm.adv_estimator).sum_pi_squared


def parallelism_decision(cfg: Config, roles: dict[str, str]) -> str:
    """The plan's line of how the trained roles' ranks hold and split the work (`roles`: the plan's map): each role's
    strategy, and its Ulysses sequence-parallel and expert-parallel sizes when above 1."""
    from conveyor.workers.training.strategy import resolve_strategy

    t, arr = cfg.trainer, cfg.actor_rollout_ref
    world = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)  # every trained role has the same ranks
    trained = [("actor", "actor_rollout_ref.actor", arr.actor, arr.actor.ulysses_sequence_parallel_size)]
    if roles.get("ref") == COLOCATED:  # its own worker (not the actor's, under LoRA)
        trained.append(("reference", "actor_rollout_ref.ref", arr.ref, ref_sequence_parallel_size(arr)))
    if "critic" in roles:
        trained.append(("critic", "critic", cfg.critic, cfg.critic.ulysses_sequence_parallel_size))
    parts = []
    for name, prefix, role, sp in trained:
        part = f"{name}: strategy {resolve_strategy(role.strategy, world)}"
        if sp > 1:  # said with its key: a long-context run checks here that SP is on
            part += f", Ulysses sequence parallel {sp} ({prefix}.ulysses_sequence_parallel_size)"
        ep = role.fsdp_config.expert_parallel_size
        if ep > 1:
            part += f", expert parallel {ep} ({prefix}.fsdp_config.expert_parallel_size)"
        parts.append(part)
    return f"training ranks: {world}; " + "; ".join(parts)


def _rollout_decision(cfg: Config, device: str, caps: Any, why: list[str]) -> tuple[str, str, bool, bool, str]:
    """Where the rollout runs and what drives it: (placement, process, off_policy, replaying, how lines name it);
    ConfigErrors for what the engine cannot do."""
    from conveyor.rollout.base import ROLLOUT_ENGINES

    ro, v1 = cfg.actor_rollout_ref.rollout, cfg.trainer.v1
    able = list(ROLLOUT_ENGINES)
    if ro.multi_turn.enable and not caps.stop_sequences:
        raise ConfigError(
            f"actor_rollout_ref.rollout.multi_turn.enable: the {ro.name} rollout does not stop at token "
            "sequences, which ends a turn at a tool call; use an engine that does: "
            + ", ".join(n for n in able if ROLLOUT_ENGINES[n].capabilities(device).stop_sequences)
        )
    if ro.agent.enabled:
        if not caps.stop_sequences:
            raise ConfigError(
                f"actor_rollout_ref.rollout.agent: the {ro.name} rollout does not stop at token sequences, which a "
                "request's stop texts need; use an engine that does: "
                + ", ".join(n for n in able if ROLLOUT_ENGINES[n].capabilities(device).stop_sequences)
            )
        agent = f"command {ro.agent.command!r}" if ro.agent.command is not None else f"callable {ro.agent.callable}"
        why.append(
            f"rollout: agents through the OpenAI-compatible gateway on {ro.agent.host} ({agent}, at most "
            f"{ro.agent.max_concurrent} sessions at once per rank; tool calls parsed as {ro.multi_turn.format})"
        )
    if v1.is_async and v1.separate_async.partial_rollout and not caps.interruptible:
        raise ConfigError(
            f"trainer.v1.separate_async.partial_rollout: weights that reach the rollout mid-generation "
            f"need an engine that can be interrupted between tokens; the {ro.name} rollout cannot: set "
            "partial_rollout=false or use "
            + ", ".join(n for n in able if ROLLOUT_ENGINES[n].capabilities(device).interruptible)
        )
    if v1.is_async and v1.separate_async.partial_rollout:
        between = "two engine steps" if ro.name == "vllm" else "two sampled tokens"
        kv = {
            "recompute": "recompute their KV cache under the new weights (one prefill of prompt and tokens so far)",
            "keep": "keep the KV cache the old weights computed (no prefill)",
        }[ro.in_flight_kv]
        why.append(
            f"partial rollouts: weights that arrive mid-generation load between {between}, and the requests in "
            f"flight {kv} (actor_rollout_ref.rollout.in_flight_kv={ro.in_flight_kv})"
        )
    # The asynchronous source generates while the actor trains: on engines of their own, the rollout worker group.
    placement = "separate" if v1.is_async else ro.placement
    if placement == "separate":
        why.append(
            "rollout: the rollout worker group"
            + (f" (trainer.v1.trainer_mode={v1.trainer_mode} generates while the actor trains)" if v1.is_async else "")
        )

    replaying = bool(cfg.trainer.replay_rollouts_from)
    # A replay builds no engine: the configured one stands for the engine that recorded the samples (their log-probs
    # and routing), and the lines below say so.
    rollout_words = f"the {ro.name} rollout" + (" that recorded them" if replaying else "")
    if replaying:  # the update reads recorded samples: no engine, no rollout process
        placement, process = "none", "trainer"
        why.append(
            f"rollout: none, samples replayed from {cfg.trainer.replay_rollouts_from} (trainer.replay_rollouts_from)"
        )
    else:
        process, process_why = rollout_process(cfg, device, placement)
        if placement == "separate":
            why.append(process_why)
        why.append(faults_survived(cfg, placement, process, device))

    off_policy = v1.is_async and v1.sampler.max_off_policy_threshold > 0
    if off_policy:
        why.append(
            f"off-policy: trainer.v1.trainer_mode={v1.trainer_mode} with "
            f"max_off_policy_threshold={v1.sampler.max_off_policy_threshold}"
        )

    return placement, process, off_policy, replaying, rollout_words


def _replay_decision(cfg: Config, device: str, spec: Any, caps: Any, moe: bool, why: list[str]) -> tuple[str, str]:
    """The router controls' checks and the replay mode the run uses: (mode, why it differs from the asked one)."""
    from conveyor.rollout.base import ROLLOUT_ENGINES

    ro, actor, correction = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    able = list(ROLLOUT_ENGINES)
    # The rules of auto and of the bias: conveyor.trainer.router_plan.
    bias_why = check_router_controls(cfg, caps, device, moe)
    if bias_why:
        why.append(bias_why)
    requested = actor.router_replay.mode
    if requested == "auto":
        requested, auto_why = auto_replay(cfg, caps, moe, device)
        why.append(auto_why)
    replay, reason = requested, ""
    if requested == "R3" and not caps.returns_routing:
        replay = "R2"
        reason = (
            f"router_replay.mode=R3 replays the rollout's routing, which the {ro.name} rollout cannot return "
            f"on {device}: the run uses R2 (the routing of the old-log-prob forward, replayed in every update)"
        )
        if correction.bypass_mode is True:
            raise ConfigError(
                f"actor_rollout_ref.actor.router_replay.mode=R3: the {ro.name} rollout returns no routed experts on "
                f"{device}, so R3 would run as R2, which records the routing in the old-log-prob forward that "
                "algorithm.rollout_correction.bypass_mode=true skips: set algorithm.rollout_correction.bypass_mode "
                "to null or false, or use an engine that returns routing here (actor_rollout_ref.rollout.name="
                + ", ".join(n for n in able if ROLLOUT_ENGINES[n].capabilities(device).returns_routing)
                + ")"
                + (" or a GPU" if spec.capabilities("cuda").returns_routing else "")
            )
        why.append(reason)
    elif requested != "disabled":
        why.append(f"router replay {requested}" + ("" if moe else " (nothing to replay: the model is dense)"))

    return replay, reason


def _old_log_prob_decision(
    cfg: Config, caps: Any, replay: str, off_policy: bool, replaying: bool, rollout_words: str, why: list[str]
) -> tuple[str, bool]:
    """Where old log-probs come from ("rollout", "update" or "forward"), and whether that forward writes Σπ²."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    correction = algo.rollout_correction
    spp = forward_writes_sum_pi_squared(cfg)
    if correction.bypass_mode is not None:
        bypass = correction.bypass_mode
        bypass_why = f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}"
    elif off_policy:
        bypass, bypass_why = False, "the rollout's log-probs are an older policy's (off-policy)"
    elif replay == "R2" or correction.rollout_is or correction.rollout_rs or spp or cfg.actor_rollout_ref.rollout.exact:
        need = [
            n
            for n, on in (
                ("rollout.exact", cfg.actor_rollout_ref.rollout.exact),
                ("R2", replay == "R2"),
                ("rollout_is", bool(correction.rollout_is)),
                ("rollout_rs", bool(correction.rollout_rs)),
                ("sum_pi_squared", spp),
            )
            if on
        ]
        bypass, bypass_why = False, f"{', '.join(need)} need(s) the old-log-prob forward"
    else:
        bypass = caps.shares_trainer_modules
        bypass_why = (
            f"{rollout_words} {'sampled' if replaying else 'samples'} from the trainer's own modules"
            if bypass
            else f"the numerics of {rollout_words} are not the trainer's"
        )
    proximal = (
        off_policy
        and actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size == cfg.data.train_batch_size
        and not algo.use_kl_in_reward
        and correction.rollout_rs is None
        and replay != "R2"
        and not spp
    )
    if bypass:
        old = "rollout"
        where = "the replayed samples' recorded rollout_log_probs" if replaying else "the rollout's"
        why.append(f"old log-probs: {where}, no forward ({bypass_why})")
    elif proximal:
        old = "update"
        why.append(
            "old log-probs: the update's own forward (off-policy with one optimizer step per batch and no "
            "stage needing them before the update)"
        )
    else:
        old = "forward"
        why.append(f"old log-probs: the old-log-prob forward ({bypass_why})")

    if spp:
        why.append(
            "sum_pi_squared: written by the old-log-prob forward"
            + ("" if actor.calculate_sum_pi_squared else f" (algorithm.adv_estimator={algo.adv_estimator} reads it)")
        )

    return old, spp


def _routing_decision(
    cfg: Config, device: str, caps: Any, replay: str, moe: bool, replaying: bool, rollout_words: str, why: list[str]
) -> tuple[bool, bool, bool, str]:
    """Who records the routing: (the rollout captures it, the old-log-prob forward records it, the load-balance
    metrics read the forward's, the routing source's name)."""
    ro = cfg.actor_rollout_ref.rollout
    interval = ro.moe_load_balance_metrics_interval
    engine_routing = caps.returns_routing
    # A dense model has no routing to capture, whatever the replay mode asks.
    capture = moe and engine_routing and (replay == "R3" or (interval > 0 and replay != "R2"))
    record_for_metrics = not engine_routing and interval > 0 and replay != "R2"
    record = moe and (replay == "R2" or record_for_metrics)
    from_forward = interval > 0 and (replay == "R2" or not engine_routing)
    source = "rollout" if capture else "forward" if record else "none"
    if capture:
        why.append(
            f"routing: the replayed samples' recorded routed_experts, as {rollout_words} captured it"
            if replaying
            else f"routing: captured by the {ro.name} rollout"
        )
    if replay == "R2" or record_for_metrics:
        why.append("routing: recorded by the old-log-prob forward" + ("" if moe else " (none: the model is dense)"))
    if from_forward:
        recorder = f"the {ro.name} rollout" + (" that recorded the samples" if replaying else "")
        cause = "router_replay.mode=R2" if replay == "R2" else f"{recorder} returns no routing on {device}"
        why.append(f"MoE load-balance metrics describe the old-log-prob forward's routing ({cause})")

    return capture, record, from_forward, source


def _correction_decision(cfg: Config, off_policy: bool, why: list[str]) -> dict[str, Any]:
    """The importance weights' level and whether rejection sampling is on."""
    correction = cfg.algorithm.rollout_correction
    is_level = correction.rollout_is if correction.rollout_is is not None or not off_policy else "token"
    if is_level is not None:
        why.append(
            f"importance weights at {is_level} level"
            + ("" if correction.rollout_is is not None else " (off-policy default)")
        )
    if correction.rollout_rs is not None:
        why.append(f"rejection sampling: {correction.rollout_rs}")
    rollout = cfg.actor_rollout_ref.rollout
    truncation = rollout_truncation(rollout)
    if truncation is not None:
        kept = f"top_k={truncation.top_k} top_p={truncation.top_p} min_p={truncation.min_p}"
        why.append(
            f"sampling mask ({kept}): replayed in the policy's log-probs, so they are those of the distribution the "
            "rollout sampled from"
            if rollout.sampling_mask.replay
            else f"sampling mask ({kept}): not replayed (rollout.sampling_mask.replay=false): the policy's log-probs "
            "are the full softmax's, off-policy by the mass the rollout dropped (rollout_corr/* shows it)"
        )
    return dict(rollout_is_level=is_level, rollout_rs=correction.rollout_rs is not None)


def roles_decision(cfg: Config, rollout_placement: str, why: list[str]) -> dict[str, str]:
    """Every role that runs -> where, in the role table's order: each role's own decision (`Role.decide`), its
    reasons appended to `why`."""
    decision = RoleDecision(rollout_placement=rollout_placement, why=why)
    placed = {}
    for name, role in ROLES.items():
        placement = role.decide(cfg, decision)
        if placement is not None:
            placed[name] = role.check_placement(placement)
    return placed


def _lora_decision(cfg: Config, caps: Any, replaying: bool, why: list[str]) -> None:
    """LoRA's line: its rank and targets, and whether the engine gets merged weights."""
    arr = cfg.actor_rollout_ref
    if arr.model.lora_rank > 0:
        why.append(
            f"LoRA: rank {arr.model.lora_rank}, alpha {arr.model.lora_alpha:g}, target_modules="
            f"{arr.model.target_modules}; only the adapters train"
            + (
                f"; the {arr.rollout.name} engine gets the merged weights after every update"
                if not caps.shares_trainer_modules and not replaying
                else ""
            )
        )


def _scales_decision(cfg: Config, caps: Any, replaying: bool, why: list[str]) -> dict[str, Any]:
    """The loss scales, the engine's sequence length, and the plan's warnings."""
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    # A constant, not the micro-batch's padded width as in verl: the loss of a sequence must not
    # depend on which sequences it was padded next to.
    actor_scale = float(actor.loss_scale_factor or cfg.data.max_response_length)
    critic_scale = float(cfg.critic.loss_scale_factor or actor.loss_scale_factor or cfg.data.max_response_length)
    max_model_len = None
    if not caps.shares_trainer_modules:  # an engine with its own KV cache holds sequences up to a length
        max_model_len = ro.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length
        if not replaying:  # no engine is built to hold them
            why.append(f"{ro.name} max_model_len={max_model_len}")

    warnings = tuple(w for w in (lone_sample_warning(cfg),) if w)
    why.extend(warnings)

    return dict(
        actor_loss_scale=actor_scale,
        critic_loss_scale=critic_scale,
        engine_max_model_len=max_model_len,
        warnings=warnings,
    )


def build_run_plan(cfg: Config, device: str, *, is_moe: bool | None = None) -> RunPlan:
    """The plan of a run of `cfg` on `device` ("cpu" or "cuda"); a ConfigError for a contradictory combination.

    `is_moe` overrides what `model_is_moe` would read (for callers that know, e.g. tests without a checkpoint).
    Each decision is a function of its own, in the order its lines are logged.
    """
    from conveyor.rollout.base import engine_spec

    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    spec = engine_spec(ro.name)
    spec.validate_config(cfg)  # the engine's own keys (context length, what its kernels serve), by its module
    caps = spec.capabilities(device)
    moe = model_is_moe(cfg) if is_moe is None else bool(is_moe)
    why: list[str] = []
    placement, process, off_policy, replaying, rollout_words = _rollout_decision(cfg, device, caps, why)
    replay, reason = _replay_decision(cfg, device, spec, caps, moe, why)
    old, spp = _old_log_prob_decision(cfg, caps, replay, off_policy, replaying, rollout_words, why)
    if cfg.actor_rollout_ref.model.lm_head_fp32:
        why.append(
            f"LM head in float32 (model.lm_head_fp32), the body in its dtype: the trainer's forwards and the "
            f"{ro.name} rollout's"
        )
    if ro.exact:
        why.append("rollout log-probs: the old-log-prob forward's, bitwise (rollout.exact)")
    capture, record, from_forward, source = _routing_decision(
        cfg, device, caps, replay, moe, replaying, rollout_words, why
    )
    correction = _correction_decision(cfg, off_policy, why)
    roles = roles_decision(cfg, placement, why)
    why.append(parallelism_decision(cfg, roles))
    _lora_decision(cfg, caps, replaying, why)
    scales = _scales_decision(cfg, caps, replaying, why)
    return RunPlan(
        roles=roles,
        device=device,
        engine=ro.name,
        engine_returns_routing=caps.returns_routing,
        is_moe=moe,
        old_log_probs=old,
        replay_mode=replay,
        replay_requested=actor.router_replay.mode,
        replay_reason=reason,
        routing_source=source,
        rollout_captures_routing=capture,
        forward_records_routing=record,
        forward_replays_routing=moe and replay == "R3",
        update_replays_routing=moe and replay in ("R2", "R3"),
        load_balance_from_forward=from_forward,
        off_policy=off_policy,
        rollout_placement=placement,
        rollout_process=process,
        decisions=tuple(why),
        forward_sum_pi_squared=spp,
        **correction,
        **scales,
    )
