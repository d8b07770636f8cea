"""The engine interface's own pieces: one sampling-parameters type, one output type, one routing rule."""

from __future__ import annotations

import pytest
import torch

from conveyor.rollout.base import ROLLOUT_ENGINES, GenerationOutput, SamplingParams, engine_spec, mask_unfed_routing


def test_sampling_params_are_checked_once_and_hold_tuples() -> None:
    p = SamplingParams(max_new_tokens=4, stop_sequences=[[5, 6], [7]])
    assert p.stop_sequences == ((5, 6), (7,)) and hash(p)
    assert p.replace(max_new_tokens=2).max_new_tokens == 2 and p.max_new_tokens == 4
    assert SamplingParams(max_new_tokens=1, do_sample=False, temperature=0.0).greedy
    for bad, match in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 1, "stop_sequences": [[]]}, "stop sequence is empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


def test_an_output_reads_like_a_dict_of_the_fields_it_holds() -> None:
    out = GenerationOutput(
        responses=torch.zeros(2, 3, dtype=torch.long),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        rollout_log_probs=torch.zeros(2, 3),
    )
    assert set(out) == {"responses", "response_mask", "rollout_log_probs"} and len(out) == 3
    assert "routed_experts" not in out and out.get("metrics") is None
    with pytest.raises(KeyError):
        out["routed_experts"]
    with pytest.raises(KeyError):
        out["nonsense"]
    assert "tool_rewards" in out.replace(tool_rewards=torch.zeros(2))


def test_the_routing_rule_marks_what_was_never_fed() -> None:
    # 2 rows, prompt width 3 (row 1 has one left pad), 3 response steps (row 0 wrote 3 tokens, row 1 wrote 1).
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    spans = torch.tensor([3, 1])
    routed = torch.arange(2 * 6 * 1 * 2, dtype=torch.int16).view(2, 6, 1, 2)  # distinct ids: real top-k
    routed[0, 1, 0] = 4  # a placeholder: both of its K ids equal
    out = mask_unfed_routing(routed, prompt_mask, spans)
    known = out[..., 0, 0] >= 0
    assert known.tolist() == [
        [True, False, True, True, True, False],  # the placeholder; the last token
        [False, True, True, False, False, False],
    ]  # the pad; the only token is the last
    assert torch.equal(out[known], routed[known]) and bool((out[~known] == -1).all())


def test_the_registry_names_every_engine_and_refuses_others() -> None:
    assert set(ROLLOUT_ENGINES) >= {"hf", "vllm"}
    for name, spec in ROLLOUT_ENGINES.items():
        caps = spec.capabilities("cpu")
        assert caps.stop_sequences and caps.multi_rank, name  # what the agent loop and several ranks need
    assert engine_spec("hf").capabilities("cpu").shares_trainer_modules
    assert (
        not engine_spec("vllm").capabilities("cpu").returns_routing
        and engine_spec("vllm").capabilities("cuda").returns_routing
    )
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name: unknown 'sglang'; valid names are .*hf"):
        engine_spec("sglang")


def test_the_served_dtype_follows_the_engines_capability() -> None:
    from conveyor.config import load_config
    from conveyor.rollout.base import served_dtype

    def ro(*overrides: str):
        return load_config(None, list(overrides)).actor_rollout_ref.rollout

    # hf samples from the trainer's own modules: the model's dtype, whatever rollout.dtype says.
    assert served_dtype(ro("actor_rollout_ref.rollout.dtype=bfloat16"), "float32", "cuda") == "float32"
    # An engine with weights of its own: rollout.dtype, else bf16 on CUDA and the model's on the CPU.
    vllm = "actor_rollout_ref.rollout.name=vllm"
    assert served_dtype(ro(vllm), "float32", "cuda") == "bfloat16"
    assert served_dtype(ro(vllm), "float32", "cpu") == "float32"
    assert served_dtype(ro(vllm, "actor_rollout_ref.rollout.dtype=float16"), "float32", "cuda") == "float16"
