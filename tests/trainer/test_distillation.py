"""On-policy distillation through the trainer: the teacher role, its keys, the start-up checks, the metrics.

Teachers are real tiny models: the default tiny MoE built from another seed
(a different network over the same tokenizer), saved as a Hugging Face
checkpoint the way `conveyor export` writes one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from conveyor.cli import main
from conveyor.config import ConfigError, load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.distill import teacher_settings
from conveyor.workers.ranks.forward import sequence_inputs
from conveyor.workers.ranks.teacher import TeacherWorker

LOSS = "distillation.distillation_loss"
CALL = LogProbCall(temperature=1.0, calculate_entropy=False, compute_loss=False).to_extra_info()


@pytest.fixture(scope="module")
def teachers(tiny_run_base):
    """Two tiny MoE teachers (seeds 1 and 2) over the student's tokenizer: their checkpoint directories."""
    return [
        prepare_default_model(load_config(None, tiny_run_base + [f"actor_rollout_ref.model.tiny.seed={seed}"]))
        for seed in (1, 2)
    ]


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pure_distillation_lowers_the_students_kl_to_the_teacher(tiny_run, tmp_path, teachers):
    steps = 10
    run_training(
        load_config(
            None,
            tiny_run
            + [
                f"trainer.total_training_steps={steps}",
                "actor_rollout_ref.actor.optim.lr=3e-3",
                "actor_rollout_ref.actor.optim.lr_scheduler=constant",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",  # the student's routing is recorded
                "distillation.enabled=true",
                f"distillation.teacher_models.t.model_path={teachers[0]}",
                f"{LOSS}.loss_mode=full_reverse_kl",
                f"{LOSS}.use_task_rewards=false",
            ],
        )
    )
    rows = [r for r in _rows(tmp_path) if "distill/kl_exact" in r]
    assert len(rows) == steps
    kl = [r["distill/kl_exact"] for r in rows]
    assert all(k >= 0 for k in kl)
    # The exact reverse KL on the student's own samples: the last steps' well below the first steps'.
    assert sum(kl[-3:]) / 3 < 0.6 * sum(kl[:3]) / 3, kl
    for key in ("distill/loss", "distill/kl_k1", "distill/kl_k3", "timing_s/teacher", "distill/moe/routing_agreement"):
        assert all(key in r for r in rows), key
    assert all(0.0 <= r["distill/moe/routing_agreement"] <= 1.0 for r in rows)
    # Pure distillation: the loss is the distillation term alone.
    assert rows[0]["distill/loss"] == pytest.approx(rows[0]["distill/kl_exact"], rel=1e-4)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["use_teacher"] and any(d.startswith("distillation: teacher t") for d in plan["decisions"])

    from conveyor.metrics.plots import plot_run

    assert "distillation.png" in [p.name for p in plot_run(tmp_path)]


@pytest.mark.parametrize(
    "mode, extra", [("forward_kl_topk", [f"{LOSS}.topk=4"]), ("k1", [f"{LOSS}.use_policy_gradient=true"])]
)
def test_distillation_composes_with_task_rewards(tiny_run, tmp_path, teachers, mode, extra):
    run_training(
        load_config(
            None,
            tiny_run
            + [
                "algorithm.adv_estimator=rloo",
                "distillation.enabled=true",
                f"distillation.teacher_models.t.model_path={teachers[0]}",
                f"{LOSS}.loss_mode={mode}",
                f"{LOSS}.distillation_loss_coef=0.5",
                *extra,
            ],
        )
    )
    rows = [r for r in _rows(tmp_path) if "distill/loss" in r]
    assert len(rows) == 2 and all("actor/pg_loss" in r for r in rows)
    if mode == "forward_kl_topk":
        assert all(0 < r["distill/student_mass"] <= 1 and 0 < r["distill/teacher_mass"] <= 1 for r in rows)


def _batch(tokenizer, n: int) -> dict[str, torch.Tensor]:
    """n left-padded prompts and right-padded responses of the student's tokens, with data_source a or b."""
    g = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    prompts = torch.randint(4, vocab, (n, 5), generator=g)
    prompt_mask = torch.ones(n, 5, dtype=torch.long)
    prompt_mask[0, :2] = 0  # a left-padded prompt
    responses = torch.randint(4, vocab, (n, 4), generator=g)
    response_mask = torch.ones(n, 4, dtype=torch.long)
    response_mask[1:2, 2:] = 0  # a response shorter than the batch's
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "data_source": ["a", "b", "b", "a", "b"][:n],
    }


def test_each_sample_is_scored_by_exactly_its_teacher(tiny_run_base, teachers):
    cfg = load_config(None, tiny_run_base + _keyed(teachers))
    plan = build_run_plan(cfg, "cpu")
    plane = make_data_plane("memory")
    worker = TeacherWorker(teacher_settings(cfg, plan), data_plane=plane)
    tokenizer = build_char_tokenizer()
    fields = _batch(tokenizer, 5)
    meta = plane.kv_batch_put(keys=[f"k{i}" for i in range(5)], partition_id="p", fields=fields)
    out = worker.compute_teacher_log_prob(meta.with_extra_info(**CALL))
    assert set(out.fields) >= {"teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids"}
    got = plane.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=out.fields)
    for path, source in zip(teachers, "ab"):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        td = TensorDict({k: v for k, v in fields.items() if k != "data_source"}, batch_size=[5])
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        lp = torch.log_softmax(logits[:, 4:-1].float(), -1)  # the positions predicting the 4 response tokens
        want = lp.gather(-1, td["responses"][..., None])[..., 0]
        rows = [i for i, s in enumerate(fields["data_source"]) if s == source]
        mask = td["response_mask"][rows].bool()
        torch.testing.assert_close(got["teacher_log_probs"][rows][mask], want[rows][mask], rtol=1e-4, atol=1e-5)
        top = torch.topk(lp, 3, -1)
        torch.testing.assert_close(
            got["teacher_topk_log_probs"][rows][mask], top.values[rows][mask], rtol=1e-4, atol=1e-5
        )
        assert torch.equal(got["teacher_topk_ids"][rows][mask].long(), top.indices[rows][mask])
        # The other teacher's numbers would differ: the two teachers are different networks.
        other = [i for i in range(5) if i not in rows]
        omask = td["response_mask"][other].bool()
        assert not torch.allclose(got["teacher_log_probs"][other][omask], want[other][omask], atol=1e-3)
    routing = plane.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=["teacher_routed_experts"])
    assert routing["teacher_routed_experts"].shape[:2] == (5, 9) and bool(
        (routing["teacher_routed_experts"] >= -1).all()
    )

    plane.kv_batch_put(keys=["x"], partition_id="q", fields={**_batch(tokenizer, 1), "data_source": ["c"]})
    with pytest.raises(ValueError, match="distillation.teacher_key=data_source.*'c'"):
        worker.compute_teacher_log_prob(meta.__class__(keys=["x"], partition_id="q").with_extra_info(**CALL))


def _keyed(teachers, extra=()) -> list[str]:
    """Two teachers keyed by data_source a and b, scoring for forward_kl_topk (top 3)."""
    return [
        "distillation.enabled=true",
        f"distillation.teacher_models.ta.model_path={teachers[0]}",
        "distillation.teacher_models.ta.key=a",
        "distillation.teacher_models.ta.log_prob_micro_batch_size_per_gpu=1",
        f"distillation.teacher_models.tb.model_path={teachers[1]}",
        "distillation.teacher_models.tb.key=b",
        f"{LOSS}.loss_mode=forward_kl_topk",
        f"{LOSS}.topk=3",
        *extra,
    ]


@pytest.mark.slow
def test_teachers_sharded_over_two_ranks_score_as_one_rank_does(tiny_run_base, teachers, tmp_path):
    """fsdp2 over two gloo ranks, rank 1 holding no sample of teacher ta (its passes only pair up the gathers)."""
    fields = _batch(build_char_tokenizer(), 5)  # data_source a, b, b, a, b
    torch.save(fields, tmp_path / "batch.pt")
    sharded = [
        f"distillation.teacher_models.{t}.{k}"
        for t in ("ta", "tb")
        for k in ("strategy=fsdp2", "fsdp_config.param_offload=true")
    ]
    spec = {
        "world": 2,
        "overrides": tiny_run_base + _keyed(teachers, sharded),
        "batch": str(tmp_path / "batch.pt"),
        "shares": [[0, 3, 1], [2, 4]],
        "out": str(tmp_path),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = Path(__file__).parents[1] / "workers" / "teacher_ranks.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "spec.json")], env=env, capture_output=True, text=True, timeout=600
    )
    errors = [line for line in done.stderr.splitlines() if "it/s]" not in line]  # without the progress bars
    assert done.returncode == 0, "\n".join(errors[-40:])
    cfg = load_config(None, tiny_run_base + _keyed(teachers))
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put(keys=[f"k{i}" for i in range(5)], partition_id="p", fields=fields)
    one = TeacherWorker(teacher_settings(cfg, build_run_plan(cfg, "cpu")), data_plane=plane)
    out = one.compute_teacher_log_prob(meta.with_extra_info(**CALL))
    want = plane.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=out.fields)
    mask = fields["response_mask"].bool()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"teacher_{rank}.pt", weights_only=False)
        rows = [int(k[1:]) for k in got["keys"]]
        for name in ("teacher_log_probs", "teacher_topk_log_probs"):
            torch.testing.assert_close(got[name][mask[rows]], want[name][rows][mask[rows]], rtol=1e-5, atol=1e-5)
        assert torch.equal(got["teacher_topk_ids"][mask[rows]], want["teacher_topk_ids"][rows][mask[rows]])


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tiny_run, tmp_path, capsys):
    other = build_char_tokenizer(DEFAULT_ALPHABET[::-1])  # the same characters under other ids
    path = tmp_path / "teacher"
    build_tiny_model("qwen3_moe", other, seed=3, hidden_size=32, num_layers=1).save_pretrained(path)
    other.save_pretrained(path)
    key = "distillation.teacher_models.big.model_path"
    capsys.readouterr()
    status = main(["train", *tiny_run, "distillation.enabled=true", f"{key}={path}"])
    out = capsys.readouterr()
    assert status == 2 and "Traceback" not in out.err + out.out
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.err
    err = errors[0]
    assert key in err and "tokenizer differs" in err and "vocabularies differ" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["distillation.enabled=true"], "distillation.teacher_models: distillation.enabled needs a teacher"),
        (
            [
                "distillation.enabled=true",
                "distillation.teacher_models.a.model_path=/x",
                "distillation.teacher_models.b.model_path=/y",
            ],
            "distillation.teacher_models.a.key",
        ),
        (
            [
                "distillation.enabled=true",
                "distillation.teacher_models.a.model_path=/x",
                "distillation.teacher_models.a.key=s",
                "distillation.teacher_models.b.model_path=/y",
                "distillation.teacher_models.b.key=s",
            ],
            "keys must differ",
        ),
        (["distillation.teacher_models.a.log_prob_micro_batch_size_per_gpu=0"], "teacher_models.a.log_prob_micro"),
        ([f"{LOSS}.loss_mode=k33"], "did you mean 'k3'"),
    ],
)
def test_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)


def test_the_asynchronous_trainer_distils_from_stale_samples(tiny_run, tmp_path, teachers):
    # k = 1: the rollout runs a version ahead, so the teacher scores samples of an older student than it trains.
    steps = 4
    run_training(
        load_config(
            None,
            tiny_run
            + [
                "trainer.v1.trainer_mode=separate_async",
                "trainer.v1.sampler.max_off_policy_threshold=1",
                f"trainer.total_training_steps={steps}",
                "distillation.enabled=true",
                f"distillation.teacher_models.t.model_path={teachers[0]}",
                f"{LOSS}.loss_mode=k3",
                f"{LOSS}.use_task_rewards=true",
            ],
        )
    )
    rows = [r for r in _rows(tmp_path) if "distill/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for key in ("distill/kl_k1", "distill/kl_k3", "distill/token_loss", "timing_s/teacher"):
            assert key in r, key
        assert r["distill/kl_k3"] > 0.0  # two different networks: the student is never the teacher
        assert r["off_policy/staleness_max"] <= 1
    assert max(r["off_policy/staleness_max"] for r in rows) == 1  # it did train on a stale batch
    versions = [json.loads(line) for line in (tmp_path / "async_versions.jsonl").read_text().splitlines()]
    assert len(versions) == steps


def _separate_run(overrides: list[str], teacher: Path, steps: int) -> list[str]:
    return overrides + [
        f"trainer.total_training_steps={steps}",
        "distillation.enabled=true",
        f"distillation.teacher_models.t.model_path={teacher}",
        f"{LOSS}.loss_mode=k1",
        f"{LOSS}.use_task_rewards=false",
        "distillation.placement=separate",
    ]


def test_a_teacher_placed_apart_in_one_process_is_a_rank_of_its_own(tiny_run, tmp_path, teachers):
    run_training(load_config(None, _separate_run(tiny_run, teachers[0], 2)))
    rows = [r for r in _rows(tmp_path) if "distill/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["distill/kl_k1"] == pytest.approx(r["distill/loss"], rel=1e-4) for r in rows)  # k1 alone
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["teacher_placement"] == "separate"
    assert any("ranks of their own" in line for line in plan["decisions"])


@pytest.mark.slow  # Ray and four worker processes: several minutes on the shared 2-core machine
def test_a_run_on_ray_scores_with_teachers_on_ranks_of_their_own(tiny_run, tmp_path, teachers):
    pytest.importorskip("ray")
    extra = [
        "trainer.num_cpu_workers=2",
        "ray.worker_cpus=0.25",  # a local Ray of 2 CPUs holds the actor's ranks, the reward worker and the teachers'
        "distillation.num_workers=2",
        "distillation.teacher_models.t.strategy=fsdp2",  # one process group over the teachers' own two ranks
    ]
    run_training(load_config(None, _separate_run(tiny_run, teachers[0], 2) + extra))
    rows = [r for r in _rows(tmp_path) if "distill/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["distill/kl_k1"] == pytest.approx(r["distill/loss"], rel=1e-4) for r in rows)
    assert all("timing_s/teacher" in r for r in rows)
    assert json.loads((tmp_path / "plan.json").read_text())["teacher_placement"] == "separate"
