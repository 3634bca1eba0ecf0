"""The committed view of a job: every prompt exactly once, however often it was delivered.

Parts are append-only and may hold more than one row for a prompt (a redelivered message, a worker
that died after commit but before ack, a worker *paused* past its lease whose write landed after
another worker's, ``producer retry`` at a higher revision). The rule, from storage alone: per
``prompt_id`` the highest ``revision``, then the highest ``epoch`` (the claim's fencing token,
thinkfleet/state/lua/claim.lua: a later claim always has a higher one, and Redis finalizes only the
row of the claim it holds) is the committed row. Rows of a lower epoch at that revision are *fenced*:
left out of the view, counted by ``producer verify``, removed by ``producer compact``. Only rows that
tie on (revision, epoch) are duplicates (parts older than schema 6 have no epoch: null reads as 0); the
earliest ``created_at``, then the smallest ``worker``, then the smallest part path decide among them.

How to read a job with other tools — the ``dataset`` column is also the hive directory key:

- pyarrow: ``pq.read_table(job_dir)`` or ``ds.dataset(job_dir)`` (don't declare ``partitioning="hive"``
  with a string type: the column is already in the file; see ``schema.DATASET_TYPE``).
- pandas: ``pd.read_parquet(job_dir)``.
- polars: ``pl.read_parquet(f"{job_dir}/dataset=*/*.parquet")`` (a glob, which skips ``_manifest/``).
- duckdb: ``read_parquet('{job_dir}/dataset=*/*.parquet')``.
- HF datasets: ``load_dataset("parquet", data_files=f"{job_dir}/dataset=*/*.parquet")``.

Those raw reads see every stored row — fenced rows and duplicates included; use :func:`read_committed` (or
``producer compact``, which rewrites the job as its committed view) for exactly-once.

Every read here verifies the Parquet page checksums the writer records. A part that does not decode (zero bytes,
truncated, a bad footer, a page whose CRC fails) is quarantined — moved to ``{job}/_quarantine/`` with a record
of what it held, and a loud logged error naming it (:mod:`storage.quarantine`) — and the read goes on over the
rest; ``producer verify`` fails naming it until its prompts are stored again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import layout, listing, quarantine
from storage.schema import CREATED_AT, EPOCH, PROMPT_ID, REVISION, SCHEMA, WORKER

#: Extra column :func:`read_keys` adds: the URI of the part a row came from.
PART = "part"
_KEYS = (PROMPT_ID, REVISION, EPOCH, CREATED_AT, WORKER)


def read_committed(
    output_uri: str,
    job: str,
    columns: Sequence[str] | None = None,
    datasets: Sequence[str] | None = None,
    s3_endpoint_url: str | None = None,
) -> pa.Table:
    """One row per prompt_id (the winner, see module doc), sorted by prompt_id."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    want = list(columns) if columns is not None else SCHEMA.names
    unknown = [c for c in want if c not in SCHEMA.names]
    if unknown:
        raise ValueError(f"unknown columns {unknown}; the schema has {SCHEMA.names}")
    table = _scan(loc, job, list(dict.fromkeys([*_KEYS, *want])), datasets)
    return table.take(winner_indices(table)).select(want)


def stored_prompt_ids(
    output_uri: str,
    job: str,
    datasets: Sequence[str] | None = None,
    s3_endpoint_url: str | None = None,
) -> set[str]:
    """Every prompt_id with at least one committed row (reads only that column)."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    ids = _scan(loc, job, [PROMPT_ID], datasets).column(PROMPT_ID)
    return set(pc.unique(ids).to_pylist()) if len(ids) else set()


def read_keys(
    output_uri: str,
    job: str,
    columns: Sequence[str] = (),
    datasets: Sequence[str] | None = None,
    s3_endpoint_url: str | None = None,
) -> pa.Table:
    """Every stored row (no dedupe) with the key columns, ``columns`` and the ``part`` it is in."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    return _scan(loc, job, list(dict.fromkeys([*_KEYS, *columns])), datasets)


def raw_duplicates(
    output_uri: str,
    job: str,
    datasets: Sequence[str] | None = None,
    s3_endpoint_url: str | None = None,
) -> pa.Table:
    """Rows of prompts stored more than once at their winning (highest) revision.

    Lower revisions superseded by ``producer retry`` are not duplicates. Returns the key columns
    plus ``part`` for every such row, sorted by prompt_id.
    """
    keys = read_keys(output_uri, job, datasets=datasets, s3_endpoint_url=s3_endpoint_url)
    return duplicate_rows(keys)


def duplicate_rows(keys: pa.Table) -> pa.Table:
    """From a :func:`read_keys` table: the rows of prompts with >1 row at their highest (revision, epoch)."""
    at_top, rows_at_top, group, order = _top_rows(keys)
    if order is None:
        return keys
    dups = keys.take(order.filter(pa.array(at_top & (rows_at_top[group] > 1))))
    return dups.sort_by([(PROMPT_ID, "ascending"), (PART, "ascending")])


def fenced_rows(keys: pa.Table) -> pa.Table:
    """From a :func:`read_keys` table: rows at their prompt's highest revision but a lower epoch than the
    committed row's — a stale claim's write that landed (a worker paused past its lease, a lost finalize)."""
    at_top, _, _, order = _top_rows(keys)
    if order is None:
        return keys
    revisions = keys[REVISION].take(order).to_numpy()
    head = _run_heads(keys[PROMPT_ID].take(order))
    group = np.cumsum(head) - 1
    top_revision = revisions == revisions[head][group]
    fenced = keys.take(order.filter(pa.array(top_revision & ~at_top)))
    return fenced.sort_by([(PROMPT_ID, "ascending"), (PART, "ascending")])


def epochs(keys: pa.Table) -> np.ndarray:
    """The ``epoch`` column as int64, null (parts before schema 6) as 0."""
    return pc.fill_null(keys[EPOCH], 0).to_numpy().astype(np.int64) if keys.num_rows else np.zeros(0, np.int64)


def _top_rows(keys: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, pa.Array | None]:
    """Rows sorted by prompt, revision desc, epoch desc: (at the top (revision, epoch) of their prompt, rows at
    the top per group, group index, the sort order) — order None for an empty table."""
    if keys.num_rows == 0:
        empty = np.zeros(0, dtype=bool)
        return empty, np.zeros(0, np.int64), np.zeros(0, np.int64), None
    keyed = keys.append_column("_epoch", pa.array(epochs(keys)))
    order = pc.sort_indices(keyed, [(PROMPT_ID, "ascending"), (REVISION, "descending"), ("_epoch", "descending")])
    head = _run_heads(keys[PROMPT_ID].take(order))
    group = np.cumsum(head) - 1
    revisions = keys[REVISION].take(order).to_numpy()
    eps = epochs(keys)[order.to_numpy()]
    # The first row of a group has its top revision and epoch.
    at_top = (revisions == revisions[head][group]) & (eps == eps[head][group])
    rows_at_top = np.bincount(group[at_top], minlength=int(group[-1]) + 1)
    return at_top, rows_at_top, group, order


def winner_indices(table: pa.Table) -> pa.Array:
    """Indices of the winning row per prompt_id, in prompt_id order (needs the key columns + part)."""
    if table.num_rows == 0:
        return pa.array([], pa.uint64())
    keyed = table.append_column("_epoch", pa.array(epochs(table)))
    return first_per_key(
        keyed,
        [
            (PROMPT_ID, "ascending"),
            (REVISION, "descending"),
            ("_epoch", "descending"),
            (CREATED_AT, "ascending"),
            (WORKER, "ascending"),
            (PART, "ascending"),
        ],
    )


def first_per_key(table: pa.Table, sort_keys: list[tuple[str, str]]) -> pa.Array:
    """Sort by ``sort_keys`` and keep the first row of each run of equal ``sort_keys[0]`` values."""
    if table.num_rows == 0:
        return pa.array([], pa.uint64())
    order = pc.sort_indices(table, sort_keys=sort_keys)
    return order.filter(pa.array(_run_heads(table[sort_keys[0][0]].take(order))))


def _run_heads(sorted_keys: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """True where a sorted column starts a new run of equal values."""
    keys = sorted_keys.combine_chunks() if isinstance(sorted_keys, pa.ChunkedArray) else sorted_keys
    head = np.ones(len(keys), dtype=bool)
    head[1:] = pc.not_equal(keys[1:], keys[:-1]).to_numpy(zero_copy_only=False)
    return head


#: Times a read lists the parts again when one vanished under it (a compaction replaced it since the listing).
_RELISTS = 3
#: Parts decoded at once when a read falls back to checking them one by one.
_CAREFUL_THREADS = 4


def _scan(loc: layout.Location, job: str, columns: list[str], datasets: Sequence[str] | None) -> pa.Table:
    for attempt in range(_RELISTS):
        parts = listing.list_parts(loc, job, list(datasets) if datasets is not None else None)
        try:
            return scan_parts(loc, [p.path for p in parts], columns)
        except quarantine.PartVanished:
            if attempt == _RELISTS - 1:
                raise
    raise AssertionError("unreachable")


def scan_parts(
    loc: layout.Location,
    paths: list[str],
    columns: list[str],
    *,
    damaged: list[str] | None = None,
    check_all: bool = False,
) -> pa.Table:
    """Read ``columns`` of exactly these part files, adding the ``part`` URI of each row.

    Page checksums are verified (``check_all``: of every column, as :func:`check_parts` does, while only
    ``columns`` are kept). A damaged part is quarantined (:mod:`storage.quarantine`) and left out: its path is
    appended to ``damaged`` when given. I/O errors raise; a part gone since it was listed raises
    :class:`storage.quarantine.PartVanished`."""
    schema = pa.schema([*(SCHEMA.field(c) for c in columns), pa.field(PART, pa.string(), nullable=False)])
    read = columns if not check_all else list(dict.fromkeys([*columns, *SCHEMA.names]))
    parts = _read_parts(loc, paths, read, damaged, hold=columns)
    batches = [_tagged(loc, path, b, schema) for path, part in parts for b in part]
    return pa.Table.from_batches(batches, schema=schema)


def check_parts(
    output_uri: str,
    job: str,
    datasets: Sequence[str] | None = None,
    s3_endpoint_url: str | None = None,
) -> list[str]:
    """Decode every column of every committed part of ``job`` (page checksums verified), keeping nothing in
    memory; returns the URIs of the parts found damaged now (each quarantined)."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    for attempt in range(_RELISTS):
        damaged: list[str] = []
        parts = listing.list_parts(loc, job, list(datasets) if datasets is not None else None)
        try:
            _read_parts(loc, [p.path for p in parts], SCHEMA.names, damaged, keep=False)
        except quarantine.PartVanished:
            if attempt == _RELISTS - 1:
                raise
            continue
        return [loc.uri(p) for p in damaged]
    raise AssertionError("unreachable")


def _tagged(loc: layout.Location, path: str, batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    part = pa.array([loc.uri(path)] * batch.num_rows, pa.string())
    return pa.RecordBatch.from_arrays([*batch.columns, part], schema=schema)


#: Parts one scan covers. A scan holds the decoded footer of every part it covers until it ends (~100 kB for a
#: part of this schema): over 10k parts at once that alone is a GB.
_SCAN_PARTS = 256


def _read_parts(
    loc: layout.Location,
    paths: list[str],
    columns: Sequence[str],
    damaged: list[str] | None,
    *,
    keep: bool = True,
    hold: Sequence[str] | None = None,
) -> list[tuple[str, list[pa.RecordBatch]]]:
    """:func:`_read_some` over ``paths``, :data:`_SCAN_PARTS` of them at a time."""
    out: list[tuple[str, list[pa.RecordBatch]]] = []
    for start in range(0, len(paths), _SCAN_PARTS):
        out.extend(_read_some(loc, paths[start : start + _SCAN_PARTS], columns, damaged, keep=keep, hold=hold))
        release_freed_memory()
    return out


def _libc_malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system. A scan's footers, page buffers and thread-local scratch are C++
    allocations of glibc's malloc (not Arrow's pool), freed across the scan threads' arenas, which glibc keeps
    mapped: over thousands of parts that is hundreds of MB of RSS holding nothing (bench/bench_scale_storage.py).
    ``malloc_trim`` costs a walk of the free lists — milliseconds, once per scan of :data:`_SCAN_PARTS` parts."""
    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def checked_scan() -> Any:
    """A dataset scan's options that verify every page's CRC (pages written without one — parts before schema 6 —
    are read unchecked)."""
    import pyarrow.dataset as ds

    return ds.ParquetFragmentScanOptions(page_checksum_verification=True)


def _read_some(
    loc: layout.Location,
    paths: list[str],
    columns: Sequence[str],
    damaged: list[str] | None,
    *,
    keep: bool = True,
    hold: Sequence[str] | None = None,
) -> list[tuple[str, list[pa.RecordBatch]]]:
    """The batches of every part in ``paths`` that is not damaged, page checksums verified (``keep=False``: only
    check, keep nothing); damaged parts are quarantined, left out and appended to ``damaged``.

    One parallel scan over all parts first (the common case: nothing is damaged). If it fails — a damaged part
    (ArrowInvalid, a CRC error) or an I/O error: the scan cannot say which, nor whose — or a part's footer names
    columns no part has (a flipped bit in a column name reads as a null column), or a row's ``ids_crc32`` is not
    its decoded ids' (a flipped bit in a page header: the page CRC covers only the page body), the parts are read
    again one by one, each whole into memory first, so that only their bytes decide: damaged ones are
    quarantined, I/O errors raise."""
    if not paths:
        return []
    import pyarrow.dataset as ds  # here, not at the top: it imports pandas (~0.8 CPU-s) in every importer

    held: dict[str, list[pa.RecordBatch]] = {}
    suspects: set[str] = set()
    try:
        dataset = ds.dataset(paths, schema=SCHEMA, format="parquet", filesystem=loc.fs)
        checked: set[str] = set()
        # scan_batches tags each batch with its file and still reads files in parallel.
        scanner = dataset.scanner(columns=quarantine.with_crc(columns), fragment_scan_options=checked_scan())
        for tagged in scanner.scan_batches():
            path, batch = tagged.fragment.path, tagged.record_batch
            if path not in checked:
                checked.add(path)
                if quarantine.schema_problem(tagged.fragment.physical_schema):
                    suspects.add(path)
            if path in suspects or quarantine.null_problem(batch) or quarantine.crc_problem(batch):
                suspects.add(path)
                held.pop(path, None)
            elif keep:
                held.setdefault(path, []).append(batch.select(list(hold or columns)))
    except Exception:  # which part, and whether damage or I/O: the careful read below tells
        held, suspects = {}, set(paths)
    careful = [p for p in paths if p in suspects]
    found: dict[str, list[pa.RecordBatch]] = {}
    if careful:
        with ThreadPoolExecutor(max_workers=min(_CAREFUL_THREADS, len(careful))) as pool:
            tables = pool.map(lambda p: quarantine.read_checked(loc, p, columns), careful)
            for path, table in zip(careful, tables, strict=True):
                if table is None:
                    if damaged is not None:
                        damaged.append(path)
                elif keep:
                    found[path] = table.select(list(hold or columns)).to_batches()
    return [(p, held.get(p) or found.get(p) or []) for p in paths if p not in suspects or p in found]
