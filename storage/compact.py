"""``producer compact JOB``: many small parts → few large files per dataset, same committed view.

Workers commit one part per group commit, which at real generation rates is a handful of rows, so a
job ends as tens of thousands of tiny files. Compaction rewrites each dataset as its committed view
(one row per prompt, the winner; rows byte-for-byte as stored) and then removes the old parts — with them
the fenced rows (a stale claim's writes: lower epoch than the committed row) and duplicates.

A damaged part (one that does not decode, or whose page checksums fail) is quarantined by the read
(storage/quarantine.py), not rewritten and not listed as replaced: its rows are not in the compacted
file, and ``producer verify`` names it and its prompts until they are stored again.

Safe if interrupted at any point:
1. the new files are committed atomically, the last one carrying the list of parts it replaces
   (Parquet metadata ``thinkfleet.compacted_from``) — from then on every reader ignores those
   parts, and ``PartWriter.exists`` still answers True for them;
2. only then are the old parts deleted. A rerun finishes deletions left over, and an interrupted
   rerun before step 1 leaves at worst extra copies that the committed view already dedupes.

Parts committed while compaction runs are not in its snapshot and are left alone, so compaction may run per dataset
(``--dataset``) while the job still runs.

Memory is bounded by the ``storage_memory_mb`` setting whatever the dataset's size (:mod:`storage.stream`: the keys
first, then the winners' rows by batch, spilled to local temporary files by rank range when the dataset is larger),
and each compacted file is written row group by row group (:meth:`PartWriter.write_stream`). Files are cut at
``max_rows_per_file`` rows or ``max_bytes_per_file`` (estimated decoded size; on disk they are ~2-3x smaller).

Only paths of the job are read or deleted (storage.layout.confine_part): a part in the dataset directory that
resolves outside the job (a symlink) is left alone and named in ``refused``, and a compacted part's list of what it
replaces names bare part files of its own directory only — a name like ``../../x`` is ignored, never deleted.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from storage import layout, listing, quarantine, reader, stream
from storage.schema import PROMPT_ID, ROW_INDEX, SAMPLE_INDEX, SCHEMA, TURN_INDEX
from storage.writer import PartWriter
from thinkfleet.settings import Settings

log = logging.getLogger(__name__)

#: Rows per compacted file; a dataset of 11k Kimi outputs is ~70 MB at this row size.
DEFAULT_MAX_ROWS_PER_FILE = 200_000
#: Estimated decoded bytes per compacted file (~0.5-1 GB on disk at real row sizes): large objects, few of them.
DEFAULT_MAX_BYTES_PER_FILE = 2 << 30


@dataclass
class DatasetCompaction:
    dataset: str
    parts_before: int
    rows_before: int
    rows_after: int
    files_written: list[str] = field(default_factory=list)
    parts_removed: int = 0
    fenced_rows: int = 0  # rows of a stale claim (lower epoch than the committed row's) left out
    quarantined: list[str] = field(default_factory=list)  # damaged parts moved aside by this run's read
    refused: list[str] = field(default_factory=list)  # paths that resolve outside the job: not read, not deleted
    skipped: str | None = None  # why nothing was rewritten


@dataclass
class CompactResult:
    job: str
    datasets: list[DatasetCompaction] = field(default_factory=list)


def compact_job(
    settings: Settings,
    job: str,
    *,
    datasets: Sequence[str] | None = None,
    max_rows_per_file: int = DEFAULT_MAX_ROWS_PER_FILE,
    max_bytes_per_file: int = DEFAULT_MAX_BYTES_PER_FILE,
) -> CompactResult:
    """Compact every dataset of ``job`` (or the named ones)."""
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    writer = PartWriter(settings.output_uri, layout.COMPACT_TAG, settings.s3_endpoint_url)
    result = CompactResult(job=job)
    memory = stream.memory_bytes_of(settings)
    for name in datasets or listing.dataset_names(loc, job):
        result.datasets.append(_compact_dataset(loc, writer, job, name, max_rows_per_file, max_bytes_per_file, memory))
    return result


def _compact_dataset(
    loc: layout.Location, writer: PartWriter, job: str, dataset: str, max_rows: int, max_bytes: int, memory: int
) -> DatasetCompaction:
    for attempt in range(stream.REPLANS):
        try:
            return _compact_snapshot(loc, writer, job, dataset, max_rows, max_bytes, memory)
        except (stream.PlanStale, quarantine.PartVanished):  # a part changed under the read: list them again
            if attempt == stream.REPLANS - 1:
                raise
    raise AssertionError("unreachable")


def _compact_snapshot(
    loc: layout.Location, writer: PartWriter, job: str, dataset: str, max_rows: int, max_bytes: int, memory: int
) -> DatasetCompaction:
    parts = listing.list_parts(loc, job, [dataset], include_superseded=True)
    refused = [p.path for p in parts if not _inside(loc, job, dataset, p.path)]
    parts = [p for p in parts if p.path not in refused]
    # Finish an earlier run that committed its files but died before deleting what they replace.
    leftovers = {p for p in listing.superseded(loc, parts) if _inside(loc, job, dataset, p)}
    for path in sorted(leftovers):
        _delete(loc, path)
    parts = [p for p in parts if p.path not in leftovers]
    paths = [p.path for p in parts]

    plan = stream.plan_parts(loc, parts, _ORDER_COLUMNS, columns=SCHEMA.names, memory_bytes=memory)
    report = DatasetCompaction(dataset, len(paths), plan.keys.num_rows, 0, parts_removed=len(leftovers))
    report.refused = [loc.uri(p) for p in refused]
    # A part the read left out and that is gone from the directory was quarantined (damaged), or removed by another
    # compaction: either way not listed as replaced, not deleted.
    unread = [p for p, n in zip(paths, plan.part_rows.tolist(), strict=True) if n == 0]
    gone = {p for p, i in zip(unread, loc.fs.get_file_info(unread), strict=True) if i.type == pafs.FileType.NotFound}
    moved = loc.fs.get_file_info([quarantine.quarantine_path(loc, p) for p in sorted(gone)])
    report.quarantined = [loc.uri(p) for p, i in zip(sorted(gone), moved, strict=True) if i.type == pafs.FileType.File]
    parts = [p for p in parts if p.path not in gone]
    paths = [p for p in paths if p not in gone]
    if len(paths) == 1 and layout.is_compacted_name(parts[0].base_name):
        report.rows_after = plan.keys.num_rows
        report.skipped = "already one compacted file"
        return report
    if not paths:
        report.skipped = "no readable parts" if report.quarantined else "no parts"
        return report

    report.fenced_rows = reader.fenced_rows(plan.tagged()).num_rows
    report.rows_after = plan.winners.num_rows
    # Source order (row index, then sample, then a conversation's turns) reads naturally; prompt_id makes it total.
    sizes = stream.row_bytes(plan, plan.winners, SCHEMA.names)[_source_order(plan.winners)]
    files = _file_ranges(sizes, max_rows, max_bytes)
    # batches of what the plan left of the setting (stream.room), as committed_batches' callers ask
    pending = _Rows(stream.ordered(plan, SCHEMA.names, max(1, plan.memory_bytes // 16), _source_order))
    replaced = json.dumps(sorted(posixpath.basename(p) for p in paths)).encode()
    for seq, (lo, hi) in enumerate(files):
        path = layout.compacted_part_path(loc, job, dataset, seq)
        # Only the last file declares what it replaces: until it exists, the old parts stay live.
        last = seq == len(files) - 1
        metadata = {layout.COMPACTED_FROM_KEY: replaced} if last else None
        report.files_written.append(
            writer.write_stream(job, dataset, pending.take(hi - lo), loc.uri(path), metadata=metadata)
        )
    for path in paths:
        _delete(loc, path)
    report.parts_removed += len(paths)
    return report


_ORDER_COLUMNS = [ROW_INDEX, SAMPLE_INDEX, TURN_INDEX]


def _source_order(winners: pa.Table) -> np.ndarray:
    order = [(c, "ascending") for c in (*_ORDER_COLUMNS, PROMPT_ID)]
    return pc.sort_indices(winners, order).to_numpy()


def _file_ranges(sizes: np.ndarray, max_rows: int, max_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of the compacted files: at most ``max_rows`` rows, and ``max_bytes`` (estimated) unless one row
    is larger."""
    out: list[tuple[int, int]] = []
    total = np.concatenate([[0], np.cumsum(sizes)])
    lo, n = 0, len(sizes)
    while lo < n:
        hi = int(np.searchsorted(total, total[lo] + max_bytes, side="right")) - 1
        hi = min(max(hi, lo + 1), lo + max_rows, n)
        out.append((lo, hi))
        lo = hi
    return out


class _Rows:
    """The ordered batches, handed out ``n`` rows at a time (a file's share), cutting batches where needed."""

    def __init__(self, batches: Iterator[pa.Table]) -> None:
        self.batches = batches
        self.rest: pa.Table | None = None

    def take(self, n: int) -> Iterator[pa.Table]:
        while n > 0:
            if self.rest is None or self.rest.num_rows == 0:
                self.rest = next(self.batches)
            head = self.rest.slice(0, n)
            self.rest = self.rest.slice(head.num_rows)
            n -= head.num_rows
            yield head


def _inside(loc: layout.Location, job: str, dataset: str, path: str) -> bool:
    try:
        layout.confine_part(loc, job, loc.uri(path), dataset)
    except layout.PartPathRefused as exc:
        log.error("compact %s/%s: %s: left alone", job, dataset, exc)
        return False
    return True


def _delete(loc: layout.Location, path: str) -> None:
    try:
        loc.fs.delete_file(path)
    except FileNotFoundError:
        pass  # another compaction got there first
