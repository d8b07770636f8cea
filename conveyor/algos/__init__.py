"""Pure RL math: advantage estimators, losses, the actor objective, KL terms, rollout correction, log-probs.

Every function here takes tensors and plain scalars and returns tensors (or
floats for metrics). Nothing here reads a config object, touches the data
plane, or calls ``torch.distributed``/Ray: callers pass normalisers such as the
global token count so that data-parallel shards add up to the whole-batch
result.
"""

from conveyor.algos.advantages import (
    ADV_ESTIMATORS,
    NEEDS_CRITIC,
    compute_advantage,
    get_adv_estimator,
    masked_mean,
    masked_var,
    masked_whiten,
    register_adv_estimator,
)
from conveyor.algos.correction import bypass_old_log_prob, compute_rollout_is_weights
from conveyor.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from conveyor.algos.logprob import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from conveyor.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss,
    loss_params,
    register_policy_loss,
)
from conveyor.algos.objective import compute_policy_objective, merge_objective_metrics

__all__ = [
    "ADV_ESTIMATORS",
    "NEEDS_CRITIC",
    "compute_advantage",
    "get_adv_estimator",
    "register_adv_estimator",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "agg_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "compute_entropy_loss",
    "get_policy_loss",
    "loss_params",
    "register_policy_loss",
    "compute_policy_objective",
    "merge_objective_metrics",
    "KL_KINDS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
    "bypass_old_log_prob",
    "compute_rollout_is_weights",
    "logprobs_from_logits",
    "entropy_from_logits",
    "logprobs_and_entropy",
]
