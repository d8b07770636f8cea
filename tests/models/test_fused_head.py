"""A fused LM head in a model's forward against the model's own logits: log-probs, entropy and every gradient."""

from __future__ import annotations

import pytest
import torch

from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.models.fused_head import fused_head_reason, fused_lm_head, split_head_output
from conveyor.models.lean import LeanForward
from conveyor.models.lora import apply_lora
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer

B, T = 3, 9


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(4, vocab, (B, T), generator=gen)
    return ids, torch.roll(ids, -1, dims=1)


def _run(model, ids, labels, fused: bool, temperature: float = 0.8):
    """Log-probs and entropy (B, T) of `labels` after each position, fused or from the logits."""
    if fused:
        with fused_lm_head(model, labels, with_entropy=True, temperature=temperature):
            stats = model(input_ids=ids, use_cache=False).logits
        return split_head_output(stats, True)
    logits = model(input_ids=ids, use_cache=False).logits
    return logprobs_and_entropy(logits, labels, True, temperature=temperature)


def _grads(model, ids, labels, fused: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    lp, ent = _run(model, ids, labels, fused)
    gen = torch.Generator().manual_seed(5)
    (lp * torch.randn(lp.shape, generator=gen) + 0.1 * ent).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def _assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    assert got[2].keys() == want[2].keys() and want[2]
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_head_takes_the_logits_path_numbers_and_gradients(tok, arch: str, tied: bool) -> None:
    """Tied embeddings get both gradients (as input embedding and as head) through the fused head."""
    model = build_tiny_model(arch, tok, tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    ids, labels = _batch(len(tok))
    _assert_same(_grads(model, ids, labels, True), _grads(model, ids, labels, False))
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # the class's forward is back


def test_fused_head_under_the_lean_forward(tok) -> None:
    """The lean forward calls the head on (B, R, H) in the input's row order, so the labels line up."""
    model = build_tiny_model("qwen3_moe", tok)
    lean = LeanForward(model)
    gen = torch.Generator().manual_seed(0)
    # Two prompts with three rows each, interleaved: the lean forward reorders rows by prompt internally.
    prompts = torch.randint(4, len(tok), (2, 4), generator=gen)[[0, 1, 0, 1, 0, 1]]
    prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
    responses = torch.randint(4, len(tok), (6, 5), generator=gen)
    response_mask = torch.ones_like(responses, dtype=torch.bool)
    response_mask[2, 3:] = False

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        if fused:
            with fused_lm_head(model, responses, with_entropy=True, temperature=1.0):
                stats, _ = lean.response_logits(prompts, prompt_mask, responses, response_mask)
            lp, ent = split_head_output(stats, True)
        else:
            logits, _ = lean.response_logits(prompts, prompt_mask, responses, response_mask)
            lp, ent = logprobs_and_entropy(logits, responses, True)
        lp, ent = lp * response_mask, ent * response_mask
        (lp.sum() - ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    _assert_same(run(True), run(False))


def test_lora_adapters_train_through_the_fused_head(tok) -> None:
    """LoRA on the decoder's linear layers (all-linear leaves the head out): the adapters' gradients are the same."""
    model = build_tiny_model("qwen3", tok)
    apply_lora(model, rank=4, alpha=8, target_modules="all-linear")
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero, which would hide A's gradient
            torch.nn.init.normal_(param, std=0.1)
    assert fused_head_reason(model) is None
    ids, labels = _batch(len(tok))
    got, want = _grads(model, ids, labels, True), _grads(model, ids, labels, False)
    assert any("lora_A" in n for n in want[2]) and all("lora" in n for n in want[2])
    _assert_same(got, want)


def test_heads_that_cannot_be_fused_say_why(tok) -> None:
    """A LoRA adapter on the head, or an architecture outside the list, keeps the logits path."""
    model = build_tiny_model("qwen3", tok)
    apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "lm_head"])
    assert "LoRA" in fused_head_reason(model)
    with pytest.raises(ValueError, match="cannot be fused"):
        with fused_lm_head(model, torch.zeros(1, 1, dtype=torch.long), with_entropy=False, temperature=1.0):
            pass
    olmoe = build_tiny_model("olmoe", tok)
    assert "olmoe" in fused_head_reason(olmoe)


def test_labels_that_do_not_match_the_kept_positions_are_refused(tok) -> None:
    model = build_tiny_model("qwen3", tok)
    ids, labels = _batch(len(tok))
    with pytest.raises(ValueError, match="hidden states of shape"):
        with fused_lm_head(model, labels[:, :-1], with_entropy=False, temperature=1.0):
            model(input_ids=ids, use_cache=False)
