"""A job's tokenizer and chat template: loading it, knowing it again, rendering a conversation with it.

Shared by the producer (``producer submit`` renders every prompt, producer/render.py) and the worker (a
``--turns all`` job's next turn is rendered where its previous turn was stored, workers/turns.py), so both
load the same tokenizer the same way and agree on its :func:`fingerprint`. The tokenizer is loaded from a
local directory or the local Hugging Face cache only (never a download).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


class TokenizerError(Exception):
    """The tokenizer cannot be loaded or cannot render prompts."""


#: Loaded tokenizers by (source, trust_remote_code, files' stat): one process may submit many times.
_LOADED: dict[tuple[Any, ...], Any] = {}


def _cache_key(source: str, trust_remote_code: bool) -> tuple[Any, ...]:
    path = Path(source)
    files: tuple[Any, ...] = ()
    if path.is_dir():
        files = tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in path.iterdir() if p.is_file()))
    return (str(path.resolve()) if path.is_dir() else source, trust_remote_code, files)


def load_tokenizer(source: str, trust_remote_code: bool = False) -> Any:
    """A tokenizer from a local directory or the local hub cache (``local_files_only``)."""
    key = _cache_key(source, trust_remote_code)
    if key not in _LOADED:
        _LOADED.clear()  # keep one: tokenizers are large
        _LOADED[key] = _load(source, trust_remote_code)
    return _LOADED[key]


def _load(source: str, trust_remote_code: bool) -> Any:
    if (source.startswith((".", "~")) or os.path.isabs(source)) and not Path(source).expanduser().is_dir():
        raise TokenizerError(
            f"cannot load tokenizer {source!r}: no such directory\n"
            "  → pass the directory that holds tokenizer_config.json (or a hub id in the local cache)"
        )
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(
            str(Path(source).expanduser()) if source.startswith("~") else source,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
        )
    except Exception as e:
        hint = (
            "pass a local directory with the tokenizer files, or fetch it once with "
            f"`hf download {source}` (submit never downloads)"
        )
        if "trust_remote_code" in str(e) and not trust_remote_code:
            hint = "this tokenizer ships its own code (Kimi's does): add --trust-remote-code"
        raise TokenizerError(f"cannot load tokenizer {source!r}: {e}\n  → {hint}") from e
    if not getattr(tok, "chat_template", None):
        raise TokenizerError(f"tokenizer {source!r} has no chat_template; use the model's own tokenizer directory")
    _keep_vocab(tok)
    return tok


def _keep_vocab(tok: Any) -> None:
    """Make ``tok.get_vocab()`` build the vocabulary once: each call builds a fresh dict of all of it (≈ 0.2 CPU-s
    for Kimi's 163,840 tokens) and a submit asks three times (its fingerprint, the profile's detection, the marker
    ids). Each caller still gets its own copy (≈ 2 ms), and adding tokens (a new ``len(tok)``) builds it again."""
    build = tok.get_vocab
    kept: dict[int, dict[str, int]] = {}

    def get_vocab() -> dict[str, int]:
        size = len(tok)
        if size not in kept:
            kept.clear()
            kept[size] = build()
        return dict(kept[size])

    tok.get_vocab = get_vocab


def fingerprint(tok: Any, vocab: dict[str, int]) -> str:
    """Hash of the vocabulary (in id order) and the added tokens with their special flags."""
    by_id: list[str] = [""] * (max(vocab.values()) + 1 if vocab else 0)
    for token, token_id in vocab.items():  # O(n), not a sort: vocabularies are dense
        by_id[token_id] = token
    added = sorted((int(i), str(t), bool(getattr(t, "special", True))) for i, t in tok.added_tokens_decoder.items())
    digest = hashlib.sha256("\x00".join(by_id).encode("utf-8", "surrogatepass"))
    digest.update(json.dumps(added, ensure_ascii=False).encode())
    return digest.hexdigest()[:16]


def render_ids(
    tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, chat_template_kwargs: dict[str, Any]
) -> list[int]:
    """The prompt ids exactly as ``apply_chat_template(..., add_generation_prompt=True)`` makes them."""
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
    )
    return tok(text, add_special_tokens=False)["input_ids"]
