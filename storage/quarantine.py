"""Damaged parts: found on read, moved aside, named — and the rest of the job read on.

A part is *damaged* when its bytes do not decode as the Parquet file PartWriter wrote: zero bytes, truncated, a
bad footer, a page whose CRC does not match (``schema.WRITE_OPTIONS`` writes page checksums, every read here
verifies them), a column name in the footer that is no column of the schema (a flipped bit there would make the
column read as null), or nulls in a required column. Every reader of parts — :func:`storage.reader.scan_parts`
(so ``read_committed``, ``read_keys``, ``stored_prompt_ids``, compact, export, report, submit, retry, verify),
``PartWriter.exists``/``final_counts`` and :func:`storage.listing.superseded` — that meets one *quarantines* it
and goes on over the rest::

    {OUTPUT_URI}/{job}/_quarantine/dataset={name}/part-….parquet        the damaged file, as found
    {OUTPUT_URI}/{job}/_quarantine/dataset={name}/part-….parquet.json   the record: where it was, why, its rows

with a loud logged error naming it. ``_quarantine`` starts with ``_``, so neither this project's readers nor
``pq.read_table(job_dir)``/``ds.dataset(job_dir)`` nor the documented ``dataset=*/*.parquet`` globs see it. The
record keeps the prompt ids the part held when its ``prompt_id`` column still decodes, so ``producer verify``
names them; ``producer retry --missing`` regenerates them (re-sending the rows' prompts when those still decode
here: :func:`salvage`), and a re-submit of the same inputs regenerates the rest.

Only the bytes decide: a part is judged after it was read whole into memory, so an I/O error (S3 unreachable,
permission denied) is raised as it is, never taken for damage, and a part that vanished since it was listed (a
compaction removed it) raises :class:`PartVanished`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout
from storage.schema import IDS_CRC32, INPUT_IDS, OUTPUT_IDS, PROMPT_ID, SCHEMA, SCHEMA_VERSION, table_ids_checksums

log = logging.getLogger(__name__)

QUARANTINE_DIR = "_quarantine"
#: Suffix of the record written next to a quarantined part.
RECORD_SUFFIX = ".json"
_NAMES = frozenset(SCHEMA.names)
_REQUIRED = tuple(f.name for f in SCHEMA if not f.nullable)
_VERSION_KEY = b"thinkfleet.schema_version"
#: The columns :func:`crc_problem` compares.
CRC_COLUMNS = (INPUT_IDS, OUTPUT_IDS, IDS_CRC32)


#: Every record :func:`quarantine` made in this process, by part URI (also those it could not write or move).
_FOUND: dict[str, dict[str, Any]] = {}
_FOUND_LOCK = threading.Lock()


def found_here(part: str) -> dict[str, Any] | None:
    """The record this process made when it found ``part`` (a URI) damaged, or None."""
    with _FOUND_LOCK:
        record = _FOUND.get(part)
    return dict(record) if record is not None else None


class PartVanished(FileNotFoundError):
    """A listed part is gone (a compaction replaced it since): list again."""


class Damaged(Exception):
    """The bytes of a part do not decode as a part (the message says how)."""


# -- judging a part -------------------------------------------------------------------------------------------
def schema_problem(physical: pa.Schema) -> str | None:
    """Why a part's own schema (its footer) is not one PartWriter writes, or None.

    Every column name must be one of :data:`SCHEMA`'s (columns were added over the versions, never removed or
    renamed), and a part declaring this version must have every column."""
    names = physical.names
    unknown = [n for n in names if n not in _NAMES]
    if unknown:
        return f"column names that are no column of the schema: {unknown} (a damaged footer?)"
    if len(names) < len(_NAMES) and (physical.metadata or {}).get(_VERSION_KEY) == SCHEMA_VERSION.encode():
        present = set(names)
        absent = [n for n in SCHEMA.names if n not in present]
        return f"schema {SCHEMA_VERSION} part without columns {absent} (a damaged footer?)"
    return None


def null_problem(batch: pa.RecordBatch | pa.Table) -> str | None:
    """Why decoded rows cannot be a part's (nulls in a required column), or None."""
    names = set(batch.schema.names)
    bad = [c for c in _REQUIRED if c in names and batch.column(c).null_count]
    return f"nulls in required columns {bad}" if bad else None


def crc_problem(batch: pa.RecordBatch | pa.Table) -> str | None:
    """Why decoded rows are not what was written — a row's ``ids_crc32`` is not the CRC-32 of its ids (a flipped
    bit in a page *header*, which the page CRC does not cover, can drop ids from a list) — or None. Rows without
    one (before schema 6) and tables without the three columns are not checked."""
    names = batch.schema.names
    if not all(c in names for c in CRC_COLUMNS) or batch.num_rows == 0:
        return None
    stored = batch.column(IDS_CRC32)
    valid = stored.is_valid().to_numpy(zero_copy_only=False)
    if not valid.any():
        return None
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    differ = valid & (stored.fill_null(0).to_numpy(zero_copy_only=False) != table_ids_checksums(table))
    if not differ.any():
        return None
    pids = batch.column(PROMPT_ID).to_pylist() if PROMPT_ID in names else None
    which = [pids[i] for i in differ.nonzero()[0][:5].tolist()] if pids else f"{int(differ.sum())} rows"
    return f"ids_crc32 is not the CRC-32 of the decoded ids ({which})"


def with_crc(columns: Sequence[str]) -> list[str]:
    """``columns``, plus ``ids_crc32`` when both id columns are among them (so that :func:`crc_problem` runs)."""
    cols = list(columns)
    if INPUT_IDS in cols and OUTPUT_IDS in cols and IDS_CRC32 not in cols:
        cols.append(IDS_CRC32)
    return cols


def read_bytes(loc: layout.Location, path: str) -> pa.Buffer:
    """The whole part in memory; I/O errors raise as they are, a part that is gone raises :class:`PartVanished`."""
    try:
        with loc.fs.open_input_file(path) as f:
            return f.read_buffer()
    except FileNotFoundError as exc:
        raise PartVanished(path) from exc
    except OSError:
        if loc.fs.get_file_info(path).type == pafs.FileType.NotFound:
            raise PartVanished(path) from None
        raise


def open_checked(buf: pa.Buffer) -> pq.ParquetFile:
    """One part's bytes as a Parquet file whose every page's CRC is verified as it is read (pages written without
    one — parts before schema 6 — are read unchecked).

    ``pyarrow.parquet``, not ``pyarrow.dataset``, reads a single part: importing the dataset module imports pandas
    (~0.8 CPU-s), which every worker would pay at start for the parts it checks one at a time."""
    return pq.ParquetFile(pa.BufferReader(buf), page_checksum_verification=True)


def conformed_batches(part: pq.ParquetFile, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """``columns`` of ``part`` batch by batch as :data:`SCHEMA` types: a column an older part lacks reads as nulls
    (columns were added over the versions, never removed), one stored as another type is cast — what a dataset
    scan with ``schema=SCHEMA`` gives."""
    fields = [SCHEMA.field(c) for c in columns]
    schema = pa.schema(fields)
    stored = set(part.schema_arrow.names)
    present = [c for c in columns if c in stored]
    if not present:  # a batch without columns has no length: the footer's row count gives it
        if part.metadata.num_rows:
            yield pa.RecordBatch.from_arrays([pa.nulls(part.metadata.num_rows, f.type) for f in fields], schema=schema)
        return
    for batch in part.iter_batches(columns=present, use_pandas_metadata=False):
        arrays = []
        for f in fields:
            if f.name not in stored:
                arrays.append(pa.nulls(batch.num_rows, f.type))
                continue
            column = batch.column(f.name)
            arrays.append(column if column.type == f.type else column.cast(f.type))
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def decode(buf: pa.Buffer, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The part's rows (``columns``, default all, as :data:`SCHEMA` types) batch by batch, page CRCs verified
    (and the rows' ``ids_crc32`` when both id columns are read); raises :class:`Damaged` saying what is wrong.
    Decoding bytes held in memory: no I/O can fail here."""
    try:
        part = open_checked(buf)
        problem = schema_problem(part.schema_arrow)
        if problem:
            raise Damaged(problem)
        want = list(columns or SCHEMA.names)
        for batch in conformed_batches(part, with_crc(want)):
            problem = null_problem(batch) or crc_problem(batch)
            if problem:
                raise Damaged(problem)
            yield batch.select(want)
    except Damaged:
        raise
    except Exception as exc:  # ArrowInvalid (footer, sizes), OSError (page CRC, codec), ArrowNotImplemented, …
        raise Damaged(f"{type(exc).__name__}: {exc}".strip()) from exc


def read_checked(loc: layout.Location, path: str, columns: Sequence[str] | None = None) -> pa.Table | None:
    """``columns`` of one part, every page checked; None when it is damaged — then it is quarantined.

    Raises :class:`PartVanished` for a part that is gone, and I/O errors as they are."""
    buf = read_bytes(loc, path)
    try:
        batches = list(decode(buf, columns))
    except Damaged as exc:
        quarantine(loc, path, str(exc), buf)
        return None
    schema = pa.schema([SCHEMA.field(c) for c in (columns or SCHEMA.names)])
    return pa.Table.from_batches(batches, schema=schema)


def check_part(loc: layout.Location, path: str) -> bool:
    """Does the part decode whole (every column, every page's CRC)? A damaged one is quarantined (False)."""
    buf = read_bytes(loc, path)
    try:
        for _ in decode(buf):
            pass
    except Damaged as exc:
        quarantine(loc, path, str(exc), buf)
        return False
    return True


def compacted_from_checked(loc: layout.Location, path: str) -> list[str] | None:
    """:func:`layout.compacted_from` after it failed: the footer read from the bytes in memory; None (and the
    part quarantined) when the footer is damaged."""
    buf = read_bytes(loc, path)
    try:
        meta = pq.read_metadata(pa.BufferReader(buf)).metadata or {}
        raw = meta.get(layout.COMPACTED_FROM_KEY)
        return list(json.loads(raw)) if raw else []
    except Exception as exc:
        quarantine(loc, path, f"footer: {type(exc).__name__}: {exc}", buf)
        return None


# -- moving a part aside --------------------------------------------------------------------------------------
def quarantine_path(loc: layout.Location, path: str) -> str:
    """``{job}/dataset=X/part-….parquet`` → ``{job}/_quarantine/dataset=X/part-….parquet``."""
    dataset_dir = posixpath.dirname(path)
    job_dir = posixpath.dirname(dataset_dir)
    return posixpath.join(job_dir, QUARANTINE_DIR, posixpath.basename(dataset_dir), posixpath.basename(path))


def quarantine(loc: layout.Location, path: str, reason: str, buf: pa.Buffer | None = None) -> dict[str, Any]:
    """Move a damaged part out of its dataset directory (record first, then the file), log it loudly, and
    return the record. A part that another reader moved first is fine; one that cannot be moved (a read-only
    location) stays where it is, and this read leaves it out all the same."""
    target = quarantine_path(loc, path)
    record: dict[str, Any] = {
        "part": loc.uri(path),
        "moved_to": loc.uri(target),
        "reason": reason,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "by": f"{socket.gethostname()} pid {os.getpid()}",
        "bytes": buf.size if buf is not None else None,
        "rows": None,
        "prompt_ids": None,
    }
    if buf is not None:
        record["rows"], record["prompt_ids"] = _what_it_held(buf)
    try:
        loc.fs.create_dir(posixpath.dirname(target), recursive=True)
        layout.write_atomic(loc, target + RECORD_SUFFIX, json.dumps(record, indent=1).encode())
        loc.fs.move(path, target)
    except FileNotFoundError:
        pass  # another reader moved it first (its record says the same)
    except OSError as exc:
        record["moved_to"] = None
        log.error("cannot move the damaged part %s to %s (%s): it stays in place, left out of this read",
                  loc.uri(path), loc.uri(target), exc)  # fmt: skip
    with _FOUND_LOCK:
        _FOUND[record["part"]] = record
    held = record["prompt_ids"]
    log.error(
        "DAMAGED PART %s: %s. Quarantined to %s; its %s left out of the committed view%s. `producer verify` names "
        "them, `producer retry JOB --missing` (or a re-submit of the same inputs) regenerates them.",
        loc.uri(path),
        reason.rstrip("."),
        record["moved_to"] or "nowhere (not movable)",
        f"{record['rows']} rows are" if record["rows"] is not None else "rows (count unknown: footer unreadable) are",
        f" (prompts {', '.join(held[:10])}{' …' if len(held) > 10 else ''})" if held else "",
    )
    return record


def _what_it_held(buf: pa.Buffer) -> tuple[int | None, list[str] | None]:
    """(rows, prompt ids) of a damaged part, each None when that much no longer decodes."""
    try:
        rows = pq.read_metadata(pa.BufferReader(buf)).num_rows
    except Exception:
        return None, None
    ids = _column(buf, PROMPT_ID)
    return rows, (sorted(set(ids.to_pylist())) if ids is not None and not ids.null_count else None)


def _column(buf: pa.Buffer, name: str) -> pa.ChunkedArray | None:
    """One column of a (damaged) part, its pages checked; None when it does not decode or is not there."""
    try:
        part = open_checked(buf)
        if name not in part.schema_arrow.names:
            return None
        return pa.Table.from_batches(list(conformed_batches(part, [name])), pa.schema([SCHEMA.field(name)]))[name]
    except Exception:
        return None


# -- what was quarantined -------------------------------------------------------------------------------------
def list_quarantined(loc: layout.Location, job: str) -> list[dict[str, Any]]:
    """Every quarantined part of ``job`` (its record; a file whose record is missing is listed as found)."""
    base = posixpath.join(loc.job_dir(job), QUARANTINE_DIR)
    infos = loc.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    files = {i.path: i for i in infos if i.type == pafs.FileType.File}
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(files):
        name = posixpath.basename(path)
        if name.endswith(RECORD_SUFFIX) and layout.is_part_name(name[: -len(RECORD_SUFFIX)]):
            try:
                with loc.fs.open_input_stream(path) as f:
                    record = json.loads(f.read())
            except (OSError, ValueError) as exc:
                record = {"reason": f"record unreadable: {exc}"}
            target = path[: -len(RECORD_SUFFIX)]
            record.setdefault("moved_to", loc.uri(target))
            record.setdefault("part", loc.uri(_origin(loc, job, target)))
            record["present"] = target in files
            out[target] = record
    for path in sorted(files):
        if layout.is_part_name(posixpath.basename(path)) and path not in out:
            out[path] = {
                "part": loc.uri(_origin(loc, job, path)),
                "moved_to": loc.uri(path),
                "reason": "unknown (no record next to it)",
                "rows": None,
                "prompt_ids": None,
                "present": True,
            }
    return sorted(out.values(), key=lambda r: str(r.get("part")))


def _origin(loc: layout.Location, job: str, quarantined: str) -> str:
    return posixpath.join(loc.job_dir(job), posixpath.basename(posixpath.dirname(quarantined)),
                          posixpath.basename(quarantined))  # fmt: skip


def salvage(loc: layout.Location, job: str, columns: Sequence[str]) -> pa.Table:
    """The rows of ``job``'s quarantined parts whose ``columns`` all still decode (pages checked), column by
    column — a flipped bit in ``output_ids`` leaves a row's prompt readable. Rows whose required columns read
    null are left out; a part whose footer is gone gives nothing."""
    schema = pa.schema([SCHEMA.field(c) for c in columns])
    tables = []
    for record in list_quarantined(loc, job):
        if not record.get("present") or not record.get("moved_to"):
            continue
        try:
            buf = read_bytes(loc, loc.path(record["moved_to"]))
        except FileNotFoundError:
            continue
        cols = [_column(buf, c) for c in columns]
        if any(c is None for c in cols) or len({len(c) for c in cols}) != 1:
            continue
        table = pa.Table.from_arrays([c.combine_chunks() for c in cols], schema=schema)
        keep = pa.array(
            [all(table[c][i].is_valid for c in columns if c in _REQUIRED) for i in range(table.num_rows)], pa.bool_()
        )
        tables.append(table.filter(keep))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def quarantined_prompt_ids(output_uri: str, job: str, s3_endpoint_url: str | None = None) -> set[str]:
    """Prompt ids the quarantined parts of ``job`` held, where their records know them."""
    loc = layout.locate(output_uri, s3_endpoint_url)
    return {pid for record in list_quarantined(loc, job) for pid in record.get("prompt_ids") or ()}
