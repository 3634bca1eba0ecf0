"""What every export format shares: the options, the committed rows with the filters, and the files.

Filters (:class:`Rows`): ``drop_flags`` drops rows carrying any of the named quality flags (storage/flags.py:
``truncated`` — no stop: ``finish_reason`` length or abort —, ``loop``, ``no_think_end``, ``empty_answer``,
``tool_call_unparsed``; ``drop_truncated`` is ``drop_flags=("truncated",)``); ``min_reasoning_tokens`` drops
rows with fewer reasoning tokens; turn rows past their conversation's chain end are skipped as superseded.
``min_reasoning_tokens`` and ``exclude_reasoning`` need to know where reasoning ends, so a job run with
``--no-reasoning-spans`` (null spans) is refused them. The rows come a batch at a time, dataset by dataset and in
prompt_id order within one (:func:`storage.stream.committed_batches`): memory is bounded by the
``storage_memory_mb`` setting, not by the job.

Files (:class:`Files`): one file at ``--out``, or with ``shard_rows`` files of at most that many rows —
``--out X.jsonl`` → ``X-00000.jsonl``, ``X-00001.jsonl``…; an ``--out`` without the format's suffix is a
directory of ``part-00000.jsonl``…. Each file appears whole or not at all: written under a hidden temporary
name and renamed (local), or written locally and uploaded once complete (S3). Shards a previous export left
under the same names are removed.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import layout, listing, stream
from storage.exports.tool_steps import stale_steps
from storage.flags import FLAG_READ_COLUMNS, parse_flags, table_flags
from storage.jobstate import load_job_state, span_tokens
from storage.schema import (
    CHAIN_END,
    CONVERSATION_ID,
    DATASET,
    FINISH_REASON,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    REASONING_START,
    SCHEMA,
    SPAN_COLUMNS,
    STEP_INDEX,
    TOOL_CALL_SPANS,
    TURN_COUNT,
)
from thinkfleet.chain_end import stored_link
from thinkfleet.settings import Settings
from thinkfleet.tokens import SpanTokens
from thinkfleet.turns import beyond_chain_ends

#: SpecForge 0.2.0's default ``data.max_length``: longer rows are cut there without a warning.
SPECFORGE_MAX_LENGTH = 2048
#: speculators 0.9.0's default ``prepare-data --seq-length``: longer rows are cut there.
SPECULATORS_SEQ_LENGTH = 8192
#: TRL 1.16's default ``SFTConfig.max_length``: longer rows are cut there (a row left with no trained token is
#: dropped), with no word about it.
TRL_MAX_LENGTH = 1024
#: Rows over the length limit named in the result (longest first; the warning names the first few).
LONG_ROWS_KEPT = 1000
LONG_ROWS_NAMED = 10
#: The shard number in file names: ``X-00000.jsonl``.
SHARD_DIGITS = 5
#: ``--image-urls``: how a text format points at an image — where the image store keeps it, or inline as a data URI
#: (storage/exports/images.py).
IMAGE_URLS = ("store", "data")
#: The stored columns every format reads (the token formats need no more).
COLUMNS = list(dict.fromkeys([PROMPT_ID, DATASET, INPUT_IDS, OUTPUT_IDS, *SPAN_COLUMNS, FINISH_REASON]))


class ExportError(Exception):
    """The export cannot run as asked (no tokenizer, no source conversations, a bad option…)."""


def need_reasoning_spans(table: pa.Table, option: str) -> None:
    """``option`` reads where reasoning ends: refuse rows whose spans are null (``--no-reasoning-spans``)."""
    if table.num_rows and table[REASONING_END].null_count:
        raise ExportError(
            f"{option} needs reasoning spans, but {table[REASONING_END].null_count} rows have none recorded "
            "(null: the job ran with --no-reasoning-spans, so where reasoning ends is unknown) → export without "
            f"{option}"
        )


@dataclass
class ExportResult:
    path: str  # the --out URI (a file, the directory/prefix of the shards, or the dataset directory)
    format: str
    rows: int  # rows written
    files: list[str] = field(default_factory=list)  # every file written (URIs)
    skipped: dict[str, int] = field(default_factory=dict)  # reason → rows left out
    longest: int = 0  # longest written row, in tokens (prompt + output)
    max_length: int | None = None  # the length limit warned about (the format's consumer's default, or --max-length)
    over_max_length: int = 0  # written rows longer than max_length
    over_max_length_ids: list[str] = field(default_factory=list)  # their ids, longest first (LONG_ROWS_KEPT at most)
    warnings: list[str] = field(default_factory=list)
    pushed_to: str | None = None  # the Hub repo (--push-to-hub)


@dataclass(frozen=True)
class ExportOptions:
    """How ``export_job`` was asked to export; checked here, before anything is read."""

    # which rows
    datasets: Sequence[str] | None = None
    drop_truncated: bool = False
    drop_flags: Sequence[str] = ()  # quality flags (storage/flags.py) whose rows are left out
    min_reasoning_tokens: int = 0
    # what they train on
    exclude_reasoning: bool = False
    merge_turns: bool = False  # eagle3/specforge: one record per conversation
    max_length: int | None = None  # warn about longer rows (None: the limit of the format's consumer, by default)
    # the files
    shard_rows: int | None = None
    # text formats: the tokenizer that decodes the generated turn
    tokenizer: str | None = None
    trust_remote_code: bool = False
    # hf: the Hub upload
    push_to_hub: str | None = None
    hub_private: bool = False
    # text formats: an image prompt's images as the store's URLs or inline data URIs (IMAGE_URLS)
    image_urls: str = "store"

    def __post_init__(self) -> None:
        try:
            parse_flags(self.drop_flags)
        except ValueError as exc:
            raise ExportError(f"--drop-flag: {exc}") from exc
        if self.image_urls not in IMAGE_URLS:
            raise ExportError(f"--image-urls must be one of {', '.join(IMAGE_URLS)}, got {self.image_urls!r}")
        if self.shard_rows is not None and self.shard_rows < 1:
            raise ExportError(f"--shard-rows must be at least 1, got {self.shard_rows}")
        if self.min_reasoning_tokens < 0:
            raise ExportError(f"--min-reasoning-tokens must be 0 or more, got {self.min_reasoning_tokens}")
        if self.max_length is not None and self.max_length < 1:
            raise ExportError(f"--max-length must be at least 1, got {self.max_length}")


class ExportFormat:
    """One ``--format``: its name, what it accepts, and how it writes the committed rows.

    A subclass sets the class attributes and :meth:`write`; :mod:`storage.exports` registers it by name.
    """

    name: ClassVar[str]
    #: The default ``--out`` is ``JOB-{name}{suffix}``.
    suffix: ClassVar[str] = ".jsonl"
    #: Takes ``--merge-turns`` (one record per conversation).
    merges_turns: ClassVar[bool] = False
    #: Takes ``--push-to-hub``.
    pushes: ClassVar[bool] = False
    #: Takes ``--image-urls`` (writes images as URLs: the text formats).
    takes_image_urls: ClassVar[bool] = False
    #: The length limit of the consumer this format is read by, with its defaults (rows past it are cut), and what
    #: the warning about longer rows tells the user (``{longest}`` is filled in). Every format sets both.
    length_limit: ClassVar[int]
    length_advice: ClassVar[str]

    def __init__(self, options: ExportOptions) -> None:
        self.options = options

    @property
    def max_length(self) -> int:
        """The limit rows are checked against: ``--max-length`` when given, else the consumer's default."""
        return self.options.max_length or self.length_limit

    def check(self) -> None:
        """Refuse what this format cannot do, before anything is read (a subclass adds its own checks)."""

    def default_out(self, job: str) -> str:
        return f"{job}-{self.name}{self.suffix}"

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        """Write ``rows`` under ``loc``, counting into ``result``."""
        raise NotImplementedError


class LengthCheck:
    """The rows longer than a consumer's limit, which it cuts without a word: counted, the longest named.

    Fed a batch at a time; holds at most ~2 × :data:`LONG_ROWS_KEPT` (length, id) pairs, whatever the export's size.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.longest = 0
        self.over = 0
        self._named: list[tuple[int, str]] = []

    def add_records(self, records: pa.Table) -> None:
        """A batch of token records (``id``, ``input_ids``)."""
        self.add(records["id"], pc.list_value_length(records["input_ids"]).to_numpy(zero_copy_only=False))

    def add(self, ids: pa.Array | pa.ChunkedArray | Sequence[str], lengths: np.ndarray) -> None:
        """One batch: its rows' ids and lengths (tokens), in the same order."""
        if not len(lengths):
            return
        self.longest = max(self.longest, int(lengths.max()))
        over = np.flatnonzero(lengths > self.limit)
        if not len(over):
            return
        self.over += len(over)
        order = over[np.argsort(-lengths[over], kind="stable")][:LONG_ROWS_KEPT]
        if isinstance(ids, pa.Array | pa.ChunkedArray):
            names = ids.take(pa.array(order)).to_pylist()
        else:
            names = [ids[i] for i in order]
        self._named += zip(lengths[order].tolist(), names, strict=True)
        if len(self._named) > 2 * LONG_ROWS_KEPT:
            self._named = sorted(self._named, key=lambda pair: -pair[0])[:LONG_ROWS_KEPT]

    def report(self, result: ExportResult, advice: str) -> None:
        """Into ``result``: the longest row, the rows over the limit and their ids; a warning naming them."""
        result.longest, result.max_length, result.over_max_length = self.longest, self.limit, self.over
        named = sorted(self._named, key=lambda pair: -pair[0])[:LONG_ROWS_KEPT]
        result.over_max_length_ids = [pid for _, pid in named]
        if not self.over:
            return
        shown = ", ".join(result.over_max_length_ids[:LONG_ROWS_NAMED])
        more = f" and {self.over - LONG_ROWS_NAMED} more (--json lists the {LONG_ROWS_KEPT} longest)"
        result.warnings.append(
            f"{self.over} of {result.rows} rows are longer than {self.limit} tokens (longest {self.longest}): "
            f"{shown}{more if self.over > LONG_ROWS_NAMED else ''}. {advice.format(longest=self.longest)}"
        )


# -- the rows ------------------------------------------------------------------------------------------------
class Rows:
    """The committed rows, one dataset at a time, with the filters applied and counted."""

    def __init__(
        self,
        settings: Settings,
        job: str,
        datasets: Sequence[str] | None,
        drop_truncated: bool,
        min_reasoning_tokens: int,
        skipped: dict[str, int],
        drop_flags: Sequence[str] = (),
    ) -> None:
        self.settings, self.job, self.datasets = settings, job, list(datasets) if datasets else None
        self.min_reasoning_tokens, self.skipped = min_reasoning_tokens, skipped
        self.drop_flags = parse_flags([*(["truncated"] if drop_truncated else []), *drop_flags])
        self._tokens: SpanTokens | None = None
        # A filter asked for is reported even when it drops nothing.
        for flag in self.drop_flags:
            skipped[flag] = 0
        if min_reasoning_tokens:
            skipped["short_reasoning"] = 0
        self._superseded: set[str] | None = None

    def superseded(self) -> set[str]:
        """--turns all: the turn rows past their conversation's chain end — a stored row whose ``chain_end`` says
        it ends the chain (thinkfleet/chain_end.py; a re-run of an earlier turn may end it before turns stored
        earlier): not current, skipped
        (``thinkfleet.turns.beyond_chain_ends``; ``producer verify`` lists them); an agentic job's steps no current
        chain reaches too (storage/exports/tool_steps.py)."""
        if self._superseded is None:
            pids: list[str] = []
            ends: list[str] = []
            for name in self.names():
                pids_of, ends_of = self._turns_of(name)
                pids += pids_of
                ends += ends_of
            self._superseded = beyond_chain_ends(pids, ends) | stale_steps(self.settings, self.job, pids)
        return self._superseded

    def _turns_of(self, dataset: str) -> tuple[list[str], list[str]]:
        """(turn prompt ids, those whose output calls a tool) of a dataset; nothing more is read when no
        committed row has a conversation (a single-turn job: the keys say so)."""
        columns = [PROMPT_ID, CONVERSATION_ID, TOOL_CALL_SPANS, STEP_INDEX, TURN_COUNT, CHAIN_END]
        for _ in range(stream.REPLANS):
            plan = stream.plan(self.loc, self.job, [dataset], [CONVERSATION_ID], columns=columns,
                               memory_bytes=self.memory_bytes)  # fmt: skip
            if plan.winners.num_rows == 0 or plan.winners[CONVERSATION_ID].null_count == plan.winners.num_rows:
                return [], []
            pids: list[str] = []
            ends: list[str] = []
            try:
                for table in stream.winner_batches(plan, columns):  # sized to what the plan left
                    table = table.filter(pc.is_valid(table[CONVERSATION_ID]))
                    ids = table[PROMPT_ID].to_pylist()
                    pids += ids
                    # Each row's own chain_end (thinkfleet/chain_end.py); a row written before that column: a plain
                    # turn that calls a tool ended its chain (an agentic step that calls goes on with its results).
                    rows = zip(
                        ids, table[TURN_COUNT].to_pylist(), table[STEP_INDEX].to_pylist(),
                        table[TOOL_CALL_SPANS].to_pylist(), table[CHAIN_END].to_pylist(), strict=True,
                    )  # fmt: skip
                    for pid, count, step, calls, end in rows:
                        if end is None and step is not None:
                            continue
                        if stored_link(pid, int(count or 0), step, bool(calls), end).ends:
                            ends.append(pid)
            except stream.PlanStale:
                continue
            return pids, ends
        raise ExportError(f"the parts of {self.job}/{dataset} kept changing while they were read: export again")

    def names(self) -> list[str]:
        if self.datasets:
            return self.datasets
        return listing.dataset_names(self.loc, self.job)

    @property
    def loc(self) -> layout.Location:
        return layout.locate(self.settings.output_uri, self.settings.s3_endpoint_url)

    @property
    def memory_bytes(self) -> int:
        return stream.memory_bytes_of(self.settings)

    def committed(
        self,
        columns: list[str],
        datasets: list[str],
        *,
        batch_share: int = 16,
        merge_turns: bool = False,
        group_turns: bool = False,
    ) -> Iterator[pa.Table]:
        """The committed rows of ``datasets`` in prompt_id order, in tables of ``1 / batch_share`` of the memory
        setting (estimated). ``group_turns``: a conversation's turns stay in one table. ``merge_turns``: also,
        rows of no conversation first (--merge-turns writes them before the merged records, as when a dataset
        was one table)."""
        memory = self.memory_bytes
        extra = {"group_by": CONVERSATION_ID} if group_turns or merge_turns else {}
        if merge_turns:
            extra["order"] = _singles_first
            extra["order_columns"] = [CONVERSATION_ID]
        empty = True
        read = columns + [c for c in self._filter_columns() if c not in columns]
        for table in stream.committed_batches(
            self.loc, self.job, read, datasets, memory_bytes=memory, batch_bytes=max(1, memory // batch_share),
            **extra,  # type: ignore[arg-type]
        ):  # fmt: skip
            empty = False
            yield table
        if empty:  # a dataset with no committed row still yields its (empty) table, as one table per dataset did
            yield pa.schema([SCHEMA.field(c) for c in columns]).empty_table()

    def dataset_tables(
        self, columns: list[str], filtered: bool = True, **how: object
    ) -> Iterator[tuple[str, Iterator[pa.Table]]]:
        """(dataset, its tables) for every dataset in turn (see :meth:`committed` for ``how``)."""
        for name in self.names():
            tables = self.committed(columns, [name], **how)  # type: ignore[arg-type]
            # The columns a filter reads beyond the format's are dropped once it ran; an unfiltered table keeps them
            # for the format's own later call of :meth:`filter` (the text formats).
            yield name, (self.filter(t).select(columns) for t in tables) if filtered else tables

    def _filter_columns(self) -> list[str]:
        """What :meth:`filter` reads beyond a format's columns: the flags (and, for parts written before the flag
        columns, the ids they are computed from)."""
        return [FINISH_REASON] if self.drop_flags == ("truncated",) else (FLAG_READ_COLUMNS if self.drop_flags else [])

    def tokens(self) -> SpanTokens:
        """The job's span tokens (its record's model profile), for flags computed from older parts' ids."""
        if self._tokens is None:
            self._tokens = span_tokens(load_job_state(self.settings, self.job).record)
        return self._tokens

    def tables(self, columns: list[str], filtered: bool = True, **how: object) -> Iterator[pa.Table]:
        for _, tables in self.dataset_tables(columns, filtered, **how):
            yield from tables

    def filter(self, table: pa.Table) -> pa.Table:
        keep = np.ones(table.num_rows, dtype=bool)
        superseded = self.superseded() if PROMPT_ID in table.column_names else set()
        if superseded:
            gone = pc.is_in(table[PROMPT_ID], pa.array(sorted(superseded))).to_numpy(zero_copy_only=False)
            self.skipped["superseded"] = self.skipped.get("superseded", 0) + int(gone.sum())
            keep &= ~gone
        if self.drop_flags == ("truncated",):  # the ids of older parts are not needed for this one
            flags = {"truncated": ~pc.equal(table[FINISH_REASON], "stop").to_numpy(zero_copy_only=False)}
        elif self.drop_flags:
            flags = table_flags(table, self.tokens())
        for flag in self.drop_flags:
            # Each row is counted under the first flag that drops it, so the counts add up to the rows left out.
            hit = keep & flags[flag]
            self.skipped[flag] += int(hit.sum())
            keep &= ~hit
        if self.min_reasoning_tokens:
            need_reasoning_spans(table, "--min-reasoning-tokens")
            reasoning = table[REASONING_END].to_numpy() - table[REASONING_START].to_numpy()
            short = keep & (reasoning < self.min_reasoning_tokens)
            self.skipped["short_reasoning"] += int(short.sum())
            keep &= ~short
        return table if keep.all() else table.filter(pa.array(keep))


# -- files: one, or shards; local or S3 ---------------------------------------------------------------------------
class Files:
    """Where an export's files go: one file at ``loc.root``, or shards of at most ``shard_rows`` rows.

    Every file is first written to a local temporary file: renamed into place when complete (local) or
    uploaded then (S3), so a file is whole or absent; on an error nothing new is left behind. A ``.parquet``
    suffix writes ``schema``'s Parquet (:meth:`write_table`), any other JSON lines (:meth:`write_lines`).
    """

    def __init__(
        self,
        loc: layout.Location,
        suffix: str,
        shard_rows: int | None,
        result: ExportResult,
        schema: pa.Schema | None = None,
        row_group_bytes: int = stream.DEFAULT_MEMORY_BYTES // 8,
    ) -> None:
        self.loc, self.suffix, self.shard_rows, self.result, self.schema = loc, suffix, shard_rows, result, schema
        if shard_rows:
            if loc.root.endswith(suffix):
                self.dir, base = posixpath.split(loc.root)
                self.stem = base[: -len(suffix)]
            else:
                self.dir, self.stem = loc.root, "part"
        elif loc.is_local and os.path.isdir(loc.root):
            raise ExportError(
                f"--out {loc.root} is a directory: give a file name, or --shard-rows N to write shards into it"
            )
        self.tmpdir = tempfile.mkdtemp(prefix="thinkfleet-export-")
        self.shard = -1
        self.in_shard = 0
        self.text: IO[str] | None = None
        self.parquet: pq.ParquetWriter | None = None
        self.tmp: str | None = None
        #: Rows held for the next row group, and the most held (a sixteenth of the memory setting, from eagle3).
        self._held: list[pa.Table] = []
        self._held_bytes = 0
        self.row_group_bytes = row_group_bytes

    def __enter__(self) -> Files:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        try:
            if exc_type is None:
                if self.tmp is None and not self.shard_rows:
                    self._open()  # an empty export still writes its (empty) file
                self._close()
                if self.shard_rows:
                    self._remove_stale()
        finally:
            self._abandon()
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- writing --
    def write_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            if self._room() == 0 or self.text is None:
                self._next()
            assert self.text is not None
            self.text.write(line + "\n")
            self.in_shard += 1
            self.result.rows += 1

    def write_table(self, table: pa.Table) -> None:
        """Rows into the Parquet file(s). They are held until :meth:`end_table`, the shard's end or
        ``row_group_bytes`` (estimated): one row group per dataset and shard, as a whole-dataset write gave — the
        same bytes — unless a dataset outgrows the memory setting."""
        start = 0
        while start < table.num_rows:
            if self._room() == 0 or self.parquet is None:
                self._next()
            assert self.parquet is not None
            take = min(self._room(), table.num_rows - start)
            self._held.append(table.slice(start, take))
            self._held_bytes += self._held[-1].nbytes
            if self._held_bytes >= self.row_group_bytes:
                self.end_table()
            start += take
            self.in_shard += take
            self.result.rows += take

    def end_table(self) -> None:
        """Write the rows held as one row group (the end of a dataset, a shard, or of the memory share)."""
        if self._held and self.parquet is not None:
            self.parquet.write_table(pa.concat_tables(self._held).combine_chunks())
        self._held, self._held_bytes = [], 0

    # -- shards --
    def _room(self) -> int:
        return self.shard_rows - self.in_shard if self.shard_rows else 1 << 62

    def _next(self) -> None:
        if self.tmp is not None:
            self._close()
        self._open()

    def _target(self) -> str:
        if not self.shard_rows:
            return self.loc.root
        return posixpath.join(self.dir, f"{self.stem}-{self.shard:0{SHARD_DIGITS}d}{self.suffix}")

    def _open(self) -> None:
        self.shard += 1
        self.in_shard = 0
        self.tmp = os.path.join(self.tmpdir, f"shard-{self.shard}{self.suffix}")
        if self.suffix == ".parquet":
            assert self.schema is not None, "a Parquet export names its schema"
            self.parquet = pq.ParquetWriter(self.tmp, self.schema, compression="zstd")
        else:
            self.text = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close

    def _close(self) -> None:
        if self.tmp is None:
            return
        self.end_table()
        if self.parquet is not None:
            self.parquet.close()
            self.parquet = None
        if self.text is not None:
            self.text.close()
            self.text = None
        target = self._target()
        if self.loc.is_local:
            move_local(self.tmp, target)
        else:
            upload(self.loc, self.tmp, target)
            os.unlink(self.tmp)
        self.result.files.append(self.loc.uri(target))
        self.tmp = None

    def _abandon(self) -> None:
        self._held, self._held_bytes = [], 0
        for handle in (self.text, self.parquet):
            if handle is not None:
                handle.close()
        self.text = self.parquet = None

    def _remove_stale(self) -> None:
        """Delete shards of an earlier export under the same names that this one did not write."""
        pattern = re.compile(rf"^{re.escape(self.stem)}-\d{{{SHARD_DIGITS}}}{re.escape(self.suffix)}$")
        written = {self.loc.path(f) for f in self.result.files}
        for info in self.loc.fs.get_file_info(pafs.FileSelector(self.dir, allow_not_found=True)):
            if info.type == pafs.FileType.File and pattern.match(info.base_name) and info.path not in written:
                self.loc.fs.delete_file(info.path)


def _singles_first(winners: pa.Table) -> np.ndarray:
    """Winners (prompt_id order) → rows of no conversation first, then the turn rows, each in prompt_id order."""
    turns = winners[CONVERSATION_ID].is_valid().to_numpy(zero_copy_only=False)
    return np.lexsort((np.arange(len(turns)), turns))


def move_local(tmp: str, target: str) -> None:
    """Make ``target`` appear whole: copy beside it under a hidden name, then rename over."""
    directory, name = os.path.split(target)
    os.makedirs(directory or ".", exist_ok=True)
    hidden = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        shutil.move(tmp, hidden)
        os.replace(hidden, target)
    except BaseException:
        if os.path.exists(hidden):
            os.unlink(hidden)
        raise


def upload(loc: layout.Location, local_path: str, path: str) -> None:
    """One complete local file → one object (an S3 object is invisible until its upload completes)."""
    pafs.copy_files(local_path, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=loc.fs)
