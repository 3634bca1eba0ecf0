"""The text formats' shared part: each row as a chat record, decoded from the stored ids.

A record is ``{"id", "dataset", KEY: [...source conversation..., {"role": "assistant", "reasoning_content",
"content", "tool_calls"}], "tools"?, "finish_reason", "has_think_end", "prompt_ids", "output_ids"}``; the
format names ``KEY``. The source conversation is the one the producer rendered (the submit manifest keeps it,
:mod:`storage.manifest`); the generated turn is decoded span by span with the job's tokenizer and marker ids
(:mod:`storage.conversations`), for any model family. ``--turns all`` jobs: a later turn's source conversation
is the conversation record (Redis) with the model's own earlier answers, decoded from the stored rows of the
earlier turns (:func:`turn_history`).

The ids are ``prompt_ids``/``output_ids``, never ``input_ids``: a top-level ``input_ids`` makes SpecForge (and
TRL) treat a record as pre-tokenized. ``exclude_reasoning`` drops ``reasoning_content``; a job run with
``--no-reasoning-spans`` puts the whole output (up to the tool calls, stop token excluded) in ``content``.

The tokenizer (``--tokenizer``, else the path the job record names — which anyone who can write Redis can
change) is loaded from local files only, and one that ships its own code is refused unless
``trust_remote_code``: export never runs code it was not told to. It is loaded before anything else is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from storage import conversations, jobstate, layout, manifest
from storage.exports.base import (
    COLUMNS,
    ExportError,
    ExportFormat,
    ExportResult,
    Files,
    LengthCheck,
    Rows,
    need_reasoning_spans,
)
from storage.exports.images import ImageBytes
from storage.exports.tool_steps import agentic_histories, is_step
from storage.schema import (
    ANSWER_END,
    ANSWER_START,
    CONTENT_HASH,
    CONVERSATION_ID,
    DATASET,
    FINISH_REASON,
    HAS_THINK_END,
    IMAGE_POSITIONS,
    IMAGE_SHA256,
    IMAGE_TOKENS,
    INPUT_IDS,
    OUTPUT_IDS,
    PROMPT_ID,
    REASONING_END,
    REASONING_START,
    STOP_TOKEN,
    TOOL_CALL_SPANS,
    TURN_INDEX,
)
from thinkfleet.redis_client import sync_client
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord

#: Records held before they are written (the tables are sized by their stored columns; ``--image-urls data`` puts
#: each image's bytes in its record).
_RECORDS_HELD = 32
_TEXT_COLUMNS = [*COLUMNS, STOP_TOKEN, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX, IMAGE_SHA256, IMAGE_TOKENS,
                 IMAGE_POSITIONS]  # fmt: skip


class TextFormat(ExportFormat):
    """A chat-record JSONL format; a subclass names the key its messages go under, and how an image prompt's
    images are written (:meth:`with_images`)."""

    key: ClassVar[str]
    takes_image_urls = True

    def with_images(self, record: dict[str, Any], images: ImageBytes) -> str | None:
        """Write an image prompt's images into ``record`` (its source messages still hold the manifest's image
        parts, storage/exports/images.py); a reason to leave the row out instead, or None."""
        raise NotImplementedError

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        opts = self.options
        tok = load_tokenizer(opts.tokenizer or _job_tokenizer(rows.settings, rows.job), opts.trust_remote_code)
        record = _job_record(rows.settings, rows.job, result)
        settings = rows.settings
        # Each batch's source conversations are looked up with it: never the whole job's in memory.
        lookup = manifest.SourceLookup(settings.output_uri, rows.job, rows.datasets, settings.s3_endpoint_url)
        convs = _ConversationRecords(settings, rows.job)
        _check_sources(rows, lookup, convs)
        markers = conversations.ToolMarkers.of(record)
        # By the stored ids: the consumer re-renders the text, so its count differs a little (see docs/exports.md).
        lengths = LengthCheck(self.max_length)
        images = ImageBytes(settings.s3_endpoint_url)
        with Files(loc, ".jsonl", opts.shard_rows, result) as files:
            # A conversation's turns in one table (a later turn's history is decoded from the earlier ones); small
            # tables, since each becomes Python objects.
            for table in rows.tables(_TEXT_COLUMNS, filtered=False, batch_share=64, group_turns=True):
                if opts.exclude_reasoning:
                    need_reasoning_spans(table, "--exclude-reasoning")
                everything = table.to_pylist()
                sources = lookup.get(table[PROMPT_ID].to_pylist())
                histories = _histories(everything, convs, tok, markers, opts.exclude_reasoning)
                keep = self._kept(table, rows, everything, histories, result)
                ids: list[str] = []
                sizes: list[int] = []
                records: list[dict[str, Any]] = []
                for row in everything:
                    if row[PROMPT_ID] not in keep:
                        continue
                    record = _text_record(
                        row, sources, tok, markers, self.key, opts.exclude_reasoning, histories.get(row[PROMPT_ID])
                    )
                    why = self.with_images(record, images) if row.get(IMAGE_SHA256) else None
                    if why:  # an image prompt this format's consumer cannot hold: counted, named in a warning
                        result.skipped[why] = result.skipped.get(why, 0) + 1
                        continue
                    ids.append(row[PROMPT_ID])
                    sizes.append(len(row[INPUT_IDS]) + len(row[OUTPUT_IDS]))
                    records.append(record)
                    if len(records) == _RECORDS_HELD:  # (inline images: a record may hold megabytes)
                        files.write_lines(json.dumps(r, ensure_ascii=False) for r in records)
                        records.clear()
                files.write_lines(json.dumps(r, ensure_ascii=False) for r in records)
                lengths.add(ids, np.array(sizes, dtype=np.int64))
        lengths.report(result, self.length_advice)

    @staticmethod
    def _kept(
        table: pa.Table,
        rows: Rows,
        everything: list[dict[str, Any]],
        histories: dict[str, tuple[list[dict[str, Any]], Any]],
        result: ExportResult,
    ) -> set[str]:
        """The prompt ids to write: the filters' (read unfiltered, since a later turn's history needs the earlier
        turns' rows even when those are filtered out), less the later turns with no earlier turn stored."""
        keep = set(rows.filter(table)[PROMPT_ID].to_pylist() if len(table) else [])
        later = (r for r in everything if r.get(TURN_INDEX) or is_step(r[PROMPT_ID]))
        orphans = {r[PROMPT_ID] for r in later if r[PROMPT_ID] not in histories}
        if orphans & keep:  # an earlier turn of theirs is not stored: no history to show them with
            result.skipped["no_earlier_turn"] = result.skipped.get("no_earlier_turn", 0) + len(orphans & keep)
            keep -= orphans
        return keep


def _check_sources(rows: Rows, lookup: manifest.SourceLookup, convs: _ConversationRecords) -> None:
    """Every row has its source conversation: checked for every dataset before anything is written (cheap
    columns), so a missing one fails the export instead of leaving it half-done."""
    missing, no_conversation = [], []
    for table in rows.tables([PROMPT_ID, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX], filtered=False, batch_share=64):
        sources = lookup.get(table[PROMPT_ID].to_pylist())
        cols = (table[c].to_pylist() for c in (PROMPT_ID, CONTENT_HASH, CONVERSATION_ID, TURN_INDEX))
        for pid, digest, conv, turn in zip(*cols, strict=True):
            if turn or is_step(pid):  # a later turn (or step) of --turns all: its history is the conversation
                if convs.get(conv) is None:
                    no_conversation.append(pid)
            elif (pid, digest) not in sources:
                missing.append(pid)
    if missing:
        raise ExportError(
            f"{len(missing)} rows (e.g. {', '.join(missing[:3])}) have no source conversation in the submit "
            f"manifest ({rows.settings.output_uri}/{rows.job}/_manifest/): the job was submitted before manifests "
            "kept it, or with other inputs. Re-run the same `producer submit` (it enqueues nothing that is done "
            "and records the conversations), then export again"
        )
    if no_conversation:
        raise ExportError(
            f"{len(no_conversation)} later turns of --turns all conversations (e.g. {', '.join(no_conversation[:3])}) "
            f"have no conversation record in Redis ({convs.error or 'not in the job'}): their history is "
            "rendered from it. Export while the job's Redis state is there"
        )


class _ConversationRecords:
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
            client = sync_client(self.settings.redis_url, timeout_s=10)
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
    convs: _ConversationRecords,
    tok: conversations.Decoder,
    markers: conversations.ToolMarkers,
    exclude_reasoning: bool,
) -> dict[str, tuple[list[dict[str, Any]], Any]]:
    """prompt id → (source messages, tools), for every later turn (turn_index ≥ 1) among ``rows`` (one dataset: all the
    turns of a conversation). The earlier answers are decoded from the stored rows of the earlier turns —
    filtered out or not — as the worker decoded them to render the turn."""
    out, rows = agentic_histories(rows, convs, exclude_reasoning)  # agentic jobs: storage/exports/tool_steps.py
    by_conv: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        if row.get(CONVERSATION_ID) is not None and row.get(TURN_INDEX) is not None:
            by_conv.setdefault(row[CONVERSATION_ID], {})[row[TURN_INDEX]] = row
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
    if row.get(IMAGE_SHA256):  # what a consumer needs to expand each placeholder of prompt_ids (docs/vision.md)
        record.update({c: row[c] for c in (IMAGE_SHA256, IMAGE_TOKENS, IMAGE_POSITIONS)})
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
