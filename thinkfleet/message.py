"""The task message a prompt travels in: producer → Redis → worker.

One Celery task per prompt (``TASK_NAME``), serialized with msgpack so the token ids ride as raw bytes
(little-endian uint32, zstd-compressed) instead of a JSON integer list. Flower shows ``argsrepr`` —
job, dataset and prompt id — never the bytes.

Anyone who can write the broker can write a message, so a worker trusts none of it before
:meth:`PromptTask.verified_ids` (and the names, checked when the task is built) say so:

- job and dataset names are *plain* (:data:`PLAIN_NAME`, the producer's dataset-name rule): they
  become Redis keys and storage paths, so ``x:claims`` must never reach a key builder;
- ``overrides`` only carry the per-message sampling keys the producer and ``producer retry`` set
  (:data:`OVERRIDE_KEYS`), with sane values;
- the id blob is decompressed with a bound (``max_prompt_tokens`` ids): a zstd frame whose header
  declares more is refused before anything is allocated, and a frame that declares no size is refused;
- the message carries a ``content_hash`` of :func:`content_hash`'s form (anything else is ``bad_content_hash``),
  and the ids hash to it;
- every id is below the job's vocabulary when it is known;
- where a signing key is configured, the producer signed it (``signature``: thinkfleet/signing.py, checked by
  the worker before anything else).

A refusal is a :class:`MessageRefused` carrying the dead-letter class.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zstandard

from thinkfleet.vision import MAX_IMAGES_PER_PROMPT, ImageRef

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where ids are handled: the settings check every command makes (thinkfleet.signing) loads
# this module, and `producer status` should not pay numpy's ~0.15 s start for it.

TASK_NAME = "thinkfleet.generate"

#: Magic byte of the packed ids: 0x01 = zstd(uint32 LE), 0x00 = raw uint32 LE.
_ZSTD = 0x01
_RAW = 0x00
_ID_BYTES = 4
_compressor = zstandard.ZstdCompressor(level=3)  # writes the content size into every frame

#: Job and dataset names: what ``producer submit`` accepts as a dataset name (producer/inputs.py). They
#: become Redis keys (``{prefix}:job:{job}:…``) and storage paths, so no ':', '/', spaces or leading dot.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The longest prompt a worker decodes, in ids (``THINKFLEET_MAX_PROMPT_TOKENS``): 4 MiB of uint32.
DEFAULT_MAX_PROMPT_TOKENS = 1 << 20
#: The sampling keys one message may set for itself; everything else comes from the job record.
#: ``sampling_seed``: per-sample seeds (``thinkfleet.state.job.sample_overrides``); ``max_new_tokens``:
#: ``producer retry --truncated --max-new-tokens`` (producer/retry.py).
OVERRIDE_KEYS = frozenset({"sampling_seed", "max_new_tokens"})
_INT64 = 1 << 63
_MAX_NEW_TOKENS = (1 << 31) - 1
#: What :func:`content_hash` returns: 16 lowercase hex digits (blake2b, 8 bytes).
_CONTENT_HASH = re.compile(r"[0-9a-f]{16}")


class MessageRefused(ValueError):
    """A message a worker must not run; ``error_class`` is its dead-letter class."""

    def __init__(self, error_class: str, detail: str) -> None:
        super().__init__(f"{error_class}: {detail}")
        self.error_class = error_class
        self.detail = detail


@dataclass(frozen=True)
class MessageLimits:
    """What a worker accepts: ids per prompt, and the job's vocabulary (None = unknown, unchecked)."""

    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    vocab_size: int | None = None

    @property
    def max_id_bytes(self) -> int:
        return self.max_prompt_tokens * _ID_BYTES


def is_plain_name(name: object) -> bool:
    """True for a job or dataset name that may become a Redis key and a path segment."""
    return isinstance(name, str) and PLAIN_NAME.fullmatch(name) is not None


def check_name(kind: str, name: object) -> str:
    """``name`` when it is plain, else :class:`MessageRefused` ``bad_{kind}_name``."""
    if not is_plain_name(name):
        raise MessageRefused(
            f"bad_{kind}_name",
            f"{kind} name {str(name)[:200]!r} is not plain (letters, digits, '.', '_', '-'; at most 128, "
            "not starting with '.', '_' or '-')",
        )
    return str(name)


# -- content hash ------------------------------------------------------------------------------------------
def content_hash(ids: list[int] | np.ndarray, images: Sequence[str] = ()) -> str:
    """Hash of the prompt ids (uint32 LE) and, for an image prompt, of its images' sha256s in order (what the
    model sees is both): workers and ``producer verify`` recompute it from the ids and the image references."""
    import numpy as np

    return hash_id_bytes(np.ascontiguousarray(ids, dtype="<u4").tobytes(), images)


#: An image prompt's hash is another blake2b function (its personalization): no text prompt's ids can be made to
#: hash like ids + image digests, so a message stripped of its images never passes for the submitted prompt.
_IMAGE_PERSON = b"tf-image-prompt"


def hash_id_bytes(raw: bytes | memoryview, images: Sequence[str] = ()) -> str:
    """:func:`content_hash` of ids already packed as uint32 LE bytes (and the sha256 hex digests of its images)."""
    if not images:
        return hashlib.blake2b(raw, digest_size=8).hexdigest()
    digest = hashlib.blake2b(raw, digest_size=8, person=_IMAGE_PERSON)
    for sha256 in images:
        digest.update(bytes.fromhex(sha256))
    return digest.hexdigest()


def is_content_hash(text: object) -> bool:
    """True when ``text`` has the form :func:`content_hash` returns, so it can be checked against ids.

    Other values cannot be recomputed: a worker refuses a message carrying one (``bad_content_hash``), and
    ``producer verify`` flags a stored row with one as stale whenever the submitted hash is a real one.
    """
    return isinstance(text, str) and _CONTENT_HASH.fullmatch(text) is not None


# -- packed ids -------------------------------------------------------------------------------------------
def pack_ids(ids: list[int] | np.ndarray, compress: bool = True) -> bytes:
    """Token ids → compact bytes (the inverse of :func:`unpack_ids`)."""
    import numpy as np

    raw = np.asarray(ids, dtype="<u4").tobytes()
    if compress:
        return bytes([_ZSTD]) + _compressor.compress(raw)
    return bytes([_RAW]) + raw


def unpack_id_bytes(blob: bytes, max_bytes: int | None = DEFAULT_MAX_PROMPT_TOKENS * _ID_BYTES) -> bytes:
    """Bytes from :func:`pack_ids` → the uint32 LE id bytes, never more than ``max_bytes`` (None: no bound).

    Raises :class:`MessageRefused` ``oversize`` for more ids than that — a zstd frame whose header
    declares more is refused before any output is allocated — and ValueError for anything else
    (an unknown kind byte, a broken or sizeless frame, a partial id).
    """
    if not blob:
        raise ValueError("empty token blob")
    kind, body = blob[0], memoryview(blob)[1:]
    if kind == _ZSTD:
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise ValueError(f"not a zstd frame: {exc}") from None
        if declared < 0:  # CONTENTSIZE_UNKNOWN / _ERROR: decompressing it would need a growing buffer
            raise ValueError("zstd frame declares no content size (pack_ids always writes it)")
        if max_bytes is not None and declared > max_bytes:
            raise MessageRefused(
                "oversize", f"zstd frame declares {declared:,} bytes of ids, over the limit of {max_bytes:,}"
            )
        # One-shot with a declared size: the output buffer is exactly that size, whatever the frame holds.
        try:
            data = zstandard.ZstdDecompressor().decompress(body)
        except zstandard.ZstdError as exc:
            raise ValueError(f"broken zstd frame: {exc}") from None
        if len(data) != declared:
            raise ValueError(f"zstd frame declared {declared} bytes but held {len(data)}")
    elif kind == _RAW:
        if max_bytes is not None and len(body) > max_bytes:
            raise MessageRefused("oversize", f"{len(body):,} bytes of raw ids, over the limit of {max_bytes:,}")
        data = bytes(body)
    else:
        raise ValueError(f"unknown token blob kind {kind:#x}")
    if len(data) % _ID_BYTES:
        raise ValueError(f"token blob of {len(data)} bytes is not a whole number of uint32")
    return data


def unpack_ids(blob: bytes, max_ids: int | None = DEFAULT_MAX_PROMPT_TOKENS) -> list[int]:
    """Bytes from :func:`pack_ids` → token ids (at most ``max_ids``; None: no bound). Raises
    :class:`MessageRefused` (``oversize``) or ValueError on anything else."""
    import numpy as np

    data = unpack_id_bytes(blob, None if max_ids is None else max_ids * _ID_BYTES)
    return np.frombuffer(data, dtype="<u4").tolist()


def check_overrides(overrides: dict[str, Any]) -> None:
    """Only :data:`OVERRIDE_KEYS`, each an integer in range; else :class:`MessageRefused` ``bad_overrides``."""
    extra = sorted(str(k)[:64] for k in overrides if k not in OVERRIDE_KEYS)
    if extra:
        raise MessageRefused(
            "bad_overrides", f"overrides {extra} are not per-message keys (allowed: {sorted(OVERRIDE_KEYS)})"
        )
    seed = overrides.get("sampling_seed")
    if "sampling_seed" in overrides and not (_is_int(seed) and -_INT64 <= seed < _INT64):
        raise MessageRefused("bad_overrides", f"sampling_seed {str(seed)[:64]!r} is not a 64-bit integer")
    budget = overrides.get("max_new_tokens")
    if "max_new_tokens" in overrides and not (_is_int(budget) and 1 <= budget <= _MAX_NEW_TOKENS):
        raise MessageRefused("bad_overrides", f"max_new_tokens {str(budget)[:64]!r} is not a positive integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _media(value: Any) -> tuple[ImageRef, ...]:
    """A message's image references (ValueError for anything a producer did not write)."""
    if not isinstance(value, list | tuple) or not 0 < len(value) <= MAX_IMAGES_PER_PROMPT:
        raise ValueError(f"media must be a list of 1 to {MAX_IMAGES_PER_PROMPT} image references")
    refs = tuple(ImageRef.from_wire(v) for v in value)
    positions = [r.position for r in refs]
    if positions[0] < 0 or any(b <= a for a, b in itertools.pairwise(positions)):
        raise ValueError(f"image placeholder positions {positions[:16]} do not increase from 0")
    return refs


@dataclass(frozen=True)
class PromptTask:
    """Everything a worker needs about one generation unit; sampling params come from the job record.

    ``job`` and ``dataset`` are plain names (:data:`PLAIN_NAME`), checked when the task is built: a
    task with any other name cannot exist (``bad_job_name`` / ``bad_dataset_name``).
    """

    job: str
    dataset: str
    prompt_id: str  # unique within the job (includes the sample index when --samples > 1)
    row_index: int  # row in the source dataset file
    content_hash: str  # content_hash() of the prompt ids; workers and verify recompute it
    ids_blob: bytes  # pack_ids(prompt input_ids)
    sample_index: int = 0
    revision: int = 0  # bumped by `producer retry --max-new-tokens`; the highest revision wins
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling overrides of this revision
    #: The job record's generation the message was made for (``JobRecord.generation``; '' = not recorded, an
    #: older producer): a purge + re-submit starts another, and a worker never runs one with the other's record.
    generation: str = ""
    #: The producer's (or, for a next turn, a worker's) HMAC over the fields above (thinkfleet/signing.py); '' =
    #: unsigned: a message of a fleet without a signing key, or of an older producer (9 or 10 args).
    signature: str = ""
    #: A later turn's (or tool step's) reusable prefix: the length of the longest common prefix of its ids with the
    #: previous turn's prompt + output ids — what that turn's server has already computed (workers/turns.py). None =
    #: not a later turn, or an older worker. A statistic only (the row's ``prefix_reusable_tokens``): not signed.
    prefix_reusable: int | None = None
    #: An image prompt's images, in the order of their placeholders (thinkfleet/vision.py: sha256, store URI, size,
    #: tokens, placeholder position); () for a text prompt. Their sha256s are part of ``content_hash``, which the
    #: signature covers. The 13th argument, present only when there are images.
    media: tuple[ImageRef, ...] = ()

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("dataset", self.dataset)

    def to_args(self) -> list[Any]:
        return [
            self.job,
            self.dataset,
            self.prompt_id,
            self.row_index,
            self.content_hash,
            self.ids_blob,
            self.sample_index,
            self.revision,
            self.overrides,
            *self._optional_args(),
        ]

    def _optional_args(self) -> list[Any]:
        """generation, signature, prefix_reusable, media: each up to the last one given (older workers decode the
        shorter forms, so a message carries no more of them than it needs)."""
        tail: list[Any] = [self.generation, self.signature, self.prefix_reusable, [m.to_wire() for m in self.media]]
        given = [bool(self.generation), bool(self.signature), self.prefix_reusable is not None, bool(self.media)]
        return tail[: max((i + 1 for i, g in enumerate(given) if g), default=0)]

    @classmethod
    def from_args(cls, args: list[Any] | tuple[Any, ...]) -> PromptTask:
        """Decode a message's args; raises ValueError (or :class:`MessageRefused` for a bad name)."""
        if len(args) not in (9, 10, 11, 12, 13):
            raise ValueError(
                f"a {TASK_NAME} message has 9 args (10 with its job generation, 11 with its signature, 12 with its "
                f"reusable prefix, 13 with its images), got {len(args)}"
            )
        job, dataset, prompt_id, row_index, content_hash, ids_blob, sample_index, revision, overrides = args[:9]
        generation = args[9] if len(args) >= 10 else ""
        signature = args[10] if len(args) >= 11 else ""
        reusable = args[11] if len(args) >= 12 else None
        media = _media(args[12]) if len(args) == 13 else ()
        if reusable is not None and not (_is_int(reusable) and 0 <= reusable < 1 << 32):
            raise ValueError(f"prefix_reusable must be a token count, got {str(reusable)[:64]!r}")
        if not isinstance(generation, str) or not is_plain_name(generation or "x"):
            raise ValueError(f"generation must be a plain name, got {str(generation)[:64]!r}")
        if not isinstance(signature, str) or len(signature) > 256:
            raise ValueError(f"signature must be a short string, got {str(signature)[:64]!r}")
        if not isinstance(ids_blob, bytes | bytearray):
            raise ValueError("ids_blob must be bytes (msgpack bin); was the message JSON-serialized?")
        check_name("job", job)  # before str(): a non-string job is no name at all
        check_name("dataset", dataset)
        return cls(
            job=str(job),
            dataset=str(dataset),
            prompt_id=str(prompt_id),
            row_index=int(row_index),
            content_hash=str(content_hash),
            ids_blob=bytes(ids_blob),
            sample_index=int(sample_index),
            revision=int(revision),
            overrides=dict(overrides or {}),
            generation=generation,
            signature=signature,
            prefix_reusable=reusable,
            media=media,
        )

    @property
    def input_ids(self) -> list[int]:
        return unpack_ids(self.ids_blob)

    def verified_ids(self, limits: MessageLimits = MessageLimits()) -> list[int]:
        """The prompt ids once the message passed every check a worker makes before it claims the prompt.

        Raises :class:`MessageRefused` with the dead-letter class: ``bad_overrides``, ``bad_content_hash``
        (no :func:`content_hash` to check the ids against), ``oversize`` (more than ``limits.max_prompt_tokens``
        ids, declared or real), ``corrupt_message`` (an undecodable blob, an image placeholder past the ids),
        ``content_hash_mismatch`` (the ids, and an image prompt's image sha256s, do not hash to ``content_hash``) or
        ``invalid_ids`` (an id at or above ``limits.vocab_size``).
        """
        import numpy as np

        check_overrides(self.overrides)
        if not is_content_hash(self.content_hash):
            raise MessageRefused(
                "bad_content_hash",
                f"content_hash {self.content_hash[:64]!r} is not a content hash (16 hex digits): the ids cannot be "
                "checked, so they are not run",
            )
        try:
            data = unpack_id_bytes(self.ids_blob, limits.max_id_bytes)
        except MessageRefused:
            raise
        except Exception as exc:  # a truncated zstd frame, a partial id: resending it cannot help
            raise MessageRefused("corrupt_message", f"{type(exc).__name__}: {exc}") from exc
        actual = hash_id_bytes(data, [m.sha256 for m in self.media])
        if actual != self.content_hash:
            what = "the ids and images" if self.media else "the ids"
            raise MessageRefused(
                "content_hash_mismatch",
                f"{what} hash to {actual}, the message says {self.content_hash}: not the submitted prompt",
            )
        ids = np.frombuffer(data, dtype="<u4")
        if self.media and self.media[-1].position >= len(ids):
            raise MessageRefused(
                "corrupt_message", f"image placeholder position {self.media[-1].position} is past the {len(ids)} ids"
            )
        vocab = limits.vocab_size
        if vocab is not None and len(ids) and int(ids.max()) >= vocab:
            at = int(np.argmax(ids >= vocab))
            raise MessageRefused(
                "invalid_ids",
                f"prompt id {int(ids[at])} at position {at} of {len(ids)} is >= the vocabulary size {vocab}; not sent",
            )
        return ids.tolist()

    @property
    def task_id(self) -> str:
        """Deterministic Celery task id: Flower shows one entry per prompt, redeliveries included."""
        return f"{self.job}/{self.prompt_id}/r{self.revision}"

    @property
    def argsrepr(self) -> str:
        return f"({self.job!r}, {self.dataset!r}, {self.prompt_id!r})"
