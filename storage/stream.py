"""The committed view in batches: exactly :func:`storage.reader.read_committed`'s rows, in bounded memory.

``read_committed`` holds every stored row of every part (duplicates and fenced rows too) before it picks the
winners; at tens of thousands of parts and real row sizes that is tens of GB. This reads a job in two passes:

1. **keys** (:func:`plan`): only the key columns of every stored row (``prompt_id``, ``revision``, ``epoch``,
   ``created_at``, ``worker``, the token counts, whatever the caller orders or groups by) plus where the row is
   (part number, row in part). The winner per prompt is decided here by the same rule as ``read_committed``
   (:func:`storage.reader.winner_indices`; the part number stands for its path, since parts are listed in path
   order). Memory: ~100 bytes a stored row.
2. **rows** (:func:`winner_batches`, :func:`committed_batches`): the parts again, a group of them at a time, with
   the columns asked for; only the winners' rows are kept. Unordered (verify, report) they are handed on as they
   come. In an order (the prompt_id order of every export, compaction's source order) they are collected, and
   when the job is larger than the memory setting they go to local temporary Arrow files by rank range first
   (a distribution sort), each range then read back, sorted and handed on.

A part that vanished between the passes (a compaction replaced it) or that turns out damaged in a column the
first pass did not read (it is quarantined then, as every read does) invalidates the plan: ordered reads, which
hand on nothing before the second pass is done, plan again (:data:`REPLANS` times); unordered ones raise
:class:`PlanStale` for the caller to start over.

Sizes are estimated from the token counts (4 bytes an id) plus a fixed share per row; ``memory_bytes`` (the
``storage_memory_mb`` setting, less what the process holds once the keys are read: :func:`room`, kept as
:attr:`Plan.memory_bytes`) bounds a batch handed on (``/ 16``: its consumer makes copies), a group of parts read at
once (``/ 8``) and a sort run held in memory (``/ 16``: read back, sorted and cut, it is held three times, beside the
batch its consumer is turning into records).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from storage import layout, listing, quarantine, reader
from storage.schema import (
    COMPLETION_TOKENS,
    CREATED_AT,
    EPOCH,
    INPUT_IDS,
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    PROMPT_ID,
    PROMPT_TOKENS,
    REVISION,
    SCHEMA,
    TOP_LOGPROB_IDS,
    TOP_LOGPROBS,
    WORKER,
)

#: Key columns: the part number and the row's position in it (pass 1 adds them; pass 2 finds rows by them).
PART_NO = "_part"
ROW_NO = "_row"
_RANK = "_rank"
_WINNER_KEYS = (PROMPT_ID, REVISION, EPOCH, CREATED_AT, WORKER)
_SIZE_KEYS = (PROMPT_TOKENS, COMPLETION_TOKENS)
#: Times an ordered read plans again when a part vanished or was found damaged between its passes.
REPLANS = 3
#: Parts whose keys are read in one scan (the scan decodes them in parallel; the tables are compacted after).
_KEY_SCAN_PARTS = 1024
#: Most parts read in one group of the second pass (their footers and batches are held until the group is done).
_GROUP_PARTS = 1024
#: Estimated bytes of a row's non-id columns (names, hashes, sampling params, spans) when all are read.
_ROW_FIXED_BYTES = 400
#: --logprobs K: the K the estimate assumes for the top-logprob columns (their K is not among the keys).
_TOP_K_ESTIMATE = 20
DEFAULT_MEMORY_BYTES = 1 << 30
#: The columns that make a row large (ids, logprobs): without them a row's columns cost about what its keys do.
_BULKY = frozenset({INPUT_IDS, OUTPUT_IDS, OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS})
#: Decoded Arrow bytes per stored Parquet byte, at most (zstd-1 on token ids is ~1.5-2x; spans and strings more).
_EXPANSION = 4


class PlanStale(Exception):
    """A part of the plan vanished or was found damaged in the second pass: read the job again."""


@dataclass
class Plan:
    """Pass 1: every stored row's keys, and the winners."""

    loc: layout.Location
    paths: list[str]  # the parts, in path order: PART_NO indexes them
    part_rows: np.ndarray  # rows of each part
    keys: (
        pa.Table
    )  # every stored row: the key columns + PART_NO + ROW_NO (what reader.duplicate_rows takes, PART_NO for PART)
    winners: pa.Table  # the committed row of every prompt, in prompt_id order (the same columns)
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # what the second pass sizes its reads and tables to
    damaged: list[str] = field(default_factory=list)  # check_all: the parts found damaged (quarantined), URIs
    _per_token: dict[str, float] = field(default_factory=dict)

    def per_output_token(self, column: str) -> float:
        """Bytes per output id of a logprob column, from the footers of a few parts (0 for a job without
        logprobs, where the column is null; :data:`_TOP_K_ESTIMATE` when no footer says)."""
        if column not in self._per_token:
            self._per_token[column] = _per_output_token(self.loc, self.paths, self.part_rows, column)
        return self._per_token[column]

    def holds(self, columns: Sequence[str]) -> bool:
        """The winners already carry ``columns`` (a small job, read in one pass)."""
        return all(c in self.winners.column_names for c in columns)

    def tagged(self) -> pa.Table:
        """``keys`` with the part number as :data:`storage.reader.PART` (it sorts as the path does)."""
        return self.keys.append_column(reader.PART, self.keys[PART_NO])


def plan(
    loc: layout.Location,
    job: str,
    datasets: Sequence[str] | None = None,
    key_columns: Sequence[str] = (),
    *,
    columns: Sequence[str] = (),
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    check_all: bool = False,
) -> Plan:
    """Pass 1 over the parts of ``job`` (or of ``datasets``): keys, sizes and winners.

    ``check_all``: decode every column of every part on the way, page checksums verified (what
    :func:`storage.reader.check_parts` does, in the same pass): the parts found damaged are quarantined and named
    in :attr:`Plan.damaged`.

    ``columns``: what the second pass will read. When every part together is small next to ``memory_bytes``
    (their files, times :data:`_EXPANSION`, under a quarter of it), they are read here with the keys — one pass,
    as fast as a whole read — and the winners carry them (:attr:`Plan.holds`)."""
    damaged: list[str] = []  # across relists: a part quarantined by an earlier try is not listed again
    for attempt in range(reader._RELISTS):
        parts = listing.list_parts(loc, job, list(datasets) if datasets is not None else None)
        try:
            found = plan_parts(loc, parts, key_columns, columns=columns, memory_bytes=memory_bytes, check_all=check_all,
                               damaged=damaged)  # fmt: skip
            found.damaged = [loc.uri(p) for p in damaged]
            return found
        except quarantine.PartVanished:
            if attempt == reader._RELISTS - 1:
                raise
    raise AssertionError("unreachable")


def plan_parts(
    loc: layout.Location,
    parts: Sequence[pafs.FileInfo],
    key_columns: Sequence[str] = (),
    *,
    columns: Sequence[str] = (),
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    check_all: bool = False,
    damaged: list[str] | None = None,
) -> Plan:
    """:func:`plan` of exactly these parts (a compaction's snapshot). Raises ``PartVanished``."""
    # One pass when everything fits, or when only narrow columns are asked for: then the rows cost about what their
    # keys do, which pass 1 holds anyway (report's columns).
    small = sum(p.size or 0 for p in parts) * _EXPANSION <= memory_bytes // 4 or not set(columns) & _BULKY
    found = _plan(loc, [p.path for p in parts], [*key_columns, *(columns if small else ())], check_all, damaged)
    found.memory_bytes = room(memory_bytes)  # what is left once the keys are held
    return found


def _plan(
    loc: layout.Location,
    paths: list[str],
    key_columns: Sequence[str],
    check_all: bool = False,
    damaged: list[str] | None = None,
) -> Plan:
    columns = list(dict.fromkeys([*_WINNER_KEYS, *_SIZE_KEYS, *key_columns]))
    schema = pa.schema(
        [*(SCHEMA.field(c) for c in columns), pa.field(PART_NO, pa.int32()), pa.field(ROW_NO, pa.int32())]
    )
    tables: list[pa.Table] = []
    part_rows = np.zeros(len(paths), dtype=np.int64)
    for start in range(0, len(paths), _KEY_SCAN_PARTS):
        chunk = paths[start : start + _KEY_SCAN_PARTS]
        # A damaged part is quarantined by the read and left out: it holds no rows here.
        if check_all:
            table = reader.scan_parts(loc, chunk, columns, damaged=damaged, check_all=True)
        else:  # (the call compaction's tests watch)
            table = reader.scan_parts(loc, chunk, columns)
        number = pc.index_in(table[reader.PART], value_set=pa.array([loc.uri(c) for c in chunk])).to_numpy()
        number = number.astype(np.int32) + start
        counts = np.bincount(number - start, minlength=len(chunk))
        part_rows[start : start + len(chunk)] = counts
        # Rows of a part come together and in order: a row's place in its part is its distance from the part's first.
        firsts = np.concatenate([[0], np.cumsum(counts)])[:-1]
        rows = (np.arange(len(number)) - firsts[number - start]).astype(np.int32)
        # One contiguous table per scan: thousands of tiny batches would cost more than their rows.
        tables.append(
            pa.Table.from_arrays(
                [*table.select(columns).columns, pa.array(number), pa.array(rows)], schema=schema
            ).combine_chunks()
        )
    keys = pa.concat_tables(tables) if tables else schema.empty_table()
    winners = keys.take(_winners(keys)) if keys.num_rows else keys
    return Plan(loc, paths, part_rows, keys, winners)


def _winners(keys: pa.Table) -> pa.Array:
    """reader.winner_indices with the part number for the part path (parts are numbered in path order)."""
    tagged = keys.append_column(reader.PART, keys[PART_NO])
    return reader.winner_indices(tagged)


def row_bytes(p: Plan, keys: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Estimated in-memory bytes of each row of ``keys`` when ``columns`` are read."""
    prompt = keys[PROMPT_TOKENS].to_numpy().astype(np.int64)
    output = keys[COMPLETION_TOKENS].to_numpy().astype(np.int64)
    est = np.full(keys.num_rows, _ROW_FIXED_BYTES * len(columns) // len(SCHEMA.names) + 16, dtype=np.int64)
    if INPUT_IDS in columns:
        est += 4 * prompt + 8
    if OUTPUT_IDS in columns:
        est += 4 * output + 8
    for name in (OUTPUT_LOGPROBS, TOP_LOGPROB_IDS, TOP_LOGPROBS):
        if name in columns:
            est += np.ceil(p.per_output_token(name) * output).astype(np.int64)
    return est


def _per_output_token(loc: layout.Location, paths: list[str], part_rows: np.ndarray, column: str) -> float:
    """Uncompressed bytes of ``column`` per output id in up to 3 parts (first, middle, last with rows)."""
    import pyarrow.parquet as pq

    live = [i for i in range(len(paths)) if part_rows[i]]
    if not live:
        return 0.0
    worst = None
    for i in sorted({live[0], live[len(live) // 2], live[-1]}):
        try:
            with loc.fs.open_input_file(paths[i]) as f:
                meta = pq.read_metadata(f)
        except (OSError, pa.ArrowException):
            continue  # gone or damaged: another part says
        names = [meta.schema.column(c).path for c in range(meta.num_columns)]
        size = ids = 0
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for c, name in enumerate(names):
                if name.split(".")[0] == column:
                    size += rg.column(c).total_uncompressed_size
                elif name.split(".")[0] == OUTPUT_IDS:
                    ids += rg.column(c).num_values
        ratio = size / max(ids, 1) * 1.5  # decoded Arrow: offsets and validity on top of the values
        worst = ratio if worst is None else max(worst, ratio)
    if worst is None:
        return float((4 * _TOP_K_ESTIMATE + 8) if column != OUTPUT_LOGPROBS else 4)
    return worst


# -- pass 2 ---------------------------------------------------------------------------------------------------
def winner_batches(p: Plan, columns: Sequence[str], ranks: np.ndarray | None = None) -> Iterator[pa.Table]:
    """The winners' ``columns`` (+ :data:`ROW_NO`-free), in part order, a group of parts at a time.

    With ``ranks`` (one per winner) each table also carries the winner's rank as ``_rank``. Raises
    :class:`PlanStale` when a part with winners vanished or was found damaged since :func:`plan`."""
    columns = list(columns)
    memory_bytes = p.memory_bytes  # what the plan left of the setting (room)
    if p.winners.num_rows == 0:
        return
    if p.holds(columns):  # read in pass 1
        table = p.winners.select(columns)
        if ranks is not None:
            table = table.append_column(_RANK, pa.array(ranks))
        step = max(1, int(p.winners.num_rows * (memory_bytes // 8) / max(1, table.nbytes)))
        for start in range(0, table.num_rows, step):
            yield table.slice(start, step)
        return
    w_part = p.winners[PART_NO].to_numpy()
    w_row = p.winners[ROW_NO].to_numpy().astype(np.int64)
    by_part = np.lexsort((w_row, w_part))
    w_part, w_row = w_part[by_part], w_row[by_part]
    w_rank = ranks[by_part] if ranks is not None else None
    # What reading a part costs: every row of it is decoded, winners or not.
    per_row = row_bytes(p, p.keys, columns)
    part_bytes = np.bincount(p.keys[PART_NO].to_numpy(), weights=per_row, minlength=len(p.paths))
    wanted = np.unique(w_part)
    group_target = max(1, memory_bytes // 8)
    group: list[int] = []
    size = 0.0
    for n, part in enumerate(wanted.tolist()):
        group.append(part)
        size += part_bytes[part]
        if size >= group_target or len(group) >= _GROUP_PARTS or n == len(wanted) - 1:
            yield _read_group(p, group, columns, w_part, w_row, w_rank)
            group, size = [], 0.0


def _read_group(
    p: Plan, group: list[int], columns: list[str], w_part: np.ndarray, w_row: np.ndarray, w_rank: np.ndarray | None
) -> pa.Table:
    paths = [p.paths[i] for i in group]
    damaged: list[str] = []
    try:
        read = dict(reader._read_parts(p.loc, paths, columns, damaged))
    except quarantine.PartVanished as exc:
        raise PlanStale(str(exc)) from exc
    batches: list[pa.RecordBatch] = []
    offsets = {}
    at = 0
    for i, path in zip(group, paths, strict=True):
        part = read.get(path)
        n = sum(b.num_rows for b in part) if part is not None else -1
        if n != p.part_rows[i]:
            raise PlanStale(f"{p.loc.uri(path)} changed since it was planned (damaged, or replaced)")
        offsets[i] = at
        at += n
        batches.extend(part or [])
    schema = pa.schema([SCHEMA.field(c) for c in columns])
    table = pa.Table.from_batches(batches, schema=schema)
    lo, hi = np.searchsorted(w_part, group[0]), np.searchsorted(w_part, group[-1], side="right")
    base = np.array([offsets[i] for i in w_part[lo:hi].tolist()], dtype=np.int64)
    picked = table.take(pa.array(base + w_row[lo:hi]))
    if w_rank is not None:
        picked = picked.append_column(_RANK, pa.array(w_rank[lo:hi]))
    return picked


def committed_batches(
    loc: layout.Location,
    job: str,
    columns: Sequence[str],
    datasets: Sequence[str] | None = None,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    batch_bytes: int | None = None,
    order: Callable[[pa.Table], np.ndarray] | None = None,
    order_columns: Sequence[str] = (),
    group_by: str | None = None,
) -> Iterator[pa.Table]:
    """The committed rows' ``columns``, in order, as tables of at most ``batch_bytes`` (estimated; default
    ``memory_bytes / 16``) — their concatenation is ``read_committed(…, columns, datasets)`` (prompt_id order), or
    with ``order`` (winners' keys, in prompt_id order, with ``order_columns`` → the permutation to hand them on in),
    those rows in that order. ``group_by``: a key column whose runs of equal non-null values are never split
    between two tables (a conversation's turns, for the formats that need them together)."""
    columns = list(columns)
    keys = list(dict.fromkeys([*order_columns, *([group_by] if group_by else [])]))
    batch_bytes = batch_bytes or max(1, memory_bytes // 16)
    for attempt in range(REPLANS):
        p = plan(loc, job, datasets, keys, columns=columns, memory_bytes=memory_bytes)
        # The batches, groups and runs share what the plan left of the setting, in the caller's proportions.
        batch = max(1, batch_bytes * p.memory_bytes // max(1, memory_bytes))
        try:
            yield from ordered(p, columns, batch, order, group_by)
            return
        except PlanStale:
            if attempt == REPLANS - 1:
                raise


def ordered(
    p: Plan,
    columns: list[str],
    batch_bytes: int,
    order: Callable[[pa.Table], np.ndarray] | None,
    group_by: str | None = None,
) -> Iterator[pa.Table]:
    """The winners of ``p``: their ``columns`` in ``order`` (None: prompt_id), tables of ``batch_bytes`` at most
    (see :func:`committed_batches`). Every part is read before the first table is handed on, so a
    :class:`PlanStale` comes before any."""
    n = p.winners.num_rows
    if n == 0:
        return
    perm = np.asarray(order(p.winners), dtype=np.int64) if order is not None else np.arange(n, dtype=np.int64)
    ranks = np.empty(n, dtype=np.int64)
    ranks[perm] = np.arange(n, dtype=np.int64)
    sizes = row_bytes(p, p.winners, columns)[perm]  # in rank order
    cuts = _cut_points(p.winners, perm, group_by)  # ranks where a table may start
    # A run is read back whole, sorted (a copy) and cut (another): three times its size at once, while the consumer
    # holds the batch before (a token export: the batch, its records and their index arithmetic).
    run_target = max(1, p.memory_bytes // 16)  # of what the plan left of the setting (room)
    runs = _split(sizes, cuts, run_target)  # rank ranges held in memory at once
    if len(runs) == 1:
        table = _collect(winner_batches(p, columns, ranks))
        yield from _emit(table, 0, sizes, cuts, batch_bytes)
        return
    tmp = tempfile.mkdtemp(prefix="thinkfleet-sort-")
    try:
        bounds = np.array([lo for lo, _ in runs[1:]], dtype=np.int64)
        writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        sinks = {}
        schema = pa.schema([*(SCHEMA.field(c) for c in columns), pa.field(_RANK, pa.int64())])
        try:
            for table in winner_batches(p, columns, ranks):
                run_of = np.searchsorted(bounds, table[_RANK].to_numpy(), side="right")
                order_in = np.argsort(run_of, kind="stable")
                sorted_runs = run_of[order_in]
                table = table.take(pa.array(order_in))
                for r in np.unique(sorted_runs).tolist():
                    lo, hi = np.searchsorted(sorted_runs, r), np.searchsorted(sorted_runs, r, side="right")
                    if r not in writers:
                        sinks[r] = pa.OSFile(os.path.join(tmp, f"run-{r:06d}.arrow"), "wb")
                        writers[r] = pa.ipc.new_stream(
                            sinks[r], schema, options=pa.ipc.IpcWriteOptions(compression="lz4")
                        )
                    writers[r].write_table(table.slice(lo, hi - lo))
        finally:
            for r, w in writers.items():
                w.close()
                sinks[r].close()
        for r, (lo, _) in enumerate(runs):
            path = os.path.join(tmp, f"run-{r:06d}.arrow")
            if not os.path.exists(path):
                continue
            with pa.OSFile(path, "rb") as f:
                table = pa.ipc.open_stream(f).read_all()
            os.unlink(path)
            yield from _emit(table, lo, sizes, cuts, batch_bytes)
            del table  # (the next run is read into what this one held)
            reader.release_freed_memory()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(tables: Iterator[pa.Table]) -> pa.Table:
    return pa.concat_tables(list(tables))


def _emit(
    table: pa.Table, first_rank: int, sizes: np.ndarray, cuts: np.ndarray, batch_bytes: int
) -> Iterator[pa.Table]:
    """The rows of one rank range ``[first_rank, first_rank + len)``, sorted by rank, in tables of at most
    ``batch_bytes`` (estimated) cut only at ``cuts``."""
    table = table.take(pc.sort_indices(table, [(_RANK, "ascending")])).drop_columns([_RANK])
    n = table.num_rows
    here = cuts[(cuts >= first_rank) & (cuts < first_rank + n)] - first_rank
    pieces = _split(sizes[first_rank : first_rank + n], here, batch_bytes)
    for lo, hi in pieces:
        yield table.slice(lo, hi - lo).combine_chunks()


def _cut_points(winners: pa.Table, perm: np.ndarray, group_by: str | None) -> np.ndarray:
    """Ranks where a table may start: all of them, or with ``group_by`` only where a group does not go on (a
    group's first and last rank bound an interval no cut may fall inside)."""
    n = len(perm)
    if group_by is None:
        return np.arange(n, dtype=np.int64)
    values = winners[group_by].take(pa.array(perm))
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    blocked = np.zeros(n + 1, dtype=np.int64)
    if valid.any():
        ranks = np.flatnonzero(valid)
        grouped = (
            pa.table({"g": values.filter(pa.array(valid)), "r": pa.array(ranks)})
            .group_by("g")
            .aggregate([("r", "min"), ("r", "max")])
        )
        first, last = grouped["r_min"].to_numpy(), grouped["r_max"].to_numpy()
        # No cut at ranks first+1 … last: mark the interval in a difference array.
        np.add.at(blocked, first + 1, 1)
        np.add.at(blocked, last + 1, -1)
    inside = np.cumsum(blocked)[:n] > 0
    return np.flatnonzero(~inside).astype(np.int64)


def _split(sizes: np.ndarray, cuts: np.ndarray, target: int) -> list[tuple[int, int]]:
    """``[0, len(sizes))`` cut into ranges of about ``target`` (summed ``sizes``), each starting at a cut point
    (0 always is one); a range grows past ``target`` only when no cut point comes sooner."""
    n = len(sizes)
    if n == 0:
        return []
    total = np.concatenate([[0], np.cumsum(sizes)])
    allowed = np.union1d(cuts, [0, n]).astype(np.int64)
    out: list[tuple[int, int]] = []
    lo = 0
    while lo < n:
        # The last allowed start at or before the point where this range reaches target, at least one row on.
        reach = int(np.searchsorted(total, total[lo] + target, side="right")) - 1
        k = np.searchsorted(allowed, max(reach, lo + 1), side="right") - 1
        hi = int(allowed[k]) if k >= 0 and allowed[k] > lo else 0
        if hi <= lo:  # no cut point in reach: the next one, or the end
            k = np.searchsorted(allowed, lo + 1)
            hi = int(allowed[k]) if k < len(allowed) else n
        out.append((lo, min(hi, n)))
        lo = min(hi, n)
    return out


def memory_bytes_of(settings: object) -> int:
    """The ``storage_memory_mb`` setting in bytes (the default when a settings object predates it)."""
    mb = getattr(settings, "storage_memory_mb", None)
    return int(mb) << 20 if mb else DEFAULT_MEMORY_BYTES


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def room(memory_bytes: int) -> int:
    """What the memory setting leaves for batches, part groups and sort runs beside what this process already
    holds — the interpreter and its libraries (~150 MB), a plan's keys (~100 B a stored row) — so that the
    command's peak, not only its batches, stays near the setting. Never under a quarter of the setting: one
    smaller than the interpreter and the keys together is approached, not met."""
    return max(memory_bytes // 4, memory_bytes - resident_bytes())
