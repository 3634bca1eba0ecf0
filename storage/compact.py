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

Parts committed while compaction runs are not in its snapshot and are left alone.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow.compute as pc
import pyarrow.fs as pafs

from storage import layout, quarantine, reader
from storage.schema import PROMPT_ID, ROW_INDEX, SAMPLE_INDEX, SCHEMA, TURN_INDEX
from storage.writer import PartWriter
from thinkfleet.settings import Settings

#: Rows per compacted file; a dataset of 11k Kimi outputs is ~70 MB at this row size.
DEFAULT_MAX_ROWS_PER_FILE = 200_000


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
) -> CompactResult:
    """Compact every dataset of ``job`` (or the named ones)."""
    loc = layout.locate(settings.output_uri, settings.s3_endpoint_url)
    writer = PartWriter(settings.output_uri, layout.COMPACT_TAG, settings.s3_endpoint_url)
    result = CompactResult(job=job)
    for name in datasets or layout.dataset_names(loc, job):
        result.datasets.append(_compact_dataset(loc, writer, job, name, max_rows_per_file))
    return result


def _compact_dataset(
    loc: layout.Location, writer: PartWriter, job: str, dataset: str, max_rows: int
) -> DatasetCompaction:
    parts = layout.list_parts(loc, job, [dataset], include_superseded=True)
    # Finish an earlier run that committed its files but died before deleting what they replace.
    leftovers = layout.superseded(loc, parts)
    for path in sorted(leftovers):
        _delete(loc, path)
    parts = [p for p in parts if p.path not in leftovers]
    paths = [p.path for p in parts]

    table = reader.scan_parts(loc, paths, SCHEMA.names)
    report = DatasetCompaction(dataset, len(paths), table.num_rows, 0, parts_removed=len(leftovers))
    # A part the read left out and that is gone from the directory was quarantined (damaged), or removed by another
    # compaction: either way not listed as replaced, not deleted.
    read = set(pc.unique(table[reader.PART]).to_pylist()) if table.num_rows else set()
    unread = [p for p in paths if loc.uri(p) not in read]
    gone = {p for p, i in zip(unread, loc.fs.get_file_info(unread), strict=True) if i.type == pafs.FileType.NotFound}
    moved = loc.fs.get_file_info([quarantine.quarantine_path(loc, p) for p in sorted(gone)])
    report.quarantined = [loc.uri(p) for p, i in zip(sorted(gone), moved, strict=True) if i.type == pafs.FileType.File]
    parts = [p for p in parts if p.path not in gone]
    paths = [p for p in paths if p not in gone]
    if len(paths) == 1 and layout.is_compacted_name(parts[0].base_name):
        report.rows_after = table.num_rows
        report.skipped = "already one compacted file"
        return report
    if not paths:
        report.skipped = "no readable parts" if report.quarantined else "no parts"
        return report

    report.fenced_rows = reader.fenced_rows(table).num_rows
    committed = table.take(reader.winner_indices(table)).select(SCHEMA.names)
    # Source order (row index, then sample, then a conversation's turns) reads naturally; prompt_id makes it total.
    order = [(c, "ascending") for c in (ROW_INDEX, SAMPLE_INDEX, TURN_INDEX, PROMPT_ID)]
    committed = committed.take(pc.sort_indices(committed, order))
    report.rows_after = committed.num_rows
    chunks = [committed.slice(i, max_rows) for i in range(0, committed.num_rows, max_rows)]
    replaced = json.dumps(sorted(posixpath.basename(p) for p in paths)).encode()
    for seq, chunk in enumerate(chunks):
        path = layout.compacted_part_path(loc, job, dataset, seq)
        # Only the last file declares what it replaces: until it exists, the old parts stay live.
        last = seq == len(chunks) - 1
        metadata = {layout.COMPACTED_FROM_KEY: replaced} if last else None
        report.files_written.append(writer.write(job, dataset, chunk, loc.uri(path), metadata=metadata))
    for path in paths:
        _delete(loc, path)
    report.parts_removed += len(paths)
    return report


def _delete(loc: layout.Location, path: str) -> None:
    try:
        loc.fs.delete_file(path)
    except FileNotFoundError:
        pass  # another compaction got there first
