"""THE Parquet schema of thinkfleet's output (and of the submit manifest), in this one module.

One row = one generation of one prompt: the exact prompt ids sent to SGLang's ``/generate``, the exact
``output_ids`` it returned (stop token included), token spans derived from those ids (see
:mod:`storage.spans`), and everything that produced the row. Token ids are never re-rendered as
text here: the ids are the product.

:func:`rows_to_table` turns the worker's row dicts into an Arrow table column by column (no
``Table.from_pylist``): token ids go into one flat int32 buffer plus offsets, and spans are computed
for the whole batch at once when the rows don't carry them.

One file because the Parquet schema lives in exactly one module (the house's rule): the column names, their types,
the version history and the one function that builds a table of them change together, column by column.
"""

from __future__ import annotations

import array
import json
import zlib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa

from storage.quality import compute_flags
from storage.spans import KIMI_TOKENS, Spans, SpanTokens, compute_spans_batch, prompts_open_reasoning

#: 2: + ``deterministic``; ``reasoning_tokens``/``num_retractions``/``cached_tokens`` are null when the server
#: did not report them (parts of version 1 read back with ``deterministic`` null).
#: 3: + ``output_logprobs``, ``top_logprob_ids``, ``top_logprobs`` (``--logprobs K``; parts of versions 1–2
#: and jobs without logprobs read back null).
#: 4: + ``conversation_id``, ``turn_index``, ``turn_count`` (``--turns all``; null for single-turn jobs and parts
#: of versions 1–3).
#: 5: the reasoning and answer span columns are nullable: null = not recorded (a job run with
#: ``--no-reasoning-spans``), never 0:0; parts of versions 1–4 hold values in every row and read back as they are.
#: 6: + ``epoch`` (the claim's fencing token, thinkfleet/state/ledger.py: per prompt and revision the highest
#: epoch is the committed row, lower ones are *fenced*) and ``ids_crc32`` (CRC-32 of the row's input and output
#: ids, checked by ``producer verify``); both null in parts of versions 1–5.
#: 7: + ``step_index`` and ``tool_args_differ`` (an agentic ``--turns all`` job, ``tool_results`` set:
#: thinkfleet/tool_steps.py; null for other jobs and parts of versions 1–6).
#: 8: + ``chain_end`` (``--turns all``: how the row's conversation chain goes on or ends, thinkfleet/chain_end.py;
#: null for single-turn jobs and parts of versions 1–7, whose ends are judged from Redis' answer records).
#: 9: + ``server_config`` (the digest of the serving SGLang's launch record, ``{job}/_provenance/``:
#: storage/manifest.py) and the speculative-decoding figures ``spec_verify_ct``, ``spec_accepted_tokens``,
#: ``spec_draft_tokens``, ``spec_accept_histogram`` (null without ``--speculative-algorithm``); all null in parts
#: of versions 1–8. Also + ``prefix_reusable_tokens`` (a later turn or tool step: how much of its prompt its previous
#: turn's server had already computed; null for turn 0, single-turn jobs and parts of versions 1–8).
#: 10: + ``image_sha256``, ``image_paths``, ``image_tokens``, ``image_positions`` (an image prompt's images:
#: docs/vision.md; null for text prompts and parts of versions 1–9).
#: 11: + ``expanded_input_ids`` (an image prompt served by SGLang ≥ 0.5.13: the prompt ids the server ran, each
#: placeholder expanded into its image's tokens, as ``return_prompt_token_ids`` returned and the worker checked them;
#: null for text prompts, older servers and parts of versions 1–10).
#: 12: + the quality flags ``loop``, ``loop_period``, ``no_think_end``, ``empty_answer``, ``tool_call_unparsed``
#: (storage/quality.py: decided from the ids and spans when the row is made); null in parts of versions 1–11, whose
#: readers compute them from the same ids (storage/flags.py).
SCHEMA_VERSION = "12"

# -- column names (import these instead of spelling strings) ------------------------------------------
JOB = "job"
DATASET = "dataset"
PROMPT_ID = "prompt_id"
ROW_INDEX = "row_index"
SAMPLE_INDEX = "sample_index"
REVISION = "revision"
ATTEMPT = "attempt"
#: The fencing token of the claim that produced the row (thinkfleet/state/lua/claim.lua mints it from Redis TIME):
#: grows for a prompt across claims, also across a Redis that lost writes. The committed view keeps, per
#: prompt and revision, the row of the highest epoch; null (older parts) reads as 0.
EPOCH = "epoch"
#: CRC-32 of the row's ``input_ids`` then ``output_ids`` as little-endian int32 (:func:`ids_checksums`).
IDS_CRC32 = "ids_crc32"
#: ``--turns all`` (multi-turn regeneration, workers/turns.py): the conversation, this turn (0-based) and how many
#: turns it has; null for single-turn jobs.
CONVERSATION_ID = "conversation_id"
TURN_INDEX = "turn_index"
TURN_COUNT = "turn_count"
#: An agentic job (``tool_results`` set): the step of the turn (0 = the turn's own prompt; j > 0 = after j rounds
#: of tool results), and whether the step's calls' arguments differ from the dataset's (null: no call matched).
STEP_INDEX = "step_index"
TOOL_ARGS_DIFFER = "tool_args_differ"
#: ``--turns all``: "" = the chain goes on (this row's finalize enqueued its next turn or step); "complete" = the
#: conversation's last answer; else the reason the chain ends here (``tool_mismatch``, ``max_tool_steps``,
#: ``tool_error``, ``tool_call``, ``error: …``: :mod:`thinkfleet.chain_end`). Null: not a turn, or written before it.
CHAIN_END = "chain_end"
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"
REASONING_START = "reasoning_start"
REASONING_END = "reasoning_end"
HAS_THINK_END = "has_think_end"
ANSWER_START = "answer_start"
ANSWER_END = "answer_end"
TOOL_CALL_SPANS = "tool_call_spans"
STOP_TOKEN = "stop_token"
FINISH_REASON = "finish_reason"
FINISH_MATCHED = "finish_matched"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
CACHED_TOKENS = "cached_tokens"
#: A later turn (or tool step) of a --turns all job: the longest common prefix of its prompt ids with the previous
#: turn's prompt + output ids — what that turn's server has computed (thinkfleet/broker/affinity.py offers the turn to
#: that host). ``cached_tokens / prefix_reusable_tokens`` is the prefix cache's hit rate. Null: not a later turn.
PREFIX_REUSABLE_TOKENS = "prefix_reusable_tokens"
REASONING_TOKENS = "reasoning_tokens"
NUM_RETRACTIONS = "num_retractions"
LATENCY_S = "latency_s"
WORKER = "worker"
WORKER_HOST = "worker_host"
MODEL = "model"
WEIGHT_VERSION = "weight_version"
SAMPLING_PARAMS = "sampling_params"
SAMPLING_SEED = "sampling_seed"
DETERMINISTIC = "deterministic"
TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
CHAT_TEMPLATE_HASH = "chat_template_hash"
CONTENT_HASH = "content_hash"
CREATED_AT = "created_at"
OUTPUT_LOGPROBS = "output_logprobs"
TOP_LOGPROB_IDS = "top_logprob_ids"
TOP_LOGPROBS = "top_logprobs"
#: The 16-hex digest of the serving SGLang's launch record (workers/sglang.py ``launch_record``): names the
#: ``{job}/_provenance/`` records of that server configuration (storage/manifest.py).
SERVER_CONFIG = "server_config"
#: Speculative decoding (a server run with ``--speculative-algorithm``; null otherwise), as SGLang's finished
#: ``meta_info`` reports them: verify steps, draft tokens accepted (bonus tokens excluded) and proposed
#: (steps × (draft tokens − 1)), and how many steps accepted 0, 1, 2, … drafts. The accept rate is
#: accepted / proposed, the accept length ``completion_tokens`` / ``spec_verify_ct``.
SPEC_VERIFY_CT = "spec_verify_ct"
SPEC_ACCEPTED_TOKENS = "spec_accepted_tokens"
SPEC_DRAFT_TOKENS = "spec_draft_tokens"
SPEC_ACCEPT_HISTOGRAM = "spec_accept_histogram"
#: An image prompt's images in the order of their placeholders (thinkfleet/vision.py ``ImageRef``): each one's
#: sha256 and image-store URI (``{OUTPUT_URI}/{job}/_images/…``, byte-identical to the dataset's file), the tokens
#: SGLang expands its one placeholder into, and that placeholder's index in ``input_ids``. Null for text prompts.
IMAGE_SHA256 = "image_sha256"
IMAGE_PATHS = "image_paths"
IMAGE_TOKENS = "image_tokens"
IMAGE_POSITIONS = "image_positions"
#: The ids the server ran for an image prompt (SGLang ≥ 0.5.13 ``return_prompt_token_ids``): ``input_ids`` with each
#: placeholder repeated ``image_tokens`` times (workers check exactly that). Null where the server did not return them.
EXPANDED_INPUT_IDS = "expanded_input_ids"
#: Quality flags (storage/quality.py has the exact rules): the output ends in a repeated cycle of ids (and the
#: cycle's length, null when it does not), reasoning never closed, nothing after the closed reasoning, a tool-call
#: section whose ids do not parse. Null in parts before schema 12 (storage/flags.py computes them on read).
LOOP = "loop"
LOOP_PERIOD = "loop_period"
NO_THINK_END = "no_think_end"
EMPTY_ANSWER = "empty_answer"
TOOL_CALL_UNPARSED = "tool_call_unparsed"
QUALITY_COLUMNS = (LOOP, LOOP_PERIOD, NO_THINK_END, EMPTY_ANSWER, TOOL_CALL_UNPARSED)

# Non-null list elements: the ids are never null, and saying so lets the Parquet writer skip
# per-element definition levels.
TOKEN_IDS = pa.list_(pa.field("element", pa.int32(), nullable=False))
SPAN = pa.struct([pa.field("start", pa.int32(), nullable=False), pa.field("end", pa.int32(), nullable=False)])
SPAN_LIST = pa.list_(pa.field("element", SPAN, nullable=False))
TIMESTAMP = pa.timestamp("us", tz="UTC")
#: ``--logprobs K``: one float32 per output id; top-K ids / logprobs per output id (best first).
LOGPROBS = pa.list_(pa.field("element", pa.float32(), nullable=False))
TOP_IDS = pa.list_(pa.field("element", TOKEN_IDS, nullable=False))
TOP_LOGPROBS_TYPE = pa.list_(pa.field("element", LOGPROBS, nullable=False))
#: A list of counts (``spec_accept_histogram``).
COUNTS = pa.list_(pa.field("element", pa.int32(), nullable=False))
#: A list of texts (``image_sha256``, ``image_paths``).
TEXTS = pa.list_(pa.field("element", pa.string(), nullable=False))
#: ``dataset`` is a string column that Arrow holds dictionary-encoded. On disk it is a plain UTF-8
#: string, but Arrow readers restore the dictionary type, and that is what pyarrow infers for the
#: hive directory ``dataset=…``: so ``pq.read_table(job_dir)`` / ``pd.read_parquet(job_dir)`` merge
#: the directory key with the file column instead of failing on "string vs dictionary". pandas sees
#: a category, polars a Categorical, duckdb and HF ``datasets`` a plain string.
DATASET_TYPE = pa.dictionary(pa.int32(), pa.string())

SCHEMA = pa.schema(
    [
        # -- identity: which prompt this is ---------------------------------------------------------
        pa.field(JOB, pa.string(), nullable=False),  # job name (`producer submit --job`)
        pa.field(DATASET, DATASET_TYPE, nullable=False),  # source dataset name; also the dir `dataset=`
        pa.field(PROMPT_ID, pa.string(), nullable=False),  # unique within the job; THE dedupe key
        pa.field(ROW_INDEX, pa.int64(), nullable=False),  # row in the source dataset file
        pa.field(SAMPLE_INDEX, pa.int32(), nullable=False),  # which sample of the prompt (--samples > 1)
        pa.field(REVISION, pa.int32(), nullable=False),  # bumped by `producer retry`; highest wins
        pa.field(ATTEMPT, pa.int32(), nullable=False),  # 1-based attempt that produced this row
        pa.field(EPOCH, pa.int64()),  # the claim's fencing token; per prompt and revision the highest wins
        pa.field(CONVERSATION_ID, pa.string()),  # --turns all: the source conversation (turn prompt ids: …/t{i})
        pa.field(TURN_INDEX, pa.int32()),  # --turns all: 0-based turn
        pa.field(TURN_COUNT, pa.int32()),  # --turns all: turns of the conversation
        pa.field(STEP_INDEX, pa.int32()),  # agentic jobs: the step within the turn (…/t{i}s{j}; 0 = …/t{i})
        pa.field(TOOL_ARGS_DIFFER, pa.bool_()),  # agentic jobs: the calls' arguments differ from the dataset's
        pa.field(CHAIN_END, pa.string()),  # --turns all: "" goes on, "complete", or why the chain ends here
        # -- tokens: exactly what went in and came out ----------------------------------------------
        pa.field(INPUT_IDS, TOKEN_IDS, nullable=False),  # prompt ids sent to /generate (ends with <think>)
        pa.field(OUTPUT_IDS, TOKEN_IDS, nullable=False),  # every generated id, stop token included
        # -- spans: offsets into output_ids, half-open [start, end) (storage/spans.py) --------------
        # The reasoning and answer spans are null when not recorded (--no-reasoning-spans).
        pa.field(REASONING_START, pa.int32()),  # 0 when the prompt opens reasoning (ends with <think>)
        pa.field(REASONING_END, pa.int32()),  # at </think> / tool section / end
        pa.field(HAS_THINK_END, pa.bool_()),  # </think> emitted (output_ids[reasoning_end])
        pa.field(ANSWER_START, pa.int32()),  # after </think>
        pa.field(ANSWER_END, pa.int32()),  # at the tool section or the stop token
        pa.field(TOOL_CALL_SPANS, SPAN_LIST, nullable=False),  # <|tool_call_begin|> … <|tool_call_end|> incl.
        pa.field(STOP_TOKEN, pa.int32()),  # the trailing stop id (163586 <|im_end|>), null when none
        # -- how it finished (SGLang meta_info.finish_reason) ---------------------------------------
        pa.field(FINISH_REASON, pa.string(), nullable=False),  # stop | length | abort
        pa.field(FINISH_MATCHED, pa.string()),  # finish_reason.matched as text (id or stop string)
        # -- usage (meta_info) ----------------------------------------------------------------------
        pa.field(PROMPT_TOKENS, pa.int32(), nullable=False),  # defaults to len(input_ids)
        pa.field(COMPLETION_TOKENS, pa.int32(), nullable=False),  # must equal len(output_ids)
        pa.field(CACHED_TOKENS, pa.int32()),  # prefix-cache hits; null if the server didn't say
        pa.field(PREFIX_REUSABLE_TOKENS, pa.int32()),  # later turns: prompt ids the previous turn's server computed
        pa.field(REASONING_TOKENS, pa.int32()),  # SGLang's count (incl. </think>); null before 0.5.10 (unreported)
        pa.field(NUM_RETRACTIONS, pa.int32()),  # retractions under memory pressure (total_/num_retractions)
        pa.field(LATENCY_S, pa.float64()),  # request send → response, seconds, as the worker saw it
        # -- provenance: what produced the row ------------------------------------------------------
        pa.field(WORKER, pa.string(), nullable=False),  # worker identity (hostname-pid or --name)
        pa.field(WORKER_HOST, pa.string()),  # host name of the worker
        pa.field(MODEL, pa.string()),  # served model path/name (SGLang /get_model_info)
        pa.field(WEIGHT_VERSION, pa.string()),  # meta_info.weight_version
        pa.field(SAMPLING_PARAMS, pa.string()),  # JSON of the sampling params sent (sorted keys)
        pa.field(SAMPLING_SEED, pa.int64()),  # per-request seed if one was sent, else null
        # server ran --enable-deterministic-inference (only then is sampling_seed honoured); null = unknown
        pa.field(DETERMINISTIC, pa.bool_()),
        pa.field(TOKENIZER_FINGERPRINT, pa.string()),  # hash of the tokenizer files used to tokenize
        pa.field(CHAT_TEMPLATE_HASH, pa.string()),  # hash of the chat template that rendered the prompt
        pa.field(SERVER_CONFIG, pa.string()),  # the serving SGLang's launch record ({job}/_provenance/); null < v9
        pa.field(CONTENT_HASH, pa.string()),  # hash of the prompt ids; ties the row to its submit
        pa.field(IDS_CRC32, pa.int64()),  # CRC-32 of input_ids + output_ids (int32 LE); verify recomputes it
        pa.field(CREATED_AT, TIMESTAMP, nullable=False),  # when the row was built (UTC)
        # -- logprobs (--logprobs K; null when the job did not ask): aligned with output_ids ----------
        pa.field(OUTPUT_LOGPROBS, LOGPROBS),  # the sampled token's logprob (as SGLang sampled: after temperature)
        pa.field(TOP_LOGPROB_IDS, TOP_IDS),  # K > 0: the top-K ids at each output position
        pa.field(TOP_LOGPROBS, TOP_LOGPROBS_TYPE),  # K > 0: their logprobs
        # -- speculative decoding (--speculative-algorithm on the server; null otherwise) -----------------
        pa.field(SPEC_VERIFY_CT, pa.int32()),  # verify steps (meta_info.spec_verify_ct)
        pa.field(SPEC_ACCEPTED_TOKENS, pa.int32()),  # draft tokens accepted (bonus tokens excluded)
        pa.field(SPEC_DRAFT_TOKENS, pa.int32()),  # draft tokens proposed
        pa.field(SPEC_ACCEPT_HISTOGRAM, COUNTS),  # [i] = verify steps that accepted i drafts
        # -- images (an image prompt; null for text prompts): one entry per placeholder, in order ------------
        pa.field(IMAGE_SHA256, TEXTS),  # sha256 of each image's bytes
        pa.field(IMAGE_PATHS, TEXTS),  # where the image store keeps them
        pa.field(IMAGE_TOKENS, COUNTS),  # tokens SGLang expands each placeholder into
        pa.field(IMAGE_POSITIONS, COUNTS),  # index of each placeholder in input_ids
        pa.field(EXPANDED_INPUT_IDS, TOKEN_IDS),  # the server's expanded prompt ids (SGLang >= 0.5.13)
        # -- quality flags (storage/quality.py; null before schema 12) -----------------------------------------
        pa.field(LOOP, pa.bool_()),  # the output ends in a repeated cycle of 1–64 ids
        pa.field(LOOP_PERIOD, pa.int32()),  # that cycle's length; null when no loop
        pa.field(NO_THINK_END, pa.bool_()),  # reasoning never closed (null: spans not recorded)
        pa.field(EMPTY_ANSWER, pa.bool_()),  # closed reasoning, then no answer and no tool call (null: not recorded)
        pa.field(TOOL_CALL_UNPARSED, pa.bool_()),  # a tool call or section without its end marker
    ],
    metadata={"thinkfleet.schema_version": SCHEMA_VERSION},
)

#: The submit manifest (``{job}/_manifest/submitted-*.parquet``): what the producer enqueued.
SUBMITTED_AT = "submitted_at"
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field(PROMPT_ID, pa.string(), nullable=False),
        pa.field(DATASET, pa.string(), nullable=False),
        pa.field(ROW_INDEX, pa.int64(), nullable=False),
        pa.field(SAMPLE_INDEX, pa.int32(), nullable=False),
        pa.field(CONTENT_HASH, pa.string(), nullable=False),
        pa.field(PROMPT_TOKENS, pa.int32()),
        pa.field(SUBMITTED_AT, TIMESTAMP, nullable=False),  # the latest submit of a prompt id wins
    ],
    metadata={"thinkfleet.schema_version": SCHEMA_VERSION},
)

TOKEN_COLUMNS = (INPUT_IDS, OUTPUT_IDS)
SPAN_COLUMNS = (REASONING_START, REASONING_END, HAS_THINK_END, ANSWER_START, ANSWER_END, TOOL_CALL_SPANS)
#: Where reasoning ends and the answer starts: null in every row of a job run with ``--no-reasoning-spans``
#: (the job's markers cannot tell), so "not recorded" never reads as "no reasoning" (0:0).
REASONING_SPAN_COLUMNS = SPAN_COLUMNS[:5]

#: Parquet writer options for SCHEMA: zstd; dictionaries only for the repetitive strings (token ids
#: are PLAIN: a vocabulary of 163k ids makes dictionary pages churn); statistics only where they help
#: pruning. Token ids could use BYTE_STREAM_SPLIT (see BSS_TOKEN_ENCODING): zstd runs faster on
#: it and files shrink ~12%, but readers need Parquet 2.11 support for INT32 — pyarrow >= 16 and
#: polars have it, DuckDB only since mid-2026 (duckdb/duckdb#24175) — so the default stays PLAIN.
WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": [
        JOB,
        DATASET,
        FINISH_REASON,
        FINISH_MATCHED,
        WORKER,
        WORKER_HOST,
        MODEL,
        WEIGHT_VERSION,
        SAMPLING_PARAMS,
        TOKENIZER_FINGERPRINT,
        CHAT_TEMPLATE_HASH,
        SERVER_CONFIG,
    ],
    "write_statistics": [PROMPT_ID, ROW_INDEX, REVISION, CREATED_AT, COMPLETION_TOKENS],
    # Page CRCs: a flipped bit in a stored page is an error on read (storage/reader.py verifies them), not a silently
    # altered id.
    "write_page_checksum": True,
}
#: Opt-in ``column_encoding`` for WRITE_OPTIONS (measured in bench/bench_storage.py).
BSS_TOKEN_ENCODING: dict[str, str] = {f"{c}.list.element": "BYTE_STREAM_SPLIT" for c in TOKEN_COLUMNS}


def span_values(spans: Spans, tokens: SpanTokens) -> dict[str, Any]:
    """One row's span columns from its :class:`Spans` (what a worker puts in its row dict): the reasoning and
    answer spans are None (null: not recorded) when the job runs without reasoning spans."""
    recorded = tokens.reasoning_spans
    values: dict[str, Any] = {
        REASONING_START: spans.reasoning_start,
        REASONING_END: spans.reasoning_end,
        HAS_THINK_END: spans.has_think_end,
        ANSWER_START: spans.answer_start,
        ANSWER_END: spans.answer_end,
    }
    if not recorded:
        values = dict.fromkeys(values)
    values[TOOL_CALL_SPANS] = [{"start": s, "end": e} for s, e in spans.tool_call_spans]
    values[STOP_TOKEN] = spans.stop_token
    return values


# Values used when a row dict leaves a column out. Required columns have none and must be given.
_DEFAULTS: dict[str, Any] = {SAMPLE_INDEX: 0, REVISION: 0, ATTEMPT: 1}


def rows_to_table(
    rows: Sequence[Mapping[str, Any]],
    *,
    defaults: Mapping[str, Any] | None = None,
    tokens: SpanTokens = KIMI_TOKENS,
) -> pa.Table:
    """Row dicts (keys = column names) → a table with exactly :data:`SCHEMA`.

    - ``input_ids``/``output_ids`` may be lists of ints or numpy integer arrays.
    - Span columns given in every row are taken as given (the worker knows its tokenizer's ids);
      otherwise they are computed here for the whole batch with ``tokens``, a prompt that opens reasoning
      (:func:`storage.spans.prompt_opens_reasoning`) starting it at 0. ``tool_call_spans`` entries
      may be ``(start, end)`` tuples or ``{"start", "end"}`` dicts. With ``tokens.reasoning_spans`` off
      (``--no-reasoning-spans``) the reasoning and answer spans are null, whatever the rows say.
    - ``finish_reason`` may be SGLang's dict (``{"type": …, "matched": …}``) or its type string.
    - ``sampling_params`` may be a dict (JSON-encoded, sorted keys) or a JSON string.
    - ``created_at`` may be a datetime (naive = UTC), epoch seconds, or absent (= now).
    - ``defaults`` fills columns missing from a row (e.g. ``{"job": …, "worker": …}``).
    """
    n = len(rows)
    fill = {**_DEFAULTS, **(defaults or {})}
    columns: dict[str, pa.Array] = {}

    in_values, in_offsets = _ids(rows, INPUT_IDS)
    out_values, out_offsets = _ids(rows, OUTPUT_IDS)
    columns[INPUT_IDS] = pa.ListArray.from_arrays(in_offsets, in_values, type=TOKEN_IDS)
    columns[OUTPUT_IDS] = pa.ListArray.from_arrays(out_offsets, out_values, type=TOKEN_IDS)
    columns.update(_span_columns(rows, in_values, in_offsets, out_values, out_offsets, tokens))
    columns.update(_quality_columns(rows, columns, in_values, in_offsets, out_values, out_offsets, tokens))
    if not tokens.reasoning_spans:
        for name in REASONING_SPAN_COLUMNS:
            columns[name] = pa.nulls(n, columns[name].type)

    finish = [r.get(FINISH_REASON, fill.get(FINISH_REASON)) for r in rows]
    if any(isinstance(f, Mapping) for f in finish):
        matched = [f.get("matched") if isinstance(f, Mapping) else None for f in finish]
        finish = [f.get("type") if isinstance(f, Mapping) else f for f in finish]
        given = [r.get(FINISH_MATCHED) for r in rows]
        columns[FINISH_MATCHED] = pa.array(
            [g if g is not None else (None if m is None else str(m)) for g, m in zip(given, matched, strict=True)],
            pa.string(),
        )
    columns[FINISH_REASON] = pa.array(finish, pa.string())
    columns[PROMPT_TOKENS] = _int_or(rows, PROMPT_TOKENS, np.diff(in_offsets), fill)
    columns[COMPLETION_TOKENS] = _int_or(rows, COMPLETION_TOKENS, np.diff(out_offsets), fill)
    columns[SAMPLING_PARAMS] = pa.array(_json_strings(rows, fill.get(SAMPLING_PARAMS)), pa.string())
    columns[CREATED_AT] = _timestamps(rows, fill.get(CREATED_AT))
    columns[IDS_CRC32] = pa.array(ids_checksums(in_values, in_offsets, out_values, out_offsets), pa.int64())

    rest = [f for f in SCHEMA if f.name not in columns]
    for field, values in zip(rest, _transpose(rows, [f.name for f in rest], fill), strict=True):
        columns[field.name] = pa.array(values, field.type)

    arrays = [columns[f.name] for f in SCHEMA]
    for field, arr in zip(SCHEMA, arrays, strict=True):
        if not field.nullable and arr.null_count:
            i = arr.is_null().to_numpy(zero_copy_only=False).argmax()
            raise ValueError(
                f"column {field.name!r} is required but row {i} (prompt_id="
                f"{rows[i].get(PROMPT_ID, fill.get(PROMPT_ID))!r}) has none: set it in the row or pass "
                f"rows_to_table(..., defaults={{{field.name!r}: ...}})"
            )
    table = pa.Table.from_arrays(arrays, schema=SCHEMA)
    assert table.num_rows == n
    return table


def ids_checksums(
    in_values: np.ndarray, in_offsets: np.ndarray, out_values: np.ndarray, out_offsets: np.ndarray
) -> list[int]:
    """Per row, CRC-32 of its input ids then its output ids as little-endian int32 bytes: a bit flipped in a
    stored id (storage, a copy, a bad disk) is found by recomputing it (storage/checks.py)."""
    ins = np.ascontiguousarray(in_values, dtype="<i4").tobytes()
    outs = np.ascontiguousarray(out_values, dtype="<i4").tobytes()
    crc = zlib.crc32
    out: list[int] = []
    for i in range(len(in_offsets) - 1):
        a, b = int(in_offsets[i]) * 4, int(in_offsets[i + 1]) * 4
        c, d = int(out_offsets[i]) * 4, int(out_offsets[i + 1]) * 4
        out.append(crc(outs[c:d], crc(ins[a:b])))
    return out


def table_ids_checksums(table: pa.Table) -> np.ndarray:
    """:func:`ids_checksums` recomputed from a table's ``input_ids``/``output_ids`` columns."""

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table[name].combine_chunks() if table.num_rows else pa.array([], TOKEN_IDS)
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False)
        return values[offsets[0] : offsets[-1]], offsets - offsets[0]

    iv, io = flat(INPUT_IDS)
    ov, oo = flat(OUTPUT_IDS)
    return np.asarray(ids_checksums(iv, io, ov, oo), dtype=np.int64)


def _transpose(rows: Sequence[Mapping[str, Any]], names: list[str], fill: Mapping[str, Any]) -> list[Sequence[Any]]:
    """Row dicts → one value list per name. Rows that carry every name (the worker's do) take a
    C-level path — one itemgetter call per row and a zip — about 10x faster than a comprehension
    per column; otherwise missing names fall back to ``fill``."""
    if len(names) > 1 and rows:
        try:
            return list(zip(*map(itemgetter(*names), rows), strict=True))
        except KeyError:
            pass
    return [[r.get(name, fill.get(name)) for r in rows] for name in names]


def _ids(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[np.ndarray, np.ndarray]:
    """One token column → (flat int32 ids, int32 offsets), without a Python loop over ids."""
    seqs = [r.get(name) for r in rows]
    kinds = set(map(type, seqs))
    if type(None) in kinds:
        i = next(i for i, seq in enumerate(seqs) if seq is None)
        raise ValueError(f"row {i} (prompt_id={rows[i].get(PROMPT_ID)!r}) has no {name!r}")
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError(f"{name}: {offsets[-1]} ids in one batch overflow int32 offsets; write smaller parts")
    if not seqs:
        flat = np.zeros(0, dtype=np.int32)
    elif kinds == {np.ndarray}:
        flat = np.concatenate(seqs)
    elif np.ndarray not in kinds:
        # array('i').fromlist is the cheapest list[int] → int32 buffer CPython offers, and it
        # rejects ids outside int32 instead of wrapping them.
        buf = array.array("i")
        try:
            for s in seqs:
                buf.fromlist(s if isinstance(s, list) else list(s))
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"{name}: a token id is not an int32 ({exc}); ids must be 0 <= id < 2**31") from exc
        flat = np.frombuffer(buf, dtype=np.int32)
    else:
        flat = np.concatenate([np.asarray(s) for s in seqs])
    if flat.dtype != np.int32:
        if len(flat) and (flat.min() < 0 or flat.max() >= 2**31):
            raise ValueError(f"{name}: token ids must be 0 <= id < 2**31")
        flat = flat.astype(np.int32)
    elif len(flat) and flat.min() < 0:
        raise ValueError(f"{name}: negative token id in row {np.searchsorted(offsets, flat.argmin(), 'right') - 1}")
    return flat, offsets.astype(np.int32)


def _span_columns(
    rows: Sequence[Mapping[str, Any]],
    in_values: np.ndarray,
    in_offsets: np.ndarray,
    out_values: np.ndarray,
    out_offsets: np.ndarray,
    tokens: SpanTokens,
) -> dict[str, pa.Array]:
    if rows and all(all(c in r for c in SPAN_COLUMNS) for r in rows):
        return _given_spans(rows)
    # A prompt rendered in thinking mode ends with <think> (or <think>\n): the output starts inside reasoning.
    opens = prompts_open_reasoning(in_values, in_offsets, tokens)
    s = compute_spans_batch(out_values, out_offsets, opens, tokens)
    stop = pa.array(s.stop_token.astype(np.int32), mask=s.stop_token < 0)
    return {
        REASONING_START: pa.array(s.reasoning_start),
        REASONING_END: pa.array(s.reasoning_end),
        HAS_THINK_END: pa.array(s.has_think_end),
        ANSWER_START: pa.array(s.answer_start),
        ANSWER_END: pa.array(s.answer_end),
        TOOL_CALL_SPANS: _span_list(s.tool_call_offsets, s.tool_call_starts, s.tool_call_ends),
        STOP_TOKEN: stop,
    }


def _quality_columns(
    rows: Sequence[Mapping[str, Any]],
    columns: Mapping[str, pa.Array],
    in_values: np.ndarray,
    in_offsets: np.ndarray,
    out_values: np.ndarray,
    out_offsets: np.ndarray,
    tokens: SpanTokens,
) -> dict[str, pa.Array]:
    """The quality flag columns (storage/quality.py) of rows whose span columns are built: as the rows give them
    when every row does (a worker's rows: storage.quality.row_flags), else computed here for the whole batch."""
    if rows and all(all(c in r for c in QUALITY_COLUMNS) for r in rows):
        kinds = {LOOP_PERIOD: pa.int32()}
        return {c: pa.array([r[c] for r in rows], kinds.get(c, pa.bool_())) for c in QUALITY_COLUMNS}

    def ints(name: str) -> np.ndarray:
        return columns[name].fill_null(0).to_numpy(zero_copy_only=False)

    calls = columns[TOOL_CALL_SPANS]
    flags = compute_flags(
        out_values,
        out_offsets,
        opens=prompts_open_reasoning(in_values, in_offsets, tokens),
        reasoning_start=ints(REASONING_START),
        reasoning_end=ints(REASONING_END),
        has_think_end=columns[HAS_THINK_END].fill_null(False).to_numpy(zero_copy_only=False),
        answer_start=ints(ANSWER_START),
        answer_end=ints(ANSWER_END),
        tool_call_offsets=calls.offsets.to_numpy(),
        tool_call_ends=calls.flatten().field("end").to_numpy(zero_copy_only=False),
        has_stop=columns[STOP_TOKEN].is_valid().to_numpy(zero_copy_only=False),
        tokens=tokens,
    )
    looped = flags.loop_period > 0
    recorded = tokens.reasoning_spans
    return {
        LOOP: pa.array(looped),
        LOOP_PERIOD: pa.array(flags.loop_period, pa.int32(), mask=~looped),
        NO_THINK_END: pa.array(flags.no_think_end) if recorded else pa.nulls(len(looped), pa.bool_()),
        EMPTY_ANSWER: pa.array(flags.empty_answer) if recorded else pa.nulls(len(looped), pa.bool_()),
        TOOL_CALL_UNPARSED: pa.array(flags.tool_call_unparsed),
    }


def _given_spans(rows: Sequence[Mapping[str, Any]]) -> dict[str, pa.Array]:
    starts: list[int] = []
    ends: list[int] = []
    counts: list[int] = []
    for r in rows:
        calls = r[TOOL_CALL_SPANS] or ()
        counts.append(len(calls))
        for c in calls:
            if isinstance(c, Mapping):
                starts.append(c["start"])
                ends.append(c["end"])
            else:
                starts.append(c[0])
                ends.append(c[1])
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    i32 = pa.int32()
    return {
        REASONING_START: pa.array([r[REASONING_START] for r in rows], i32),
        REASONING_END: pa.array([r[REASONING_END] for r in rows], i32),
        HAS_THINK_END: pa.array([r[HAS_THINK_END] for r in rows], pa.bool_()),
        ANSWER_START: pa.array([r[ANSWER_START] for r in rows], i32),
        ANSWER_END: pa.array([r[ANSWER_END] for r in rows], i32),
        TOOL_CALL_SPANS: _span_list(offsets, np.asarray(starts, dtype=np.int32), np.asarray(ends, dtype=np.int32)),
        STOP_TOKEN: pa.array([r.get(STOP_TOKEN) for r in rows], i32),
    }


def _span_list(offsets: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> pa.Array:
    structs = pa.StructArray.from_arrays([pa.array(starts, pa.int32()), pa.array(ends, pa.int32())], fields=list(SPAN))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, type=SPAN_LIST)


def _int_or(rows: Sequence[Mapping[str, Any]], name: str, fallback: np.ndarray, fill: Mapping[str, Any]) -> pa.Array:
    """An int column whose missing values fall back to a computed per-row value (e.g. a length)."""
    default = fill.get(name)
    values = [r.get(name, default) for r in rows]
    if any(v is None for v in values):
        values = [int(f) if v is None else v for v, f in zip(values, fallback.tolist(), strict=True)]
    return pa.array(values, pa.int32())


def _json_strings(rows: Sequence[Mapping[str, Any]], default: Any) -> list[str | None]:
    """Sampling params as JSON text; a batch usually shares one dict object, so encode it once."""
    cache: dict[int, str] = {}
    out: list[str | None] = []
    for r in rows:
        value = r.get(SAMPLING_PARAMS, default)
        if value is None or isinstance(value, str):
            out.append(value)
            continue
        key = id(value)
        if key not in cache:
            cache[key] = json.dumps(value, sort_keys=True)
        out.append(cache[key])
    return out


def _timestamps(rows: Sequence[Mapping[str, Any]], default: Any) -> pa.Array:
    now = datetime.now(UTC)
    values = [r.get(CREATED_AT, default) for r in rows]
    if all(isinstance(v, datetime) for v in values):
        return pa.array(values, TIMESTAMP)
    micros = []
    for v in values:
        if v is None:
            v = now
        if isinstance(v, datetime):
            v = v.replace(tzinfo=UTC) if v.tzinfo is None else v
            micros.append(int(v.timestamp() * 1_000_000))
        else:
            micros.append(int(float(v) * 1_000_000))
    return pa.array(micros, pa.int64()).cast(TIMESTAMP)
