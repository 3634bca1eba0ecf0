"""Conversations → prompt token ids with the model's own tokenizer and chat template, for a submit.

The tokenizer is loaded from a local directory or the local Hugging Face cache only (never a download;
:mod:`thinkfleet.template`, shared with the worker). Rendering runs on every core in a process pool: the
pool is forked after the tokenizer is loaded, so each process has it without loading it again; each batch
returns compact results (packed ids, length, content hash, largest id), never Python lists of ints, so the
parent stays cheap.

:func:`model_limits` finds what a GPU server will refuse or crash on — the vocabulary size (an id at
or above it is a CUDA device-side assert, not an error message) and the context length — and
:func:`check_prompt` checks one rendered prompt against them before it is enqueued.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing as mp
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from storage.spans import prompt_opens_reasoning
from thinkfleet import profiles
from thinkfleet.message import content_hash as message_content_hash
from thinkfleet.message import pack_ids

# The tokenizer itself is shared with the worker (thinkfleet/template.py); re-exported for render's callers.
from thinkfleet.template import _LOADED as _LOADED
from thinkfleet.template import TokenizerError as TokenizerError
from thinkfleet.template import fingerprint, load_tokenizer
from thinkfleet.template import render_ids as render_ids
from thinkfleet.tokens import SpanTokens

#: Conversations per task sent to a pool process (big enough to amortize IPC, small for a smooth bar).
DEFAULT_BATCH = 64
#: Batches read ahead per render process (keeps every core busy; bounds what a submit holds in memory).
WINDOW_PER_PROCESS = 4
THINK_START = "<think>"
THINK_END = "</think>"
#: Job-record field → Kimi's marker token (kept for old callers; the markers of a job come from its
#: model profile, :mod:`thinkfleet.profiles`, and its tokenizer).
TOOL_TOKENS = {role: profiles.KIMI.markers[role] for role in profiles.TOOL_ROLES}


@dataclass(frozen=True)
class TokenizerInfo:
    """What the job record says about the tokenizer (so workers and verify can check it)."""

    source: str
    fingerprint: str  # hash of the vocabulary and the special tokens
    chat_template_hash: str
    think_start_id: int | None
    think_end_id: int | None
    tool_ids: dict[str, int] = field(default_factory=dict)  # tool-marker role → id, those present
    stop_token_ids: list[int] = field(default_factory=list)  # eos of tokenizer ∪ generation_config ∪ profile
    #: The model profile applied to this tokenizer (every id in it read from the tokenizer).
    profile: profiles.Resolution | None = None

    @property
    def model_family(self) -> str:
        return self.profile.family if self.profile is not None else profiles.LEGACY_FAMILY

    @property
    def reasoning_spans(self) -> bool:
        return self.profile.reasoning_spans if self.profile is not None else self.think_end_id is not None

    @property
    def opening(self) -> SpanTokens:
        """What says a prompt opens reasoning (:func:`storage.spans.prompt_opens_reasoning`): the think-start id
        and the whitespace ids a template may put after it (``<think>\\n``)."""
        found = self.profile.token_ids if self.profile is not None else {}
        trailing = tuple(int(found[t]) for t in profiles.PROMPT_TRAILING_TEXTS if t in found)
        return SpanTokens(think_start_id=self.think_start_id, prompt_trailing_ids=trailing)


def describe_tokenizer(
    tok: Any,
    source: str,
    think_start_id: int | None = None,
    think_end_id: int | None = None,
    model_family: str | None = None,
    reasoning_spans: bool = True,
) -> TokenizerInfo:
    """What the job record says about ``tok``: its hashes, stop ids, and the model profile's marker ids,
    each read from ``tok`` (:func:`thinkfleet.profiles.resolve`: ``model_family`` or detected).

    Raises :class:`thinkfleet.profiles.ProfileError` (naming the missing token) when the tokenizer lacks
    the profile's reasoning markers and ``reasoning_spans`` is on.
    """
    vocab = tok.get_vocab()
    template = tok.chat_template
    template_text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    given = {"think_start_id": think_start_id, "think_end_id": think_end_id}
    resolution = profiles.resolve(tok, model_family, reasoning_spans, source=f"tokenizer {source!r}", given_ids=given)
    ids = resolution.marker_ids
    stops = _stop_ids(tok, source)
    stops += [t for t in resolution.stop_ids if t not in stops]
    return TokenizerInfo(
        source=source,
        fingerprint=fingerprint(tok, vocab),
        chat_template_hash=hashlib.sha256(template_text.encode()).hexdigest()[:16],
        think_start_id=ids["think_start_id"],
        think_end_id=ids["think_end_id"],
        tool_ids={role: ids[role] for role in profiles.TOOL_ROLES if ids[role] is not None},
        stop_token_ids=stops,
        profile=resolution,
    )


def _model_file(source: str, name: str) -> dict[str, Any]:
    """A JSON file next to the tokenizer (a model directory, or the local hub cache); {} when absent/unreadable."""
    path = Path(source).expanduser() / name
    try:
        if path.is_file():
            found: str | None = str(path)
        else:
            from transformers.utils import cached_file

            found = cached_file(source, name, local_files_only=True, _raise_exceptions_for_missing_entries=False)
        config = json.loads(Path(found).read_text()) if found else {}
    except Exception:
        return {}
    return config if isinstance(config, dict) else {}


def _stop_ids(tok: Any, source: str) -> list[int]:
    """``tokenizer.eos_token_id`` ∪ ``generation_config.json`` ``eos_token_id`` (what SGLang stops on)."""
    ids: list[int] = []
    config = _model_file(source, "generation_config.json")
    eos = config.get("eos_token_id")
    for value in [*(eos if isinstance(eos, list) else [eos]), tok.eos_token_id]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


# -- model limits: what the GPU server refuses (context) or crashes on (ids) --------------------------------
#: ``config.json`` keys SGLang reads the context length from, in its order of preference
#: (``sglang.srt.utils.hf_transformers_utils.get_context_length``).
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)
#: Where a multimodal config keeps its language model's settings (Kimi-K2.5: ``text_config``, a DeepSeek-V3
#: config); the first present wins, else the top level (Kimi-K2, DeepSeek-V3 themselves).
TEXT_CONFIG_PATHS = (("text_config",), ("thinker_config", "text_config"), ("llm_config",), ("language_config",))


@dataclass(frozen=True)
class ModelLimits:
    """Bounds every prompt is checked against before it is enqueued (and workers re-check from the job record).

    ``vocab_size``: every id must be below it. ``context_length``: prompt + max_new_tokens must be below it
    (SGLang refuses ``prompt + max_new_tokens >= context`` in the versions the simulator follows, ``>`` in newer
    ones: ``<`` satisfies both); None = unknown, not checked.
    """

    vocab_size: int
    vocab_source: str  # "config.json text_config.vocab_size", "len(tokenizer)", …
    context_length: int | None = None
    context_source: str = ""  # "--context-length", "config.json max_position_embeddings", …; "" when unknown

    def context_warning(self) -> str | None:
        if self.context_length is not None:
            return None
        return (
            "context length unknown (no config.json with max_position_embeddings next to --tokenizer): "
            "prompt + max_new_tokens is not checked and over-long rows will come back as dead 400s; "
            "pass --context-length N (the server's context length) to check it"
        )


def _text_config(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The language model's config and its path prefix ("" at the top level, "text_config." nested)."""
    for path in TEXT_CONFIG_PATHS:
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            return node, ".".join(path) + "."
    return config, ""


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def config_context_length(config: dict[str, Any]) -> tuple[int | None, str]:
    """SGLang's derived context length of a ``config.json`` and where it came from: the first of
    :data:`CONTEXT_LENGTH_KEYS` in the text config, × ``rope_scaling.factor`` unless the scaling names an
    ``original_max_position_embeddings`` (YaRN, as Kimi/DeepSeek-V3 do: the key is already the extended
    length) or is ``llama3``. (None, "") when no key is there (SGLang would assume 2048; we do not guess)."""
    text, prefix = _text_config(config)
    for key in CONTEXT_LENGTH_KEYS:
        value = _positive_int(text.get(key))
        if value is None:
            continue
        rope = text.get("rope_scaling")
        factor = 1.0
        if (
            isinstance(rope, dict)
            and "original_max_position_embeddings" not in rope
            and rope.get("rope_type") != "llama3"
            and isinstance(rope.get("factor"), int | float)
        ):
            factor = float(rope["factor"])
        where = f"config.json {prefix}{key}"
        if factor != 1.0:
            return int(factor * value), f"{where} × rope_scaling.factor {factor:g}"
        return value, where
    return None, ""


def model_limits(tok: Any, source: str, context_length: int | None = None) -> ModelLimits:
    """The bounds of the model at ``source`` (the ``--tokenizer`` path, normally the model directory).

    Vocabulary: ``config.json`` ``vocab_size`` (of the text config) when there is one — the embedding
    table's size, the true bound on the GPU — else ``len(tokenizer)`` (base vocabulary + added/special
    tokens: the bound of what this tokenizer can produce). Context: ``context_length`` (``--context-length``)
    when given, else :func:`config_context_length`, else unknown.
    """
    config = _model_file(source, "config.json")
    text, prefix = _text_config(config)
    vocab = _positive_int(text.get("vocab_size"))
    vocab_source = f"config.json {prefix}vocab_size"
    if vocab is None and prefix:
        vocab, vocab_source = _positive_int(config.get("vocab_size")), "config.json vocab_size"
    if vocab is None:
        vocab, vocab_source = len(tok), "len(tokenizer)"
    if context_length is not None:
        return ModelLimits(vocab, vocab_source, int(context_length), "--context-length")
    found, where = config_context_length(config)
    return ModelLimits(vocab, vocab_source, found, where)


def check_prompt(
    n_tokens: int,
    max_id: int,
    max_new_tokens: int,
    limits: ModelLimits,
    ids: Sequence[int] | None = None,
    tok: Any = None,
) -> str | None:
    """Why a prompt of ``n_tokens`` ids (the largest ``max_id``) with a budget of ``max_new_tokens`` must not
    reach the server, with the fix; None when it fits. Ids first: they crash the server, a length only fails.

    ``ids`` (and ``tok``), when given, name the first id out of range, its position (and token).
    """
    if max_id >= limits.vocab_size:
        what = f"id {max_id:,}"
        bad = [(i, int(t)) for i, t in enumerate(ids) if t >= limits.vocab_size] if ids is not None else []
        if bad:
            at, first = bad[0]
            token = _token_name(tok, first)
            what = f"id {first:,}{f' {token!r}' if token else ''} at position {at:,}"
            what += f" ({len(bad):,} such ids)" if len(bad) > 1 else ""
        return (
            f"{what} ≥ vocabulary size {limits.vocab_size:,} ({limits.vocab_source}): the model has no embedding "
            "for it (a CUDA device-side assert on the server); drop the row, or check that --tokenizer is the "
            "served model's own"
        )
    context = limits.context_length
    if context is None or n_tokens + max_new_tokens < context:
        return None
    where = f"context {context:,} ({limits.context_source}; SGLang needs prompt + max_new_tokens < context)"
    if n_tokens >= context - 1:
        return f"prompt is {n_tokens:,} tokens, leaving no room for one new token in {where}: shorten or drop the row"
    return (
        f"prompt is {n_tokens:,} tokens + max_new_tokens {max_new_tokens:,} ≥ {where}: "
        f"lower --max-new-tokens to {context - 1 - n_tokens:,} or drop the row"
    )


def _token_name(tok: Any, token_id: int) -> str | None:
    try:
        name = tok.convert_ids_to_tokens(token_id) if tok is not None else None
    except Exception:
        return None
    return name if isinstance(name, str) else None


# -- rendering -------------------------------------------------------------------------------------------
#: Per-process state: (tokenizer, chat-template kwargs, what opens reasoning). Set before forking.
_STATE: tuple[Any, dict[str, Any], SpanTokens] | None = None

#: One result: (packed ids, token count, content hash, opens reasoning, largest id or -1) or an error.
Result = tuple[bytes, int, str, bool, int] | str


def content_hash(ids: np.ndarray) -> str:
    """Hash of the prompt ids (uint32 LE): a re-submit whose content changed is caught with it, and
    workers and ``producer verify`` recompute it from the ids (:func:`thinkfleet.message.content_hash`)."""
    return message_content_hash(ids)


def _render_batch(batch: Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]) -> list[Result]:
    assert _STATE is not None, "render process started without a tokenizer"
    tok, kwargs, opening = _STATE
    texts: list[str | None] = []
    errors: dict[int, str] = {}
    for i, (messages, tools) in enumerate(batch):
        try:
            texts.append(
                tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
            )
        except Exception as e:  # a template error on one row must not sink the batch
            errors[i] = f"chat template failed: {type(e).__name__}: {e}"
            texts.append(None)
    good = [t for t in texts if t is not None]
    encoded = iter(_encode(tok, good) if good else [])
    out: list[Result] = []
    for i, text in enumerate(texts):
        if text is None:
            out.append(errors[i])
            continue
        ids = np.asarray(next(encoded), dtype="<u4")
        ends = prompt_opens_reasoning(ids, opening)  # <think>, or <think>\n (Qwen3-Thinking-2507, R1-0528)
        max_id = int(ids.max()) if len(ids) else -1
        out.append((pack_ids(ids), len(ids), content_hash(ids), ends, max_id))
    return out


def _encode(tok: Any, texts: list[str]) -> list[list[int]]:
    """``tok(texts, add_special_tokens=False)["input_ids"]``, straight from the Rust backend when there is one
    (same ids, without building attention masks and BatchEncoding objects we would throw away)."""
    backend = getattr(tok, "_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _init_spawned(source: str, trust_remote_code: bool, kwargs: dict[str, Any], opening: SpanTokens) -> None:
    global _STATE
    if _STATE is None:  # forked children already have it
        _STATE = (load_tokenizer(source, trust_remote_code), kwargs, opening)


class RenderPool:
    """Renders conversations on ``processes`` cores; ``processes=1`` renders in this process."""

    def __init__(
        self,
        tok: Any,
        source: str,
        chat_template_kwargs: dict[str, Any],
        opening: SpanTokens | int | None,
        processes: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        """``opening``: what opens reasoning (:attr:`TokenizerInfo.opening`; a bare think-start id: that id last)."""
        global _STATE
        if not isinstance(opening, SpanTokens):
            opening = SpanTokens(think_start_id=opening)
        _STATE = (tok, dict(chat_template_kwargs), opening)
        self.tok = tok
        self.processes = max(1, processes or os.cpu_count() or 1)
        self._pool = None
        self._closing = False
        if self.processes > 1:
            gc.freeze()  # forked children would otherwise copy every page the GC touches
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self._pool = mp.get_context(method).Pool(
                self.processes,
                initializer=_init_spawned,
                initargs=(source, trust_remote_code, dict(chat_template_kwargs), opening),
            )

    def render(
        self, items: Iterable[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]], batch_size: int = DEFAULT_BATCH
    ) -> Iterator[list[Result]]:
        """Results per batch, in input order. At most :data:`WINDOW_PER_PROCESS` batches per process are read
        ahead of the caller: the pool's feeder thread would otherwise read the whole dataset into memory."""
        batches = _chunks(items, batch_size)
        if self._pool is None:
            yield from map(_render_batch, batches)
            return
        slots = threading.Semaphore(WINDOW_PER_PROCESS * self.processes)

        def gated() -> Iterator[list[Any]]:
            for batch in batches:
                while not slots.acquire(timeout=0.2):
                    if self._closing:  # close() joins the feeder thread: it must not wait for a slot forever
                        return
                yield batch

        for result in self._pool.imap(_render_batch, gated(), chunksize=1):
            slots.release()
            yield result

    def close(self) -> None:
        self._closing = True
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> RenderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
