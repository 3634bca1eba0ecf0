"""The task message a prompt travels in: producer → Redis → worker.

One Celery task per prompt (``TASK_NAME``), serialized with msgpack so the token ids ride as raw bytes
(little-endian uint32, zstd-compressed) instead of a JSON integer list. Flower shows ``argsrepr`` —
job, dataset and prompt id — never the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

TASK_NAME = "thinkfleet.generate"

#: Magic byte of the packed ids: 0x01 = zstd(uint32 LE), 0x00 = raw uint32 LE.
_ZSTD = 0x01
_RAW = 0x00
_compressor = zstandard.ZstdCompressor(level=3)
_decompressor = zstandard.ZstdDecompressor()


def pack_ids(ids: list[int] | np.ndarray, compress: bool = True) -> bytes:
    """Token ids → compact bytes (the inverse of :func:`unpack_ids`)."""
    raw = np.asarray(ids, dtype="<u4").tobytes()
    if compress:
        return bytes([_ZSTD]) + _compressor.compress(raw)
    return bytes([_RAW]) + raw


def unpack_ids(blob: bytes) -> list[int]:
    """Bytes from :func:`pack_ids` → token ids. Raises ValueError on anything else."""
    if not blob:
        raise ValueError("empty token blob")
    kind, body = blob[0], blob[1:]
    if kind == _ZSTD:
        body = _decompressor.decompress(body)
    elif kind != _RAW:
        raise ValueError(f"unknown token blob kind {kind:#x}")
    if len(body) % 4:
        raise ValueError(f"token blob of {len(body)} bytes is not a whole number of uint32")
    return np.frombuffer(body, dtype="<u4").tolist()


@dataclass(frozen=True)
class PromptTask:
    """Everything a worker needs about one generation unit; sampling params come from the job record."""

    job: str
    dataset: str
    prompt_id: str  # unique within the job (includes the sample index when --samples > 1)
    row_index: int  # row in the source dataset file
    content_hash: str  # hash of the rendered prompt ids; a changed re-submit is detected with it
    ids_blob: bytes  # pack_ids(prompt input_ids)
    sample_index: int = 0
    revision: int = 0  # bumped by `producer retry --max-new-tokens`; the highest revision wins
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling overrides of this revision

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
        ]

    @classmethod
    def from_args(cls, args: list[Any] | tuple[Any, ...]) -> PromptTask:
        if len(args) != 9:
            raise ValueError(f"a {TASK_NAME} message has 9 args, got {len(args)}")
        job, dataset, prompt_id, row_index, content_hash, ids_blob, sample_index, revision, overrides = args
        if not isinstance(ids_blob, bytes | bytearray):
            raise ValueError("ids_blob must be bytes (msgpack bin); was the message JSON-serialized?")
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
        )

    @property
    def input_ids(self) -> list[int]:
        return unpack_ids(self.ids_blob)

    @property
    def task_id(self) -> str:
        """Deterministic Celery task id: Flower shows one entry per prompt, redeliveries included."""
        return f"{self.job}/{self.prompt_id}/r{self.revision}"

    @property
    def argsrepr(self) -> str:
        return f"({self.job!r}, {self.dataset!r}, {self.prompt_id!r})"
