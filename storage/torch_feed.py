"""Train while the fleet generates, in-process: a PyTorch ``IterableDataset`` over a job's feed (:mod:`storage.feed`).

``FeedDataset(settings, job)`` yields SpecForge-shaped samples — ``input_ids``, ``loss_mask`` and
``attention_mask``, each a ``LongTensor`` of shape ``[1, L]``, what SpecForge's ``DataCollatorWithPadding`` pads
into a batch — straight from the rows as they commit: the records ``producer export --format specforge`` writes
(prompt + output ids exactly as stored, mask 1 over the output; the same filters), in log order. It ends when the
job is finished and the feed drained, or after ``until_idle_s`` with nothing new.

A later revision of a prompt (``producer retry --truncated``) is yielded as a new sample: a stream cannot take back
what was trained. ``drop_truncated=True`` keeps the cut rows such a retry would replace out of training. To resume
exactly, save :meth:`state_dict` with the trainer's checkpoint and :meth:`load_state_dict` it into a new dataset;
``reader`` registers the dataset with the feed so the job's log is kept until it has read it (a single process:
with DataLoader workers, each takes the prompts whose id hashes to it and no reader is committed).

torch is imported only when ``FeedDataset`` is first used: ``pip install 'thinkfleet[torch]'``. The samples without
torch, as lists: :func:`feed_samples`.
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from storage.exports.base import COLUMNS, ExportOptions
from storage.exports.specforge import SpecForge
from storage.exports.tokens import eagle3_table
from storage.follow import POLL_S, ShardRows, last_per_prompt
from storage.schema import SCHEMA
from thinkfleet.settings import Settings

TORCH_EXTRA = "pip install 'thinkfleet[torch]' (torch>=2.1)"


def feed_samples(
    settings: Settings,
    job: str,
    cursor: Any = None,
    *,
    reader: str | None = None,
    drop_truncated: bool = False,
    drop_flags: Sequence[str] = (),
    exclude_reasoning: bool = False,
    until_idle_s: float | None = None,
    poll_s: float = POLL_S,
    share: tuple[int, int] = (0, 1),
) -> Iterator[tuple[list[dict[str, Any]], Any]]:
    """(records, the cursor after them) per feed batch: ``{"id", "input_ids", "loss_mask"}`` as the specforge
    export writes them. ``share`` = (i, n): only the prompts whose id hashes to i of n (DataLoader workers)."""
    from storage import feed

    options = ExportOptions(drop_truncated=drop_truncated, drop_flags=tuple(drop_flags),
                            exclude_reasoning=exclude_reasoning)  # fmt: skip
    fmt = SpecForge(options)
    last_new, finished_seen = time.monotonic(), False
    for batch in feed.follow(settings, job, cursor, reader=reader, max_rows=256, block_s=poll_s):
        now = time.monotonic()
        if batch is None:
            if finished_seen:
                return
            finished_seen = feed.finished(settings, job)
            if until_idle_s is not None and now - last_new >= until_idle_s:
                return
            continue
        if not batch.events:  # (the end of a rebuild that found nothing new: the cursor moves on)
            yield [], batch.cursor
            continue
        last_new, finished_seen = now, False
        table = last_per_prompt(batch.table.select(SCHEMA.names))
        if share[1] > 1:
            mine = [zlib.crc32(pid.encode()) % share[1] == share[0] for pid in table["prompt_id"].to_pylist()]
            table = table.filter(pa.array(mine))
        skipped: dict[str, int] = {}
        rows = ShardRows(settings, job, table, options, skipped)
        records: list[dict[str, Any]] = []
        for _, tables in rows.dataset_tables([*COLUMNS, *SpecForge.row_columns]):
            for t in tables:
                recs = fmt.keep(eagle3_table(fmt.keep_rows(t, skipped), exclude_reasoning), skipped)
                records += recs.select(list(SpecForge.jsonl_fields)).to_pylist()
        yield records, batch.cursor


@functools.cache
def _dataset_class() -> type:
    try:
        import torch
        from torch.utils.data import IterableDataset, get_worker_info
    except ImportError as exc:
        raise ImportError(f"storage.torch_feed.FeedDataset needs torch: {TORCH_EXTRA}") from exc

    class FeedDataset(IterableDataset):  # type: ignore[misc,type-arg]
        """SpecForge-shaped samples of ``job``'s committed rows as they commit (see the module's docstring)."""

        def __init__(
            self,
            settings: Settings,
            job: str,
            *,
            reader: str | None = None,
            max_length: int | None = None,
            drop_truncated: bool = False,
            drop_flags: Sequence[str] = (),
            exclude_reasoning: bool = False,
            until_idle_s: float | None = None,
            poll_s: float = POLL_S,
        ) -> None:
            self.settings, self.job, self.reader, self.max_length = settings, job, reader, max_length
            self.filters = {"drop_truncated": drop_truncated, "drop_flags": tuple(drop_flags),
                            "exclude_reasoning": exclude_reasoning}  # fmt: skip
            self.until_idle_s, self.poll_s = until_idle_s, poll_s
            self.cursor: Any = None  # after the last batch every sample of which was yielded

        def state_dict(self) -> dict[str, Any]:
            return {"job": self.job, "cursor": json.loads(self.cursor.to_json()) if self.cursor else None}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            from storage import feed

            cursor = state.get("cursor")
            self.cursor = feed.Cursor.from_json(json.dumps(cursor)) if cursor else None

        def __iter__(self) -> Iterator[dict[str, Any]]:
            from storage import feed

            info = get_worker_info()
            share = (info.id, info.num_workers) if info is not None else (0, 1)
            reader = self.reader if share[1] == 1 else None
            batches = feed_samples(
                self.settings, self.job, self.cursor, reader=reader, until_idle_s=self.until_idle_s,
                poll_s=self.poll_s, share=share, **self.filters,  # type: ignore[arg-type]
            )  # fmt: skip
            for records, cursor in batches:
                for record in records:
                    yield self.sample(record)
                # Every sample of the batch was taken: resume after it (and let the log go behind it).
                self.cursor = cursor
                if reader:
                    feed.commit(self.settings, self.job, reader, cursor)

        def sample(self, record: dict[str, Any]) -> dict[str, Any]:
            """SpecForge's online sample: ``[1, L]`` long tensors (cut at ``max_length``, as its loader cuts)."""
            end = self.max_length or len(record["input_ids"])
            ids = torch.tensor(record["input_ids"][:end], dtype=torch.long)[None, :]
            mask = torch.tensor(record["loss_mask"][:end], dtype=torch.long)[None, :]
            return {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids)}

    return FeedDataset


def __getattr__(name: str) -> Any:
    if name == "FeedDataset":  # built on first use, so importing this module needs no torch
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
