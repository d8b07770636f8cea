"""LoRA runs: only the adapters train, the reference is the actor's base, checkpoints and export hold the adapters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_stages import build_trainer  # tests/trainer is on sys.path (rootdir import mode)

from conveyor.config import load_config
from conveyor.models.lora import is_adapter_key
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.reference import ReferenceWorker
from conveyor.workers.ranks.settings import reference_settings

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
    "actor_rollout_ref.actor.optim.lr=0.01",
    # Every reward of an untrained model is 0 (no advantage): the entropy bonus gives the update a gradient.
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "algorithm.rollout_correction.bypass_mode=false",
]


def _trainer(overrides):
    return build_trainer(overrides, with_model_config=True)


def test_config_keys_are_checked():
    from conveyor.config import ConfigError

    with pytest.raises(ConfigError, match="actor_rollout_ref.model.target_modules"):
        load_config(None, ["actor_rollout_ref.model.target_modules=[]"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_rank"):
        load_config(None, ["actor_rollout_ref.model.lora_rank=-1"])
    cfg = load_config(None, ["actor_rollout_ref.model.target_modules=[q_proj,experts]"])
    assert cfg.actor_rollout_ref.model.target_modules == ["q_proj", "experts"]


def test_lora_trains_adapters_and_the_reference_is_the_base(tiny_run):
    trainer, dp, cfg, plan, path = _trainer(tiny_run + LORA)
    assert plan.use_reference and plan.reference_from_actor
    assert any("adapters disabled" in d for d in plan.decisions)
    # No reference model: the process hosts the actor alone, and the ref role calls the actor's ranks.
    actor_group = trainer.workers.actor.ranks
    assert actor_group.host.roles == ["actor"]
    assert trainer.workers.ref.ranks is actor_group
    worker = actor_group.worker
    assert worker.lean is None  # the lean forward would skip the adapters
    trainable = [n for n, p in worker.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert not any("experts" in n or ".gate." in n for n in trainable)  # all-linear: attention only, no router
    in_optimizer = {id(p) for g in worker.trained.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in worker.model.parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in worker.model.named_parameters() if not p.requires_grad}

    trainer.global_step = 1
    trainer.step()
    trainer.global_step = 2
    m2 = trainer.step()
    assert "ref/perf/ref/max_memory_gb" in m2 and m2["actor/kl_loss"] > 0
    for n, p in worker.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), f"{n} changed: only the adapters may train"
    assert any(p.abs().sum() > 0 for n, p in worker.model.named_parameters() if "lora_B" in n)

    # The reference log-probs equal, exactly, those of the base model loaded separately (its own worker).
    stored = dp.cleared["train-2"]
    keys = [f"k{i}" for i in range(len(stored["responses"]))]
    fields = {k: stored[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}
    meta = dp.kv_batch_put(keys=keys, partition_id="check", fields=fields)
    model_cfg = dataclasses.replace(cfg.actor_rollout_ref.model, lora_rank=0, forward_impl="hf")
    settings = dataclasses.replace(reference_settings(cfg, plan), model=model_cfg)
    ref = ReferenceWorker(settings, model_path=path, data_plane=dp)
    call = LogProbCall(temperature=cfg.actor_rollout_ref.rollout.temperature, calculate_entropy=False)
    meta = meta.with_extra_info(**call.to_extra_info())
    ref.compute_log_prob(meta)
    separate = dp.kv_batch_get(keys=keys, partition_id="check", select_fields=["ref_log_prob"])["ref_log_prob"]
    assert torch.equal(separate, stored["ref_log_prob"])
    # ... and differ from the trained actor's (the adapters moved it).
    assert not torch.equal(stored["old_log_probs"], stored["ref_log_prob"])


def test_lora_checkpoint_holds_adapters_and_resumes(tiny_run, tmp_path):
    trainer, dp, cfg, plan, path = _trainer(tiny_run + LORA)
    trainer.global_step = 1
    trainer.step()
    ckpt = trainer.save_checkpoint()
    from conveyor.workers.training.shards import SafeFileSystemReader

    keys = SafeFileSystemReader(str(ckpt / "actor")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter_key(k) for k in model_keys), model_keys[:4]
    assert (ckpt / "actor" / "adapter_config.json").is_file()
    worker = trainer.workers.actor.ranks.worker
    want = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    want_opt = {
        n: worker.trained.optimizer.state[p]["exp_avg"].clone()
        for n, p in worker.model.named_parameters()
        if p.requires_grad
    }

    resumed, *_ = _trainer(tiny_run + LORA + ["trainer.resume_mode=auto"])
    resumed.global_step = resumed.checkpoints.resume()
    w2 = resumed.workers.actor.ranks.worker
    for n, p in w2.model.named_parameters():
        assert torch.equal(p, want[n]), n
        if p.requires_grad:
            assert torch.equal(w2.trained.optimizer.state[p]["exp_avg"], want_opt[n]), n
    assert w2.optim_steps == worker.optim_steps > 0


@pytest.mark.parametrize("adapter_only", [False, True])
def test_lora_export_loads_back(tiny_run, tmp_path, adapter_only):
    from transformers import AutoModelForCausalLM

    from conveyor.trainer.export import export_hf

    trainer, dp, cfg, plan, path = _trainer(tiny_run + LORA)
    trainer.global_step = 1
    trainer.step()
    trainer.save_checkpoint()
    worker = trainer.workers.actor.ranks.worker
    out = export_hf(cfg.run_dir, tmp_path / "out", adapter_only=adapter_only)
    ids = torch.randint(3, 40, (2, 9))
    with torch.no_grad():
        want = worker.model(input_ids=ids).logits
        if adapter_only:
            from peft import PeftModel

            assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), str(out))
        else:
            assert not (out / "adapter_config.json").exists()
            loaded = AutoModelForCausalLM.from_pretrained(str(out))
            assert not any("lora" in k for k in loaded.state_dict())
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_asynchronous_lora_at_k0_is_the_synchronous_run(tmp_path, tiny_run):
    """At k=0 the asynchronous run is the synchronous one with the same placement, exactly: the rollout worker's
    engine serves the base architecture, so both take the merged weights after every update (a colocated engine
    samples through the adapters instead, which rounds differently)."""
    import json

    from safetensors.torch import load_file

    from conveyor.trainer.export import export_hf
    from conveyor.trainer.run import run_training

    base = (
        [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
        + LORA
        + ["trainer.total_training_steps=3", "actor_rollout_ref.model.tiny.warmstart_steps=20"]
    )
    rows, weights = {}, {}
    for name, extra in (
        ("sync", ["actor_rollout_ref.rollout.placement=separate"]),
        ("async", ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=0"]),
    ):
        run_dir = tmp_path / name
        run_training(load_config(None, base + extra + [f"trainer.default_local_dir={run_dir}"]))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        # clocks and memory
        measured = ("timing_s/", "timing_cpu_s/", "perf/", "gen_time_s", "weight_sync_s", "off_policy/")
        rows[name] = [{k: v for k, v in json.loads(x).items() if not any(m in k for m in measured)} for x in lines]
        out = export_hf(run_dir, tmp_path / f"hf-{name}")
        weights[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert [r["step"] for r in rows["sync"]] == [0, 1, 2, 3]
    assert rows["sync"] == rows["async"]
    assert weights["sync"].keys() == weights["async"].keys()
    assert all(torch.equal(weights["sync"][k], weights["async"][k]) for k in weights["sync"])
