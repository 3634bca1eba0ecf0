"""``producer export JOB``: the committed view as training input.

- ``eagle3``: token-level records for EAGLE-3 drafters, the shape SpecForge's data pipeline produces
  (``input_ids`` = prompt + output, ``loss_mask`` 1 over the output, 0 over the prompt), plus ``id``,
  ``dataset``, ``prompt_len`` and ``finish_reason``. Feed it as pre-tokenized data: the ids are
  exactly what the model saw and emitted, so no chat-template re-render can drop Kimi's reasoning
  (reference §5.2).
  ``--exclude-reasoning`` zeroes the mask over the reasoning block (through ``</think>``).
  Parquet, or JSONL when ``--out`` ends in ``.jsonl``.
- ``conversations``: SpecForge's conversations JSONL (``{"id", "conversations": [{role, content,
  reasoning_content?, tool_calls?}]}``), text decoded span by span with the job's tokenizer. Each line
  also carries the exact ``input_ids``/``output_ids`` so the rows round-trip ids exactly; the text is
  for tools that need text. Re-rendering it through Kimi's chat template loses the reasoning of the
  last assistant turn — train from the ids.

  The tokenizer (``--tokenizer``, else the path the job record names — which anyone who can write Redis
  can change) is loaded from local files only (``local_files_only``), and a tokenizer that ships its own
  code is refused unless ``--trust-remote-code`` is given: export never runs code it was not told to.

Exports are written to a temporary name and renamed, one dataset in memory at a time.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import conversations, jobstate, layout, reader
from storage.checks import flat_ids
from storage.schema import (
    ANSWER_END,
    ANSWER_START,
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    REASONING_START,
    SPAN_COLUMNS,
    TOKEN_IDS,
    TOOL_CALL_SPANS,
)
from thinkfleet.settings import Settings

Format = Literal["eagle3", "conversations"]
FORMATS: tuple[str, ...] = ("eagle3", "conversations")

EAGLE3_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),  # the prompt_id
        pa.field(DATASET, pa.string(), nullable=False),
        pa.field("input_ids", TOKEN_IDS, nullable=False),  # prompt ids + output ids
        pa.field("loss_mask", pa.list_(pa.field("element", pa.int8(), nullable=False)), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),  # input_ids[:prompt_len] is the prompt
        pa.field(FINISH_REASON, pa.string(), nullable=False),  # to drop truncated rows if wanted
    ]
)
_COLUMNS = [PROMPT_ID, DATASET, INPUT_IDS, OUTPUT_IDS, *SPAN_COLUMNS, FINISH_REASON]


class ExportError(Exception):
    """The export cannot run as asked (e.g. no tokenizer for the conversations format)."""


@dataclass
class ExportResult:
    path: str
    format: str
    rows: int


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
) -> ExportResult:
    """Write the committed rows of ``job`` in ``fmt`` to ``out`` (a local path). The conversations format
    loads a tokenizer: local files only, its own code run only with ``trust_remote_code``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    suffix = ".parquet" if fmt == "eagle3" else ".jsonl"
    path = os.path.abspath(out or f"{job}-{fmt}{suffix}")
    tables = _committed_by_dataset(settings, job, datasets)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        if fmt == "eagle3" and not path.endswith(".jsonl"):
            rows = _write_eagle3_parquet(tmp, tables, exclude_reasoning)
        elif fmt == "eagle3":
            with open(tmp, "w", encoding="utf-8") as f:
                rows = _write_eagle3_jsonl(f, tables, exclude_reasoning)
        else:
            tok = load_tokenizer(tokenizer or _job_tokenizer(settings, job), trust_remote_code)
            with open(tmp, "w", encoding="utf-8") as f:
                rows = _write_conversations(f, tables, tok, include_reasoning=not exclude_reasoning)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return ExportResult(path=path, format=fmt, rows=rows)


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
        # The reasoning block runs from the output's start through </think> when emitted.
        block_end = table[REASONING_END].to_numpy() + table[HAS_THINK_END].to_numpy()
        mask[dest_out[pos_out < block_end[row_out]]] = 0
    off32 = pa.array(offsets.astype(np.int32))
    return pa.Table.from_arrays(
        [
            table[PROMPT_ID].combine_chunks(),
            table[DATASET].combine_chunks().cast(pa.string()),
            pa.ListArray.from_arrays(off32, pa.array(ids), type=TOKEN_IDS),
            pa.ListArray.from_arrays(off32, pa.array(mask), type=EAGLE3_SCHEMA.field("loss_mask").type),
            pa.array(prompt_len.astype(np.int32)),
            table[FINISH_REASON].combine_chunks(),
        ],
        schema=EAGLE3_SCHEMA,
    )


def load_tokenizer(path: str | None, trust_remote_code: bool = False) -> conversations.Decoder:
    """The tokenizer at ``path`` (a local directory or a hub id already in the local cache; never a
    download). Its own code (``auto_map``) runs only with ``trust_remote_code``; else ExportError."""
    if not path:
        raise ExportError(
            "the conversations format decodes text and needs a tokenizer: pass --tokenizer PATH_OR_ID "
            "(the job record in Redis names one when the producer submitted it)"
        )
    from transformers import AutoTokenizer  # slow import; only this format needs it

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


def _committed_by_dataset(settings: Settings, job: str, datasets: Sequence[str] | None) -> Iterator[pa.Table]:
    uri, endpoint = settings.output_uri, settings.s3_endpoint_url
    names = list(datasets) if datasets else layout.dataset_names(layout.locate(uri, endpoint), job)
    for name in names:
        yield reader.read_committed(uri, job, _COLUMNS, [name], endpoint)


def _write_eagle3_parquet(path: str, tables: Iterator[pa.Table], exclude_reasoning: bool) -> int:
    rows = 0
    with pq.ParquetWriter(path, EAGLE3_SCHEMA, compression="zstd") as writer:
        for table in tables:
            writer.write_table(eagle3_table(table, exclude_reasoning))
            rows += table.num_rows
    return rows


def _write_eagle3_jsonl(f: IO[str], tables: Iterator[pa.Table], exclude_reasoning: bool) -> int:
    rows = 0
    for table in tables:
        for record in eagle3_table(table, exclude_reasoning).to_pylist():
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            rows += 1
    return rows


def _write_conversations(
    f: IO[str], tables: Iterator[pa.Table], tok: conversations.Decoder, include_reasoning: bool
) -> int:
    rows = 0
    for table in tables:
        for row in table.to_pylist():
            f.write(json.dumps(_conversation(row, tok, include_reasoning), ensure_ascii=False) + "\n")
            rows += 1
    return rows


def _conversation(row: dict[str, Any], tok: conversations.Decoder, include_reasoning: bool) -> dict[str, Any]:
    messages, tools = conversations.prompt_messages(tok, row[INPUT_IDS])
    reply = conversations.output_message(
        tok,
        row[OUTPUT_IDS],
        (row[REASONING_START], row[REASONING_END]),
        (row[ANSWER_START], row[ANSWER_END]),
        [(s["start"], s["end"]) for s in row[TOOL_CALL_SPANS]],
        include_reasoning=include_reasoning,
    )
    record: dict[str, Any] = {
        "id": row[PROMPT_ID],
        "dataset": row[DATASET],
        "conversations": [*messages, reply],
    }
    if tools is not None:
        record["tools"] = tools
    record.update(
        has_think_end=row[HAS_THINK_END],
        finish_reason=row[FINISH_REASON],
        input_ids=row[INPUT_IDS],
        output_ids=row[OUTPUT_IDS],
    )
    return record
