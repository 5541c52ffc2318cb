"""A tiny word-level tokenizer with a chat template, for ``vllm serve`` over the tiny model.

The tiny model (``launch.write_tiny_model``) has no tokenizer, so engines built by ``launch`` take
token ids only. ``vllm serve`` with text prompts and chat messages needs one: this writes a
``tokenizer.json`` (``tokenizers`` WordLevel over whitespace-separated words, exactly
``TINY_VOCAB`` ids) and a ``tokenizer_config.json`` with a small chat template next to the model's
``config.json``. Words outside the vocabulary become ``<unk>``.

Vocabulary: ``<unk>`` 0, ``<s>`` 1 (bos), ``</s>`` 2 (eos), the role markers ``<|system|>``,
``<|user|>``, ``<|assistant|>``, then ``w0`` … up to ``TINY_VOCAB`` ids. ``w{i}`` is token id
``WORD_BASE + i``, so a test can write a text prompt whose token ids it knows.
"""

from __future__ import annotations

import json
import os

from .launch import TINY_VOCAB, write_tiny_model

SPECIALS = ("<unk>", "<s>", "</s>")
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
#: Token id of ``w0``.
WORD_BASE = len(SPECIALS) + len(ROLES)

#: ``<|role|> content`` per message, then ``<|assistant|>`` when a reply is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word(token_id: int) -> str:
    """The word the tiny tokenizer maps to ``token_id`` (``WORD_BASE`` ≤ id < ``TINY_VOCAB``)."""
    if not WORD_BASE <= token_id < TINY_VOCAB:
        raise ValueError(f"token id {token_id} is not a word id in [{WORD_BASE}, {TINY_VOCAB})")
    return f"w{token_id - WORD_BASE}"


def word_ids(start: int, n: int) -> list[int]:
    """``n`` token ids the tiny tokenizer has words for, starting at word ``start`` (wrapping)."""
    return [WORD_BASE + (start + i) % (TINY_VOCAB - WORD_BASE) for i in range(n)]


def words(start: int, n: int) -> str:
    """The text of :func:`word_ids` ``(start, n)``: it tokenizes back to those ids."""
    return " ".join(word(i) for i in word_ids(start, n))


def write_tiny_tokenizer(directory: str) -> str:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ROLES)}
    for i in range(TINY_VOCAB - WORD_BASE):
        vocab[f"w{i}"] = WORD_BASE + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 65536,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def write_tiny_model_with_tokenizer(directory: str | None = None) -> str:
    """The tiny model's ``config.json`` plus the tokenizer files; returns the directory."""
    directory = write_tiny_model(directory)
    return write_tiny_tokenizer(directory)
