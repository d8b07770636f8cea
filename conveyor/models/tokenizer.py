"""A character-level tokenizer built locally, for tiny models and tests.

Each character of an alphabet is one token, preceded by four special tokens
(`<pad>` = 0, `<eos>`, `<bos>`, `<unk>`). The result is a regular Hugging Face
fast tokenizer: it pads on the left (as generation wants), round-trips through
`save_pretrained` / `AutoTokenizer.from_pretrained`, and has a chat template
that concatenates the message contents, so a chat-message prompt renders to
its bare text (no role markers, no generation prompt).

It deliberately does not add `<bos>` or `<eos>` when encoding: a prompt
encodes to exactly its characters, so prompt + response ids line up with the
text. It does not know any real model's vocabulary; real runs load the
checkpoint's own tokenizer (`conveyor.models.loading.load_tokenizer`).
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

__all__ = ["DEFAULT_ALPHABET", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_char_tokenizer"]

# Digits and arithmetic first, then lower-case letters and a little punctuation;
# `#` is there so GSM8K-style "#### 42" answers encode without `<unk>`.
DEFAULT_ALPHABET: str = string.digits + "+-*/=" + " " + string.ascii_lowercase + ".,:;?!()'#\n"

#: Special tokens in id order: `<pad>` is 0, then `<eos>`, `<bos>`, `<unk>`.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>")

#: Renders chat messages as the concatenation of their contents.
CHAT_TEMPLATE: str = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """A fast tokenizer: `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, then one token per character of `alphabet`."""
    if not alphabet:
        raise ValueError("build_char_tokenizer: `alphabet` is empty; give at least one character")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"build_char_tokenizer: `alphabet` repeats the characters {repeated!r}; list each once")
    if model_max_length <= 0:
        raise ValueError(f"build_char_tokenizer: `model_max_length` must be positive, got {model_max_length}")

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    # BPE with no merges and no pre-tokenizer splits any text into single
    # characters (spaces and newlines included) and maps unknown ones to <unk>.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    # Without a decoder, tokens would be joined with spaces on decode.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))

    pad, eos, bos, unk = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        unk_token=unk,
        padding_side="left",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
