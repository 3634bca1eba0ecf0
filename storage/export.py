"""``producer export JOB``: the committed view as training input, in the shape each trainer reads.

Formats (``--format``):

- ``eagle3``: token-level records — ``input_ids`` = prompt + output, ``loss_mask`` 1 over the output and
  0 over the prompt, plus ``id``, ``dataset``, ``prompt_len``, ``finish_reason``. Parquet, or JSONL when
  ``--out`` ends in ``.jsonl`` (the JSONL form is what SpecForge and speculators read; see ``specforge``).
- ``specforge``: JSONL records ``{"id", "input_ids", "loss_mask"}`` with ``len(input_ids) ==
  len(loss_mask)``: SpecForge 0.2.0's pre-tokenized loader (``data.prompts_path``) and speculators
  0.9.0's ``prepare-data --data`` read it as it is. Rows longer than ``max_length`` (SpecForge's default
  ``data.max_length`` 2048, where they are cut without a word) are counted and warned about; rows with
  no trainable token (everything masked under ``--exclude-reasoning``) are skipped and counted — the
  consumers would drop them anyway.
- ``hf``: a Hugging Face dataset (``datasets`` ``save_to_disk``; ``datasets.load_from_disk`` reads it):
  the ``eagle3`` columns plus every span and the provenance columns as features (:data:`HF_SCHEMA`).
  ``--push-to-hub REPO`` also uploads it (needs a Hugging Face token).
- ``messages``: OpenAI/TRL chat JSONL — ``{"id", "dataset", "messages": [...source conversation...,
  {"role": "assistant", "reasoning_content", "content", "tool_calls"}], "tools"?, "finish_reason",
  "has_think_end", "prompt_ids", "output_ids"}``. The source conversation is the one the producer
  rendered (the submit manifest keeps it, :mod:`storage.manifest`); the generated turn is decoded span by
  span with the job's tokenizer and marker ids (:mod:`storage.conversations`), for any model family.
- ``conversations``: the same records with the list under ``conversations`` (SpecForge's raw-data key,
  ``data.train_data_path``).

``--turns all`` jobs: a later turn's source conversation is the conversation record (Redis) with the model's
own earlier answers, decoded from the stored rows of the earlier turns (:func:`turn_history`); ``merge_turns``
(``--merge-turns``, eagle3/specforge) writes one record per conversation (:func:`merged_table`).

The ids of the text formats are ``prompt_ids``/``output_ids``, never ``input_ids``: a top-level
``input_ids`` makes SpecForge (and TRL) treat a record as pre-tokenized.

Filters: ``drop_truncated`` drops rows that did not end on a stop (``finish_reason`` length or abort);
``min_reasoning_tokens`` drops rows with fewer reasoning tokens. ``exclude_reasoning`` zeroes the mask
over the reasoning block (through ``</think>``) in the token formats and drops ``reasoning_content`` in
the text ones.

A job run with ``--no-reasoning-spans`` stores null reasoning/answer spans (not recorded): its token formats
train on the whole output as always, ``hf`` keeps the nulls, the text formats put the whole output (up to
the tool calls, stop token excluded) in ``content`` with no ``reasoning_content``, and ``exclude_reasoning``
and ``min_reasoning_tokens`` — which need to know where reasoning ends — are refused (:class:`ExportError`).

Output (``--out``): a local path or ``s3://bucket/key`` (resolved by :func:`storage.layout.locate`, with
``THINKFLEET_S3_ENDPOINT_URL``). With ``shard_rows`` the export is split into files of at most that
many rows: ``--out X.jsonl`` → ``X-00000.jsonl``, ``X-00001.jsonl``…; an ``--out`` without the format's
suffix is a directory of ``part-00000.jsonl``… (``hf``: ``save_to_disk(num_shards=…)``). Each file
appears whole or not at all: written under a hidden temporary name and renamed (local), or written
locally and uploaded once complete (S3). Shards a previous export left under the same names are removed.

The tokenizer (text formats: ``--tokenizer``, else the path the job record names — which anyone who can
write Redis can change) is loaded from local files only, and one that ships its own code is refused
unless ``trust_remote_code``: export never runs code it was not told to. It is loaded before anything
else is read. One dataset of the job is in memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from storage import conversations, jobstate, layout, manifest, reader
from storage.checks import flat_ids
from storage.schema import (
    ANSWER_END,
    ANSWER_START,
    CHAT_TEMPLATE_HASH,
    COMPLETION_TOKENS,
    CONTENT_HASH,
    CONVERSATION_ID,
    CREATED_AT,
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    INPUT_IDS,
    MODEL,
    OUTPUT_IDS,
    PROMPT_ID,
    PROMPT_TOKENS,
    REASONING_END,
    REASONING_START,
    REVISION,
    ROW_INDEX,
    SAMPLE_INDEX,
    SAMPLING_PARAMS,
    SPAN_COLUMNS,
    STOP_TOKEN,
    TOKEN_IDS,
    TOKENIZER_FINGERPRINT,
    TOOL_CALL_SPANS,
    TURN_COUNT,
    TURN_INDEX,
    WEIGHT_VERSION,
)
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import beyond_chain_ends

Format = Literal["eagle3", "specforge", "hf", "messages", "conversations"]
FORMATS: tuple[str, ...] = ("eagle3", "specforge", "hf", "messages", "conversations")
TEXT_FORMATS: tuple[str, ...] = ("messages", "conversations")
#: SpecForge 0.2.0's default ``data.max_length``: longer rows are cut there without a warning.
SPECFORGE_MAX_LENGTH = 2048
#: The shard number in file names: ``X-00000.jsonl``.
SHARD_DIGITS = 5
HF_EXTRA = "pip install 'thinkfleet[hub]'"

LOSS_MASK = pa.list_(pa.field("element", pa.int8(), nullable=False))
EAGLE3_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),  # the prompt_id
        pa.field(DATASET, pa.string(), nullable=False),
        pa.field("input_ids", TOKEN_IDS, nullable=False),  # prompt ids + output ids
        pa.field("loss_mask", LOSS_MASK, nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),  # input_ids[:prompt_len] is the prompt
        pa.field(FINISH_REASON, pa.string(), nullable=False),  # to drop truncated rows if wanted
    ]
)
#: The ``hf`` dataset: the eagle3 columns, then the spans (offsets into the OUTPUT, i.e. into
#: ``input_ids[prompt_len:]``) and provenance. Plain nullable Arrow types, so ``datasets`` maps them to
#: features without a cast.
HF_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field(DATASET, pa.string()),
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("prompt_len", pa.int32()),
        pa.field(REASONING_START, pa.int32()),
        pa.field(REASONING_END, pa.int32()),
        pa.field(HAS_THINK_END, pa.bool_()),
        pa.field(ANSWER_START, pa.int32()),
        pa.field(ANSWER_END, pa.int32()),
        pa.field(TOOL_CALL_SPANS, pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32())]))),
        pa.field(STOP_TOKEN, pa.int32()),
        pa.field(FINISH_REASON, pa.string()),
        pa.field(PROMPT_TOKENS, pa.int32()),
        pa.field(COMPLETION_TOKENS, pa.int32()),
        pa.field(ROW_INDEX, pa.int64()),
        pa.field(SAMPLE_INDEX, pa.int32()),
        pa.field(REVISION, pa.int32()),
        pa.field(MODEL, pa.string()),
        pa.field(WEIGHT_VERSION, pa.string()),
        pa.field(SAMPLING_PARAMS, pa.string()),
        pa.field(TOKENIZER_FINGERPRINT, pa.string()),
        pa.field(CHAT_TEMPLATE_HASH, pa.string()),
        pa.field(CONTENT_HASH, pa.string()),
        pa.field(CREATED_AT, pa.timestamp("us", tz="UTC")),
    ]
)
_HF_PROVENANCE = [f.name for f in HF_SCHEMA][5:]
_COLUMNS = list(dict.fromkeys([PROMPT_ID, DATASET, INPUT_IDS, OUTPUT_IDS, *SPAN_COLUMNS, FINISH_REASON]))
_MERGE_COLUMNS = [*_COLUMNS, CONVERSATION_ID, TURN_INDEX, TURN_COUNT]
_TEXT_COLUMNS = [*_COLUMNS, STOP_TOKEN, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX]
_HF_COLUMNS = list(dict.fromkeys([*_COLUMNS, *(c for c in _HF_PROVENANCE if c != "prompt_len")]))
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class ExportError(Exception):
    """The export cannot run as asked (no tokenizer, no source conversations, a bad option…)."""


def _need_reasoning_spans(table: pa.Table, option: str) -> None:
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
    max_length: int | None = None  # the length limit warned about (token formats)
    over_max_length: int = 0  # written rows longer than max_length
    warnings: list[str] = field(default_factory=list)
    pushed_to: str | None = None  # the Hub repo (--push-to-hub)


def export_job(
    settings: Settings,
    job: str,
    fmt: Format,
    out: str | None = None,
    *,
    exclude_reasoning: bool = False,
    tokenizer: str | None = None,
    datasets: Sequence[str] | None = None,
    trust_remote_code: bool = False,
    drop_truncated: bool = False,
    min_reasoning_tokens: int = 0,
    shard_rows: int | None = None,
    max_length: int = SPECFORGE_MAX_LENGTH,
    push_to_hub: str | None = None,
    hub_private: bool = False,
    merge_turns: bool = False,
) -> ExportResult:
    """Write the committed rows of ``job`` in ``fmt`` to ``out`` (local path or ``s3://``).

    Raises :class:`ExportError` for anything the caller can fix, before any file is written. A file is
    never left half-written; an I/O error part-way through a sharded export leaves the shards completed
    before it.
    """
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if shard_rows is not None and shard_rows < 1:
        raise ExportError(f"--shard-rows must be at least 1, got {shard_rows}")
    if min_reasoning_tokens < 0:
        raise ExportError(f"--min-reasoning-tokens must be 0 or more, got {min_reasoning_tokens}")
    if max_length < 1:
        raise ExportError(f"--max-length must be at least 1, got {max_length}")
    if merge_turns and fmt not in ("eagle3", "specforge"):
        raise ExportError(f"--merge-turns is for the eagle3 and specforge formats, not {fmt}")
    hub_token = _check_push(fmt, push_to_hub)
    out = out or _default_out(job, fmt)
    try:
        loc = layout.locate(out, settings.s3_endpoint_url)
    except ValueError as exc:
        raise ExportError(f"--out {out!r}: {exc}") from exc
    result = ExportResult(path=loc.uri(loc.root), format=fmt, rows=0)
    rows = _Rows(settings, job, datasets, drop_truncated, min_reasoning_tokens, result.skipped)
    if fmt in TEXT_FORMATS:
        tok = load_tokenizer(tokenizer or _job_tokenizer(settings, job), trust_remote_code)
        _write_text(result, loc, rows, tok, _job_record(settings, job, result), fmt, exclude_reasoning, shard_rows)
    elif fmt == "hf":
        _write_hf(result, loc, rows, exclude_reasoning, shard_rows, push_to_hub, hub_token, hub_private)
    else:
        _write_tokens(result, loc, rows, fmt, exclude_reasoning, shard_rows, max_length, merge_turns)
    if result.rows == 0:
        result.warnings.append("no rows were exported (nothing committed, or every row filtered out)")
    return result


# -- the rows ------------------------------------------------------------------------------------------------
class _Rows:
    """The committed rows, one dataset at a time, with the filters applied and counted."""

    def __init__(
        self,
        settings: Settings,
        job: str,
        datasets: Sequence[str] | None,
        drop_truncated: bool,
        min_reasoning_tokens: int,
        skipped: dict[str, int],
    ) -> None:
        self.settings, self.job, self.datasets = settings, job, list(datasets) if datasets else None
        self.drop_truncated, self.min_reasoning_tokens, self.skipped = drop_truncated, min_reasoning_tokens, skipped
        if drop_truncated:
            skipped["truncated"] = 0
        if min_reasoning_tokens:
            skipped["short_reasoning"] = 0
        self._superseded: set[str] | None = None

    def superseded(self) -> set[str]:
        """--turns all: the turn rows past their conversation's chain end — a stored turn whose output calls a
        tool ends it (a re-run of an earlier turn may end it before turns stored earlier): not current, skipped
        (``thinkfleet.turns.beyond_chain_ends``; ``producer verify`` lists them)."""
        if self._superseded is None:
            uri, endpoint = self.settings.output_uri, self.settings.s3_endpoint_url
            pids: list[str] = []
            ends: list[str] = []
            for name in self.names():
                table = reader.read_committed(
                    uri, self.job, [PROMPT_ID, CONVERSATION_ID, TOOL_CALL_SPANS], [name], endpoint
                )
                if table.num_rows == 0 or table[CONVERSATION_ID].null_count == table.num_rows:
                    continue
                ids = table[PROMPT_ID].to_pylist()
                pids += ids
                ends += [pid for pid, calls in zip(ids, table[TOOL_CALL_SPANS].to_pylist(), strict=True) if calls]
            self._superseded = beyond_chain_ends(pids, ends)
        return self._superseded

    def names(self) -> list[str]:
        if self.datasets:
            return self.datasets
        return layout.dataset_names(layout.locate(self.settings.output_uri, self.settings.s3_endpoint_url), self.job)

    def tables(self, columns: list[str], filtered: bool = True) -> Iterator[pa.Table]:
        uri, endpoint = self.settings.output_uri, self.settings.s3_endpoint_url
        for name in self.names():
            table = reader.read_committed(uri, self.job, columns, [name], endpoint)
            yield self._filter(table) if filtered else table

    def _filter(self, table: pa.Table) -> pa.Table:
        keep = np.ones(table.num_rows, dtype=bool)
        superseded = self.superseded() if PROMPT_ID in table.column_names else set()
        if superseded:
            gone = pc.is_in(table[PROMPT_ID], pa.array(sorted(superseded))).to_numpy(zero_copy_only=False)
            self.skipped["superseded"] = self.skipped.get("superseded", 0) + int(gone.sum())
            keep &= ~gone
        if self.drop_truncated:
            truncated = ~pc.equal(table[FINISH_REASON], "stop").to_numpy(zero_copy_only=False)
            self.skipped["truncated"] += int(truncated.sum())
            keep &= ~truncated
        if self.min_reasoning_tokens:
            _need_reasoning_spans(table, "--min-reasoning-tokens")
            reasoning = table[REASONING_END].to_numpy() - table[REASONING_START].to_numpy()
            short = keep & (reasoning < self.min_reasoning_tokens)
            self.skipped["short_reasoning"] += int(short.sum())
            keep &= ~short
        return table if keep.all() else table.filter(pa.array(keep))


# -- token formats: eagle3, specforge --------------------------------------------------------------------------
def eagle3_table(table: pa.Table, exclude_reasoning: bool = False) -> pa.Table:
    """Committed rows → EAGLE-3 records, vectorized (no Python loop over ids)."""
    in_v, in_o = flat_ids(table[INPUT_IDS])
    out_v, out_o = flat_ids(table[OUTPUT_IDS])
    n_rows = table.num_rows
    prompt_len, output_len = np.diff(in_o), np.diff(out_o)
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(prompt_len + output_len, out=offsets[1:])
    ids = np.empty(offsets[-1], dtype=np.int32)
    mask = np.zeros(offsets[-1], dtype=np.int8)
    row_in = np.repeat(np.arange(n_rows), prompt_len)
    ids[offsets[:-1][row_in] + np.arange(len(in_v)) - in_o[:-1][row_in]] = in_v
    row_out = np.repeat(np.arange(n_rows), output_len)
    pos_out = np.arange(len(out_v)) - out_o[:-1][row_out]
    dest_out = offsets[:-1][row_out] + prompt_len[row_out] + pos_out
    ids[dest_out] = out_v
    mask[dest_out] = 1
    if exclude_reasoning:
        _need_reasoning_spans(table, "--exclude-reasoning")
        # The reasoning block runs from the output's start through </think> when emitted.
        block_end = table[REASONING_END].to_numpy() + table[HAS_THINK_END].to_numpy()
        mask[dest_out[pos_out < block_end[row_out]]] = 0
    off32 = pa.array(offsets.astype(np.int32))
    return pa.Table.from_arrays(
        [
            table[PROMPT_ID].combine_chunks(),
            table[DATASET].combine_chunks().cast(pa.string()),
            pa.ListArray.from_arrays(off32, pa.array(ids), type=TOKEN_IDS),
            pa.ListArray.from_arrays(off32, pa.array(mask), type=LOSS_MASK),
            pa.array(prompt_len.astype(np.int32)),
            table[FINISH_REASON].combine_chunks(),
        ],
        schema=EAGLE3_SCHEMA,
    )


#: --merge-turns: a run of an earlier turn's output ids found in the last prompt counts when it is at least this
#: long (a lone token — a space, a common word — matches user text by chance).
MERGE_MIN_RUN = 2


def merged_table(table: pa.Table, exclude_reasoning: bool = False, skipped: dict[str, int] | None = None) -> pa.Table:
    """``--merge-turns``: the rows of a ``--turns all`` job → ONE EAGLE-3 record per conversation (``id`` = the
    conversation id): its last stored turn's prompt + output, the loss over that output (as :func:`eagle3_table`)
    AND over every earlier model-generated answer inside that prompt. Each earlier turn k's answer is looked
    for in the part of the last prompt that follows turn k's own prompt (its prefix) up to where turn k+1's
    prompt ends; the runs of turn k's stored ``output_ids`` that appear there verbatim (at least
    :data:`MERGE_MIN_RUN` ids, in order) get loss 1. Where the template re-rendered the answer differently —
    Kimi drops the reasoning of earlier turns, a decode/re-encode may split words otherwise — only the ids that
    match verbatim are trained on. ``exclude_reasoning`` leaves reasoning ids (through ``</think>``) at 0. Rows
    of no conversation (a single-turn job) are exported as by :func:`eagle3_table`; ``skipped["merged_turns"]``
    counts the turn rows folded into another turn's record."""
    import difflib

    convs: dict[str, dict[int, dict[str, Any]]] = {}
    single: list[int] = []
    conv_col = table[CONVERSATION_ID].to_pylist() if CONVERSATION_ID in table.column_names else [None] * len(table)
    turn_col = table[TURN_INDEX].to_pylist() if TURN_INDEX in table.column_names else [None] * len(table)
    for i, (conv, turn) in enumerate(zip(conv_col, turn_col, strict=True)):
        if conv is None or turn is None:
            single.append(i)
        else:
            convs.setdefault(conv, {})[turn] = {"i": i}
    parts = [eagle3_table(table.take(pa.array(single, pa.int64())), exclude_reasoning)] if single else []
    if not convs:
        return pa.concat_tables(parts) if parts else eagle3_table(table.slice(0, 0), exclude_reasoning)
    needed = [INPUT_IDS, OUTPUT_IDS, REASONING_END, HAS_THINK_END]
    if exclude_reasoning:
        _need_reasoning_spans(table, "--exclude-reasoning")
    ids, datasets, finish = [], [], []
    masks, prompt_lens, names = [], [], []
    for conv, turns in convs.items():
        for t in turns.values():
            t.update({c: table[c][t["i"]].as_py() for c in needed})
        last = max(turns)
        prompt, output = turns[last][INPUT_IDS], turns[last][OUTPUT_IDS]
        mask = np.zeros(len(prompt) + len(output), dtype=np.int8)
        mask[len(prompt) :] = 1
        if exclude_reasoning:
            mask[len(prompt) : len(prompt) + _reasoning_block(turns[last])] = 0
        cursor = 0
        for k in sorted(t for t in turns if t < last):
            out_k = turns[k][OUTPUT_IDS]
            start = max(cursor, _common_prefix(turns[k][INPUT_IDS], prompt))
            following = turns.get(k + 1)
            end = _common_prefix(following[INPUT_IDS], prompt) if following else len(prompt)
            end = max(end, start)
            region = prompt[start:end]
            floor = _reasoning_block(turns[k]) if exclude_reasoning else 0
            matcher = difflib.SequenceMatcher(None, out_k, region, autojunk=False)
            for a, b, size in matcher.get_matching_blocks():
                if size < MERGE_MIN_RUN:
                    continue
                lo = max(a, floor)  # ids of out_k[a:a+size] at region[b:b+size]
                if lo < a + size:
                    mask[start + b + (lo - a) : start + b + size] = 1
                cursor = max(cursor, start + b + size)
        ids.append(np.asarray(prompt + output, dtype=np.int32))
        masks.append(mask)
        prompt_lens.append(len(prompt))
        names.append(conv)
        datasets.append(str(table[DATASET][turns[last]["i"]].as_py()))
        finish.append(table[FINISH_REASON][turns[last]["i"]].as_py())
        if skipped is not None and len(turns) > 1:
            skipped["merged_turns"] = skipped.get("merged_turns", 0) + len(turns) - 1
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    merged = pa.Table.from_arrays(
        [
            pa.array(names, pa.string()),
            pa.array(datasets, pa.string()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids)), type=TOKEN_IDS),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(masks)), type=LOSS_MASK),
            pa.array(prompt_lens, pa.int32()),
            pa.array(finish, table.schema.field(FINISH_REASON).type),
        ],
        schema=EAGLE3_SCHEMA,
    )
    return pa.concat_tables([*parts, merged])


def _reasoning_block(row: dict[str, Any]) -> int:
    """Output ids of the reasoning block: through ``</think>`` when emitted."""
    return int(row[REASONING_END]) + int(bool(row[HAS_THINK_END]))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else n


def _write_tokens(
    result: ExportResult,
    loc: layout.Location,
    rows: _Rows,
    fmt: str,
    exclude_reasoning: bool,
    shard_rows: int | None,
    max_length: int,
    merge_turns: bool = False,
) -> None:
    parquet = fmt == "eagle3" and not loc.root.endswith(".jsonl")
    suffix = ".parquet" if parquet else ".jsonl"
    lengths: list[np.ndarray] = []
    with _Files(loc, suffix, shard_rows, result) as files:
        for table in rows.tables(_MERGE_COLUMNS if merge_turns else _COLUMNS):
            if merge_turns:
                records = merged_table(table, exclude_reasoning, result.skipped)
            else:
                records = eagle3_table(table, exclude_reasoning)
            if fmt == "specforge":
                records = _trainable(records, result.skipped)
            lengths.append(pc.list_value_length(records["input_ids"]).to_numpy(zero_copy_only=False))
            if parquet:
                files.write_table(records, EAGLE3_SCHEMA)
            else:
                if fmt == "specforge":
                    records = records.select(["id", "input_ids", "loss_mask"])
                files.write_lines(_json_lines(records))
    every = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    result.longest = int(every.max()) if len(every) else 0
    result.max_length = max_length
    result.over_max_length = int((every > max_length).sum())
    if result.over_max_length:
        result.warnings.append(
            f"{result.over_max_length} of {result.rows} rows are longer than {max_length} tokens (longest "
            f"{result.longest}): SpecForge cuts rows at data.max_length (default {SPECFORGE_MAX_LENGTH}) without "
            f"a warning and speculators at --seq-length — set data.max_length={result.longest} / --seq-length "
            f"{result.longest}, or these rows lose their tail"
        )
    if result.skipped.get("no_trainable_tokens"):
        result.warnings.append(
            f"skipped {result.skipped['no_trainable_tokens']} rows with no trainable token left (all of their "
            "output is reasoning, which --exclude-reasoning masks out)"
        )


def _trainable(records: pa.Table, skipped: dict[str, int]) -> pa.Table:
    """Drop (and count) records whose loss mask has no 1: SpecForge and speculators drop them anyway."""
    mask = records["loss_mask"]
    ends = np.cumsum(pc.list_value_length(mask).to_numpy(zero_copy_only=False))
    ones = np.concatenate([[0], np.cumsum(pc.list_flatten(mask).to_numpy(zero_copy_only=False), dtype=np.int64)])
    empty = ones[ends] == ones[np.concatenate([[0], ends[:-1]])]
    if not empty.any():
        return records
    skipped["no_trainable_tokens"] = skipped.get("no_trainable_tokens", 0) + int(empty.sum())
    return records.filter(pa.array(~empty))


def _json_lines(table: pa.Table) -> Iterator[str]:
    for record in table.to_pylist():
        yield json.dumps(record, separators=(",", ":"))


# -- hf -----------------------------------------------------------------------------------------------------
def hf_table(table: pa.Table, exclude_reasoning: bool = False) -> pa.Table:
    """Committed rows (with :data:`_HF_COLUMNS`) → the ``hf`` dataset's columns (:data:`HF_SCHEMA`)."""
    tokens = eagle3_table(table, exclude_reasoning)
    columns = [tokens["id"], tokens[DATASET], tokens["input_ids"], tokens["loss_mask"], tokens["prompt_len"]]
    columns += [table[name] for name in HF_SCHEMA.names[5:]]
    return pa.Table.from_arrays([c.cast(f.type) for c, f in zip(columns, HF_SCHEMA, strict=True)], schema=HF_SCHEMA)


def _write_hf(
    result: ExportResult,
    loc: layout.Location,
    rows: _Rows,
    exclude_reasoning: bool,
    shard_rows: int | None,
    repo: str | None,
    token: str | None,
    private: bool,
) -> None:
    try:
        import datasets as hf_datasets
    except ImportError as exc:
        raise ExportError(f"--format hf needs the Hugging Face `datasets` package: {HF_EXTRA}") from exc

    quiet = hf_datasets.is_progress_bar_enabled()
    if quiet:
        hf_datasets.disable_progress_bars()  # stdout/stderr stay for our own report (--json)
    try:
        _save_hf(hf_datasets, result, loc, rows, exclude_reasoning, shard_rows, repo, token, private)
    finally:
        if quiet:
            hf_datasets.enable_progress_bars()


def _save_hf(
    hf_datasets: Any,
    result: ExportResult,
    loc: layout.Location,
    rows: _Rows,
    exclude_reasoning: bool,
    shard_rows: int | None,
    repo: str | None,
    token: str | None,
    private: bool,
) -> None:
    with tempfile.TemporaryDirectory(prefix="thinkfleet-hf-") as tmp:
        arrow_path = os.path.join(tmp, "rows.arrow")
        with pa.OSFile(arrow_path, "wb") as sink, pa.ipc.new_stream(sink, HF_SCHEMA) as writer:
            for table in rows.tables(_HF_COLUMNS):
                records = hf_table(table, exclude_reasoning)
                writer.write_table(records)
                result.rows += records.num_rows
                if records.num_rows:
                    longest = pc.max(pc.list_value_length(records["input_ids"])).as_py()
                    result.longest = max(result.longest, int(longest))
        dataset = hf_datasets.Dataset.from_file(arrow_path)  # memory-mapped: never all in memory
        # One shard at least: datasets saves an empty dataset with none, and then cannot load it.
        num_shards = max(1, math.ceil(result.rows / shard_rows)) if shard_rows else None
        if not result.rows:
            num_shards = 1
        if loc.is_local:
            result.files = _save_local_dataset(dataset, loc.root, num_shards)
        else:
            saved = os.path.join(tmp, "dataset")
            dataset.save_to_disk(saved, num_shards=num_shards)
            result.files = _upload_dataset(loc, saved)
        if repo:
            push_dataset(dataset, repo, token=token, private=private, num_shards=num_shards)
            result.pushed_to = repo
        del dataset  # release the memory map before the temporary directory goes


#: The Hub upload, a seam for tests (no network here): ``push_dataset(dataset, repo, token=…, …)``.
def push_dataset(dataset: Any, repo: str, *, token: str | None, private: bool, num_shards: int | None) -> None:
    dataset.push_to_hub(repo, token=token, private=private, num_shards=num_shards)


def _check_push(fmt: str, repo: str | None) -> str | None:
    """Validate ``--push-to-hub`` before anything is read; returns the token to push with."""
    if repo is None:
        return None
    if fmt != "hf":
        raise ExportError(f"--push-to-hub uploads a Hugging Face dataset: use it with --format hf, not {fmt}")
    if not _REPO_ID.match(repo) or ".." in repo or repo.endswith((".", "-")):
        raise ExportError(f"--push-to-hub {repo!r} is not a Hub repo id: use NAME or OWNER/NAME")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not token:
        try:
            from huggingface_hub import get_token

            token = get_token()
        except ImportError:
            token = None
    if not token:
        raise ExportError(
            "--push-to-hub needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`"
        )
    return token


def _save_local_dataset(dataset: Any, path: str, num_shards: int | None) -> list[str]:
    """``save_to_disk`` into a hidden sibling, then swap it in; an old export there is replaced whole."""
    if os.path.exists(path) and not _is_saved_dataset(path):
        raise ExportError(
            f"--out {path} exists and is not a saved dataset (no state.json): choose another --out or remove it"
        )
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    old = f"{tmp}-old"
    try:
        dataset.save_to_disk(tmp, num_shards=num_shards)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (not os.listdir(path) or os.path.exists(os.path.join(path, "state.json")))


def _upload_dataset(loc: layout.Location, local_dir: str) -> list[str]:
    """Upload a saved dataset under ``loc.root``: data files first, ``state.json`` last; stale shards removed."""
    names = sorted(os.listdir(local_dir), key=lambda n: (n in ("dataset_info.json", "state.json"), n))
    written = []
    for name in names:
        path = posixpath.join(loc.root, name)
        _upload(loc, os.path.join(local_dir, name), path)
        written.append(path)
    stale = re.compile(r"^data-\d{5}-of-\d{5}\.arrow$")
    for info in loc.fs.get_file_info(pafs.FileSelector(loc.root, allow_not_found=True)):
        if info.type == pafs.FileType.File and stale.match(info.base_name) and info.path not in written:
            loc.fs.delete_file(info.path)
    return [loc.uri(p) for p in written]


# -- text formats: messages, conversations -----------------------------------------------------------------------
def _write_text(
    result: ExportResult,
    loc: layout.Location,
    rows: _Rows,
    tok: conversations.Decoder,
    record: JobRecord,
    fmt: str,
    exclude_reasoning: bool,
    shard_rows: int | None,
) -> None:
    settings = rows.settings
    sources = manifest.read_sources(settings.output_uri, rows.job, rows.datasets, settings.s3_endpoint_url)
    convs = _Conversations(settings, rows.job)
    missing, no_conversation = [], []  # checked for every dataset before anything is written (cheap columns)
    for table in rows.tables([PROMPT_ID, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX], filtered=False):
        cols = (table[c].to_pylist() for c in (PROMPT_ID, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX))
        for pid, digest, conv, turn in zip(*cols, strict=True):
            if turn:  # a later turn of --turns all: its history is the conversation with the model's answers
                if convs.get(conv) is None:
                    no_conversation.append(pid)
            elif (pid, digest) not in sources:
                missing.append(pid)
    if missing:
        raise ExportError(
            f"{len(missing)} rows (e.g. {', '.join(missing[:3])}) have no source conversation in the submit "
            f"manifest ({settings.output_uri}/{rows.job}/_manifest/): the job was submitted before manifests "
            "kept it, or with other inputs. Re-run the same `producer submit` (it enqueues nothing that is done "
            "and records the conversations), then export again"
        )
    if no_conversation:
        raise ExportError(
            f"{len(no_conversation)} later turns of --turns all conversations (e.g. {', '.join(no_conversation[:3])}) "
            f"have no conversation record in Redis ({convs.error or 'not in the job'}): their history is "
            "rendered from it. Export while the job's Redis state is there"
        )
    markers = conversations.ToolMarkers.of(record)
    key = "messages" if fmt == "messages" else "conversations"
    with _Files(loc, ".jsonl", shard_rows, result) as files:
        for table in rows.tables(_TEXT_COLUMNS, filtered=False):
            if exclude_reasoning:
                _need_reasoning_spans(table, "--exclude-reasoning")
            everything = table.to_pylist()
            histories = _histories(everything, convs, tok, markers, exclude_reasoning)
            kept = rows._filter(table)[PROMPT_ID].to_pylist() if len(table) else []
            keep = set(kept)
            orphans = {r[PROMPT_ID] for r in everything if r.get(TURN_INDEX) and r[PROMPT_ID] not in histories}
            if orphans & keep:  # an earlier turn of theirs is not stored: no history to show them with
                result.skipped["no_earlier_turn"] = result.skipped.get("no_earlier_turn", 0) + len(orphans & keep)
                keep -= orphans
            files.write_lines(
                json.dumps(
                    _text_record(row, sources, tok, markers, key, exclude_reasoning, histories.get(row[PROMPT_ID])),
                    ensure_ascii=False,
                )
                for row in everything
                if row[PROMPT_ID] in keep
            )


class _Conversations:
    """--turns all: the job's conversation records (``Keys.conversations``), read once from Redis
    when a later turn needs one; ``error`` says why none could be read."""

    def __init__(self, settings: Settings, job: str) -> None:
        self.settings, self.job = settings, job
        self._all: dict[str, dict[str, Any]] | None = None
        self.error: str | None = None

    def get(self, conv: str | None) -> dict[str, Any] | None:
        if conv is None:
            return None
        if self._all is None:
            self._all = self._load()
        return self._all.get(conv)

    def _load(self) -> dict[str, dict[str, Any]]:
        import redis

        key = self.settings.keys.conversations(self.job)
        try:
            client = redis.Redis.from_url(self.settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
            with client:
                return {k.decode(): json.loads(v) for k, v in client.hscan_iter(key, count=1000)}
        except (redis.RedisError, OSError) as exc:
            self.error = f"Redis unreachable: {type(exc).__name__}: {exc}"
            return {}


def _answer_of(
    row: dict[str, Any], tok: conversations.Decoder, markers: conversations.ToolMarkers, reasoning: bool = True
) -> dict[str, Any]:
    calls = [(s["start"], s["end"]) for s in row[TOOL_CALL_SPANS]]
    if row[REASONING_END] is None or row[ANSWER_START] is None:
        # Spans not recorded (--no-reasoning-spans): the whole output up to the tool calls is the content.
        end = calls[0][0] if calls else len(row[OUTPUT_IDS]) - (row.get(STOP_TOKEN) is not None)
        return conversations.output_message(tok, row[OUTPUT_IDS], (0, 0), (0, end), calls, markers, False)
    return conversations.output_message(
        tok,
        row[OUTPUT_IDS],
        (row[REASONING_START], row[REASONING_END]),
        (row[ANSWER_START], row[ANSWER_END]),
        calls,
        markers,
        include_reasoning=reasoning,
    )


def turn_history(
    conversation: dict[str, Any], answers: Sequence[dict[str, Any]], exclude_reasoning: bool = False
) -> list[dict[str, Any]]:
    """The source messages of turn ``len(answers)`` of a --turns all conversation: the dataset's history with
    the model's own answers of the earlier turns in place of the dataset's (``thinkfleet.turns.turn_messages``,
    what the worker rendered the turn's prompt from)."""
    from thinkfleet.turns import turn_messages

    if exclude_reasoning:
        answers = [{k: v for k, v in a.items() if k != "reasoning_content"} for a in answers]
    return turn_messages(conversation, list(answers))


def _histories(
    rows: list[dict[str, Any]],
    convs: _Conversations,
    tok: conversations.Decoder,
    markers: conversations.ToolMarkers,
    exclude_reasoning: bool,
) -> dict[str, tuple[list[dict[str, Any]], Any]]:
    """prompt id → (source messages, tools), for every later turn (turn_index ≥ 1) among ``rows`` (one dataset: all the
    turns of a conversation). The earlier answers are decoded from the stored rows of the earlier turns —
    filtered out or not — as the worker decoded them to render the turn."""
    by_conv: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        if row.get(CONVERSATION_ID) is not None and row.get(TURN_INDEX) is not None:
            by_conv.setdefault(row[CONVERSATION_ID], {})[row[TURN_INDEX]] = row
    out: dict[str, tuple[list[dict[str, Any]], Any]] = {}
    for conv_id, turns in by_conv.items():
        later = [t for t in turns if t >= 1]
        if not later:
            continue
        conv = convs.get(conv_id)
        if conv is None:
            continue
        answers: list[dict[str, Any]] = []
        for t in range(max(later)):
            if t not in turns:
                break  # an earlier turn is not stored: the later ones cannot have been rendered from it
            answers.append(_answer_of(turns[t], tok, markers))
        for t in later:
            if t <= len(answers):
                out[turns[t][PROMPT_ID]] = (turn_history(conv, answers[:t], exclude_reasoning), conv.get("tools"))
    return out


def _text_record(
    row: dict[str, Any],
    sources: dict[tuple[str, str], tuple[str | None, str | None]],
    tok: conversations.Decoder,
    markers: conversations.ToolMarkers,
    key: str,
    exclude_reasoning: bool,
    history: tuple[list[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """One row's record; ``history``: a later turn's source messages (:func:`_histories`), else the manifest's."""
    reply = _answer_of(row, tok, markers, reasoning=not exclude_reasoning)
    if history is not None:
        source, tools = history
    else:
        messages_json, tools_json = sources[(row[PROMPT_ID], row[CONTENT_HASH])]
        source = json.loads(messages_json or "[]")
        tools = json.loads(tools_json) if tools_json else None
    record: dict[str, Any] = {"id": row[PROMPT_ID], "dataset": row[DATASET], key: [*source, reply]}
    if tools:
        record["tools"] = tools
    record.update(
        finish_reason=row[FINISH_REASON],
        has_think_end=row[HAS_THINK_END],
        prompt_ids=row[INPUT_IDS],
        output_ids=row[OUTPUT_IDS],
    )
    return record


def load_tokenizer(path: str | None, trust_remote_code: bool = False) -> conversations.Decoder:
    """The tokenizer at ``path`` (a local directory or a hub id already in the local cache; never a
    download). Its own code (``auto_map``) runs only with ``trust_remote_code``; else ExportError."""
    if not path:
        raise ExportError(
            "the messages/conversations formats decode text and need a tokenizer: pass --tokenizer PATH_OR_ID "
            "(the job record in Redis names one when the producer submitted it)"
        )
    from transformers import AutoTokenizer  # slow import; only the text formats need it

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        if not trust_remote_code and "trust_remote_code" in str(exc):
            raise ExportError(
                f"tokenizer {path!r} ships its own code, which export does not run by default: check the "
                "path (the job record in Redis names it), then pass --trust-remote-code (Kimi's needs it)"
            ) from exc
        raise ExportError(
            f"cannot load tokenizer {path!r} from local files: {type(exc).__name__}: {exc}\n"
            "  → pass --tokenizer with a local directory (export never downloads)"
        ) from exc


def _job_tokenizer(settings: Settings, job: str) -> str | None:
    value = jobstate.load_job_state(settings, job).record.get("tokenizer")
    return str(value) if value else None


def _job_record(settings: Settings, job: str, result: ExportResult) -> JobRecord:
    """The job record (its marker ids); Kimi's defaults, with a warning, when Redis has none."""
    state = jobstate.load_job_state(settings, job)
    if not state.record:
        why = state.error or "no job record"
        result.warnings.append(f"job record not read ({why}): tool calls decoded with Kimi's marker ids")
    return JobRecord.from_dict(state.record, name=job)


# -- files: one, or shards; local or S3 ---------------------------------------------------------------------------
def _default_out(job: str, fmt: str) -> str:
    return {"eagle3": f"{job}-eagle3.parquet", "hf": f"{job}-hf"}.get(fmt, f"{job}-{fmt}.jsonl")


class _Files:
    """Where an export's files go: one file at ``loc.root``, or shards of at most ``shard_rows`` rows.

    Every file is first written to a local temporary file: renamed into place when complete (local) or
    uploaded then (S3), so a file is whole or absent; on an error nothing new is left behind.
    """

    def __init__(self, loc: layout.Location, suffix: str, shard_rows: int | None, result: ExportResult) -> None:
        self.loc, self.suffix, self.shard_rows, self.result = loc, suffix, shard_rows, result
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

    def __enter__(self) -> _Files:
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

    def write_table(self, table: pa.Table, schema: pa.Schema) -> None:
        start = 0
        while start < table.num_rows:
            if self._room() == 0 or self.parquet is None:
                self._next(schema)
            assert self.parquet is not None
            take = min(self._room(), table.num_rows - start)
            self.parquet.write_table(table.slice(start, take))
            start += take
            self.in_shard += take
            self.result.rows += take

    # -- shards --
    def _room(self) -> int:
        return self.shard_rows - self.in_shard if self.shard_rows else 1 << 62

    def _next(self, schema: pa.Schema | None = None) -> None:
        if self.tmp is not None:
            self._close()
        self._open(schema)

    def _target(self) -> str:
        if not self.shard_rows:
            return self.loc.root
        return posixpath.join(self.dir, f"{self.stem}-{self.shard:0{SHARD_DIGITS}d}{self.suffix}")

    def _open(self, schema: pa.Schema | None = None) -> None:
        self.shard += 1
        self.in_shard = 0
        self.tmp = os.path.join(self.tmpdir, f"shard-{self.shard}{self.suffix}")
        if self.suffix == ".parquet":
            self.parquet = pq.ParquetWriter(self.tmp, schema or EAGLE3_SCHEMA, compression="zstd")
        else:
            self.text = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close

    def _close(self) -> None:
        if self.tmp is None:
            return
        if self.parquet is not None:
            self.parquet.close()
            self.parquet = None
        if self.text is not None:
            self.text.close()
            self.text = None
        target = self._target()
        if self.loc.is_local:
            _move_local(self.tmp, target)
        else:
            _upload(self.loc, self.tmp, target)
            os.unlink(self.tmp)
        self.result.files.append(self.loc.uri(target))
        self.tmp = None

    def _abandon(self) -> None:
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


def _move_local(tmp: str, target: str) -> None:
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


def _upload(loc: layout.Location, local_path: str, path: str) -> None:
    """One complete local file → one object (an S3 object is invisible until its upload completes)."""
    pafs.copy_files(local_path, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=loc.fs)
