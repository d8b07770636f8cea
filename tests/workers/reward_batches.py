"""Tiny reward models and judges saved to a directory, a batch of scored samples in a data plane, and the scores a plain
Hugging Face model gives them: shared by the reward-model tests and their multi-rank script."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification

from conveyor.models.build_scorers import bigram_judge
from conveyor.models.reward_model import build_tiny_reward_model
from conveyor.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from conveyor.tasks.prompts import PromptEncoder, sample_keys

# Prompts as chat messages, and two responses each.
PROMPTS = [
    [{"role": "user", "content": "12+7="}],
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is 3*4?"}],
    [{"role": "user", "content": "9-5="}],
]
RESPONSES = [["19", "20 or so"], ["12.", ""], ["4", "the answer is 4, clearly."]]
RULE = [[1.0, 0.0], [1.0, 0.0], [1.0, 0.5]]


def other_tokenizer():
    """A tokenizer the policy's does not match: other ids for every character, and a chat template with roles."""
    tok = build_char_tokenizer(DEFAULT_ALPHABET[::-1] + "|")
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}|{{ m['content'] }}\n{% endfor %}"
    return tok


def save_reward_model(path: Path, tokenizer, seed: int = 0, **kw) -> Path:
    """A tiny reward model and its tokenizer written to `path`."""
    build_tiny_reward_model(tokenizer, seed=seed, **kw).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def put_batch(data_plane, tokenizer, partition: str = "p"):
    """The samples of PROMPTS x RESPONSES with their rule rewards (`rm_scores` on the last response token)."""
    records = [{"prompt": p, "data_source": "x", "reward_model": {"ground_truth": "0"}} for p in PROMPTS]
    uids = [f"{partition}/p{i}" for i in range(len(records))]
    encoder = PromptEncoder(tokenizer, 64, "error")
    fields, lengths = encoder.fields(records, uids, [i for i in range(len(records)) for _ in range(2)])
    rows = []
    for pair in RESPONSES:
        for text in pair:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append(ids + [tokenizer.eos_token_id] if text else [])
    width = max(len(r) for r in rows)
    responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    rule = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
        if r:
            rule[i, len(r) - 1] = [v for pair in RULE for v in pair][i]
    fields.update({"responses": responses, "response_mask": mask, "rm_scores": rule})
    return data_plane.kv_batch_put(keys=sample_keys(uids, 2), partition_id=partition, fields=fields)


def reference_scores(path: Path, policy_tokenizer, rm_tokenizer=None, max_length: int | None = None) -> torch.Tensor:
    """Each sample's score by the checkpoint at `path` loaded on its own and run on one unpadded row at a time."""
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    scores = []
    for prompt, pair in zip(PROMPTS, RESPONSES):
        for text in pair:
            if rm_tokenizer is None:  # the same tokens: the prompt as the policy renders it, then the response
                ids = policy_tokenizer(
                    policy_tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False,
                )["input_ids"]
                ids = ids + policy_tokenizer(text, add_special_tokens=False)["input_ids"]
                if text:
                    ids = ids + [policy_tokenizer.eos_token_id]
            else:
                rendered = rm_tokenizer.apply_chat_template(
                    list(prompt) + [{"role": "assistant", "content": text}], tokenize=False
                )
                ids = rm_tokenizer(rendered, add_special_tokens=False)["input_ids"]
            if max_length is not None:
                ids = ids[-max_length:]
            with torch.no_grad():
                scores.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return torch.tensor(scores)


def save_chain_judge(path: Path, chain: dict[str, list[str]]) -> Path:
    """A tiny causal LM that answers by a bigram chain: after character c it says one of chain[c] (tied if several).

    Every layer's output projection is zeroed (the layers add nothing), the embedding is one-hot and the LM head maps
    each character to its successors: generation follows the chain from the prompt's last character to <eos>.
    """
    tok = build_char_tokenizer()
    tok.chat_template = None
    model = bigram_judge(tok, chain)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


# After "verdict:" the judge says "mayes" (greedy: 'm' ties with 'y' and has the lower id) or "yes" (sampled).
MAYBE_YES = {":": ["m", "y"], "m": ["a"], "a": ["y"], "y": ["e"], "e": ["s"], "s": ["<eos>"]}
ALWAYS_MAYES = {":": ["m"], "m": ["a"], "a": ["y"], "y": ["e"], "e": ["s"], "s": ["<eos>"]}
