"""A vision-language policy trains with a critic: GAE on the visual task, the value model a head on the vision
tower and text model, reading the prompts' pixels and M-RoPE positions packed and padded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_vlm import _run as visual_run

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.loading import load_causal_lm, load_model_config, load_tokenizer
from conveyor.models.tiny_vlm import load_image_processor, save_tiny_vlm
from conveyor.models.value_head import ValueModel
from conveyor.models.vision import VISION_FIELDS, VisionProcessor
from conveyor.tasks.prompts import PromptEncoder
from conveyor.tasks.visual import make_visual_sum_records
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.workers.ranks.critic import CriticWorker
from conveyor.workers.ranks.settings import critic_settings
from conveyor.workers.training.shards import load_model_tensors

pytestmark = pytest.mark.process  # training runs, and two ranks in processes of their own

# The strategy tests' rank runner: each rank builds its own worker and takes its share of the batch.
RANKS_SCRIPT = Path(__file__).parents[1] / "workers" / "strategy_ranks.py"
B, R = 7, 4


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2.5-VL checkpoint with its processor."""
    return str(save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "qwen2_5_vl"))


# The random policy never writes a sum (reward 0, returns 0, nothing for the critic to learn): a reward that
# every response earns some of gives the value loss a target.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The response's length over 4, plus 1 for a digit in it."""
    return len(solution_str) / 4 + float(any(c.isdigit() for c in solution_str))
'''


def _gae_run(vlm_path: str, run_dir, packed: bool) -> list[str]:
    """The overrides of a two-step GAE run on the visual task, saving at step 2."""
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    # The GRPO runs' overrides (tests/trainer is on sys.path), then the critic's: later keys win.
    return [
        *visual_run(vlm_path, run_dir),
        f"reward.custom_reward_function.path={reward}",
        f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
        "algorithm.adv_estimator=gae",
        "critic.ppo_mini_batch_size=4",
        # Adam moves each weight by about lr on its first step: large enough to see in every tensor.
        "critic.optim.lr=0.001",
        "trainer.test_freq=0",
        "trainer.save_freq=2",
    ]


@pytest.mark.parametrize("packed", [True, False])
def test_gae_on_the_visual_task_trains_the_critic_over_the_vision_tower(vlm_path, tmp_path, packed: bool) -> None:
    """Two GAE steps, packed or padded: the value loss is finite, the critic's values move off their zero start,
    and every part of its model, the vision tower's blocks and merger included, has trained."""
    run_training(load_config(None, _gae_run(vlm_path, tmp_path / "run", packed)))
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert {1, 2} <= set(rows)
    for step in (1, 2):
        assert math.isfinite(rows[step]["critic/vf_loss"]) and rows[step]["critic/grad_norm"] > 0
    # The head starts at zero: step 1's values are 0, step 2's are the updated critic's.
    assert rows[1]["critic/vpred_mean"] == 0.0 and rows[2]["critic/vpred_mean"] != 0.0
    trained = load_model_tensors(tmp_path / "run" / "checkpoints" / "global_step_2" / "critic", "")
    initial = ValueModel.from_causal_lm(load_causal_lm(vlm_path, lm_head=False), copy=False).state_dict()
    assert trained.keys() == initial.keys()
    still = [k for k in initial if torch.equal(trained[k], initial[k])]
    assert not still, f"critic weights that did not train: {still}"
    assert any(".visual.merger." in f".{k}" for k in initial) and any(".visual.blocks." in f".{k}" for k in initial)


def _worker_overrides(path: str) -> list[str]:
    """A critic worker's config over the VLM checkpoint `path` (micro-batches of 3: two passes for 7 rows)."""
    return [
        f"actor_rollout_ref.model.path={path}",
        "algorithm.adv_estimator=gae",
        "critic.ppo_micro_batch_size_per_gpu=3",
        # Adam's first step moves each weight by about lr: at 1e-4 summation-order noise stays far below 1e-5.
        "critic.optim.lr=0.0001",
        "critic.optim.lr_scheduler=constant",
    ]


def _critic(overrides: list[str], plane) -> CriticWorker:
    """A one-rank critic worker of the run `overrides` describes, on `plane`."""
    cfg = load_config(None, overrides)
    path = cfg.actor_rollout_ref.model.path
    return CriticWorker(critic_settings(cfg, build_run_plan(cfg, "cpu")), model_path=path, data_plane=plane)


def _batch(path: str) -> dict:
    """Seven samples of the visual task (one text-only), ragged responses (one sampling an image pad), values and
    returns."""
    tok = load_tokenizer(path, padding_side="left")
    config = load_model_config(path)
    vision = VisionProcessor(load_image_processor(path), tok, config)
    records = make_visual_sum_records(B - 1, seed=0, max_operand=9)
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+22="}]})
    fields, _ = PromptEncoder(tok, 32, "error", vision=vision).fields(records, [f"p{i}" for i in range(B)], range(B))
    fields = {k: v for k, v in fields.items() if k in ("prompts", "prompt_mask", *VISION_FIELDS)}
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 2:] = mask[4, 1:] = mask[6, 3:] = False
    responses = torch.randint(4, 40, (B, R), generator=gen) * mask
    responses[2, 1] = config.image_token_id  # fed as the engine feeds it (`unplaceholder`)
    fields.update(
        responses=responses,
        response_mask=mask,
        values=torch.randn(B, R, generator=gen) * mask,
        returns=torch.randn(B, R, generator=gen) * mask,
    )
    return fields


def _values(path: str, fields: dict, packed: bool) -> torch.Tensor:
    """compute_values of a critic whose head is random (a fresh one's values are all 0)."""
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields)
    worker = _critic(
        _worker_overrides(path) + [f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}"], plane
    )
    assert worker.packed == packed
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        worker.model.value_head.weight.copy_(torch.randn(worker.model.value_head.weight.shape, generator=gen))
    worker.compute_values(meta)
    return plane.kv_batch_get(meta.keys, "p", ["values"])["values"]


def test_packed_values_equal_padded_values(vlm_path) -> None:
    """The critic's values forward, packed (each sample's M-RoPE positions in the row) and padded, gives the same
    values of every response token, the text-only row's included."""
    fields = _batch(vlm_path)
    packed, padded = _values(vlm_path, fields, True), _values(vlm_path, fields, False)
    assert (packed - padded).abs().max() < 1e-5
    mask = fields["response_mask"]
    assert bool((padded[mask] != 0).all()) and bool((padded[~mask] == 0).all())


# DDP takes one sample a micro-batch: the text-only sample's leaves the vision tower unused on its rank.
CRITIC_STRATEGIES = {"fsdp2": ["critic.strategy=fsdp2"], "dp": ["critic.strategy=dp"]}
CRITIC_MICRO = {"fsdp2": [], "dp": ["critic.ppo_micro_batch_size_per_gpu=1"]}


@pytest.mark.parametrize("strategy", ["fsdp2", "dp"])
def test_two_ranks_take_the_one_rank_critic_step(vlm_path, tmp_path, strategy: str) -> None:
    """Pixels and positions split over two gloo ranks with their samples: two sharded (FSDP2) or replicated (DDP),
    packed critic updates move every weight, the vision tower's included, as two one-rank padded updates do."""
    overrides = _worker_overrides(vlm_path) + CRITIC_MICRO[strategy]
    fields = _batch(vlm_path)
    torch.save(fields, tmp_path / "batch.pt")
    (tmp_path / "out").mkdir()
    run = {
        "role": "critic",
        "overrides": overrides + CRITIC_STRATEGIES[strategy],
        # Two steps: the head starts at zero, so the first one moves only the head (no gradient reaches the body).
        "jobs": ["update", "update"],
        "out": str(tmp_path / "out"),
        "batch": str(tmp_path / "batch.pt"),
    }
    (tmp_path / "spec.json").write_text(json.dumps({"world": 2, "model_path": vlm_path, "runs": [run]}))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields)
    worker = _critic(overrides + ["actor_rollout_ref.model.use_remove_padding=false"], plane)
    initial = {k: v.clone() for k, v in worker.model_state_dict().items()}
    worker.update_critic(meta)
    one = worker.update_critic(meta).extra_info
    want = worker.model_state_dict()
    got = torch.load(tmp_path / "out" / "params.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    ranks = [json.loads((tmp_path / "out" / f"metrics_{r}.json").read_text()) for r in range(2)]
    loss = sum(m["critic/vf_loss@sum"] for m in ranks)
    assert loss == pytest.approx(one["critic/vf_loss@sum"], rel=1e-5)
    assert ranks[0]["critic/grad_norm"] == pytest.approx(one["critic/grad_norm"], rel=1e-5)
    # The body's first gradient comes at step 2, where Adam (its moments' bias corrected) moves a weight by about
    # 0.74 lr = 7.4e-5, whatever the gradient's size.
    for part in (".visual.blocks.", ".visual.merger.", ".language_model.", "value_head."):
        moved = max(float((want[k] - initial[k]).abs().max()) for k in want if part in f".{k}")
        assert moved > 5e-5, f"the critic's {part.strip('.')} did not train"
