"""The job record has one decoder with one set of defaults, and every reader gets the same answer."""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import redis
import redis.asyncio as aioredis

from producer.job import JobRecord as ProducerJobRecord
from storage import jobstate
from storage.spans import SpanTokens as StorageSpanTokens
from storage.spans import compute_spans, compute_spans_batch
from thinkfleet import kimi
from thinkfleet.keys import Keys
from thinkfleet.settings import Settings
from thinkfleet.state.job import DEFAULT_MAX_NEW_TOKENS, MARKER_FIELDS, JobRecord, sampling_params
from thinkfleet.tokens import KIMI_TOKENS, SpanTokens
from workers.jobs import JobCache, JobSpec

# A tokenizer with </think> but no tool-call tokens: 7 and 8 are its think markers.
NO_TOOLS = {
    "think_start_id": 7,
    "think_end_id": 8,
    "tool_section_begin_id": None,
    "tool_section_end_id": None,
    "tool_call_begin_id": None,
    "tool_call_argument_begin_id": None,
    "tool_call_end_id": None,
}
KIMI_MARKERS = {
    "think_start_id": kimi.THINK_START,
    "think_end_id": kimi.THINK_END,
    "tool_section_begin_id": kimi.TOOL_CALLS_SECTION_BEGIN,
    "tool_section_end_id": kimi.TOOL_CALLS_SECTION_END,
    "tool_call_begin_id": kimi.TOOL_CALL_BEGIN,
    "tool_call_argument_begin_id": kimi.TOOL_CALL_ARGUMENT_BEGIN,
    "tool_call_end_id": kimi.TOOL_CALL_END,
}
# Kimi's tool-call section, which a model without tool tokens may emit as ordinary ids.
KIMI_CALL = [
    kimi.TOOL_CALLS_SECTION_BEGIN,
    kimi.TOOL_CALL_BEGIN,
    31,
    kimi.TOOL_CALL_ARGUMENT_BEGIN,
    32,
    kimi.TOOL_CALL_END,
    kimi.TOOL_CALLS_SECTION_END,
]


def encode(values: dict[str, object]) -> dict[bytes, bytes]:
    """A job HASH as redis-py returns it: bytes keys, JSON-encoded bytes values."""
    return {k.encode(): json.dumps(v).encode() for k, v in values.items()}


def test_to_hash_then_from_hash_gives_the_same_record_for_bytes_and_str() -> None:
    record = JobRecord(
        name="j",
        datasets={"a": 3},
        prompts=3,
        sampling_params=sampling_params(max_new_tokens=512, seed=7),
        expected_model="/models/kimi",
        **NO_TOOLS,
        skipped=[{"location": "a.jsonl:3", "reason": "bad"}],
        skipped_count=1,
    )
    as_str = record.to_hash()
    as_bytes = {k.encode(): v.encode() for k, v in as_str.items()}
    assert JobRecord.from_hash(as_str) == record
    assert JobRecord.from_hash(as_bytes) == record
    assert JobRecord.from_dict(record.to_dict()) == record


def test_unknown_fields_are_ignored() -> None:
    raw = encode({"name": "j", "from_a_newer_producer": {"x": 1}, "samples": 2})
    record = JobRecord.from_hash(raw)
    assert record.name == "j" and record.samples == 2
    assert not hasattr(record, "from_a_newer_producer")


def test_an_old_record_missing_marker_fields_reads_as_kimi() -> None:
    record = JobRecord.from_hash(encode({"name": "old", "sampling_params": {"max_new_tokens": 64}}))
    assert {name: getattr(record, name) for name in MARKER_FIELDS} == KIMI_MARKERS
    assert record.span_tokens() == KIMI_TOKENS
    assert record.max_new_tokens == 64
    assert record.stop_token_ids == list(kimi.DEFAULT_STOP_TOKEN_IDS)


def test_a_present_null_marker_stays_none_and_finds_no_tool_calls() -> None:
    record = JobRecord.from_hash(encode({"name": "j", **NO_TOOLS}))
    assert {name: getattr(record, name) for name in MARKER_FIELDS} == NO_TOOLS
    tokens = record.span_tokens()
    assert tokens.tool_call_begin_id is None and tokens.tool_section_begin_id is None

    ids = [11, 12, 8, 21, *KIMI_CALL, kimi.IM_END]  # reasoning, </think>, then Kimi's ids as plain ids
    one = compute_spans(ids, **{f.name: getattr(tokens, f.name) for f in fields(tokens)})
    assert one.tool_call_spans == ()
    assert one.has_think_end and one.reasoning_end == 2
    assert (one.answer_start, one.answer_end) == (3, len(ids) - 1)  # the answer runs to the stop token

    batch = compute_spans_batch(
        np.array(ids + ids, dtype=np.int64), np.array([0, len(ids), 2 * len(ids)]), True, tokens
    )
    assert batch.row(0) == batch.row(1) == one


def test_spans_with_every_marker_none_find_only_the_stop_token() -> None:
    tokens = SpanTokens(None, None, None, None, None, None, (kimi.IM_END,))
    ids = [kimi.THINK_START, 1, kimi.THINK_END, *KIMI_CALL, kimi.IM_END]
    batch = compute_spans_batch(np.array(ids, dtype=np.int64), np.array([0, len(ids)]), False, tokens)
    row = batch.row(0)
    assert row.tool_call_spans == () and not row.has_think_end
    assert (row.reasoning_start, row.reasoning_end) == (0, 0)
    assert (row.answer_start, row.answer_end) == (0, len(ids) - 1) and row.stop_token == kimi.IM_END
    assert compute_spans(ids, prompt_ends_with_think_start=False, **asdict(tokens)) == row


def test_a_null_in_a_non_nullable_field_reads_as_its_default() -> None:
    record = JobRecord.from_hash(encode({"name": "j", "sampling_params": None, "datasets": None, "samples": None}))
    assert record.sampling_params == {} and record.datasets == {} and record.samples == 1
    assert record.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert record.created_at == record.updated_at == 0.0  # unknown, and the same on every decode


def test_storage_keeps_its_old_names() -> None:
    assert StorageSpanTokens is SpanTokens
    assert ProducerJobRecord is JobRecord


def test_worker_storage_and_producer_agree_on_every_default(redis_url: str, tmp_path: Path) -> None:
    """One hash — old (marker fields absent), hand-written (nulls), and bare — through all three readers."""
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    keys = settings.keys
    client = redis.Redis.from_url(redis_url)
    cases = {
        "old": {"name": "old", "sampling_params": {"temperature": 1.0}},
        "nulls": {"name": "nulls", **NO_TOOLS, "sampling_params": {"stop_token_ids": [5]}, "expected_model": None},
        "bare": {"tokenizer": "t"},  # no name either: the key's job name stands in
    }
    for job, values in cases.items():
        client.hset(keys.job(job), mapping={k: json.dumps(v) for k, v in values.items()})

    async def worker_specs() -> dict[str, JobSpec]:
        async with aioredis.Redis.from_url(redis_url) as r:
            cache = JobCache(r, keys)
            return {job: await cache.get(job) for job in cases}

    specs = asyncio.run(worker_specs())
    for job in cases:
        producer = ProducerJobRecord.load(client, keys, job)  # what producer status/submit read
        assert producer is not None and producer.name == job
        state = jobstate.load_job_state(settings, job)  # what verify/export read
        spec = specs[job]
        assert JobRecord.from_dict(state.record) == producer
        assert spec.tokens == jobstate.span_tokens(state.record) == producer.span_tokens()
        assert spec.max_new_tokens == producer.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
        assert list(spec.tokens.stop_token_ids) == producer.stop_token_ids
        assert spec.expected_model == producer.expected_model
        assert spec.sampling_params == producer.sampling_params
        assert (spec.tokenizer_fingerprint, spec.chat_template_hash) == (
            producer.tokenizer_fingerprint,
            producer.chat_template_hash,
        )
    assert specs["old"].tokens == KIMI_TOKENS
    assert specs["nulls"].tokens == SpanTokens(7, 8, None, None, None, None, (5,))
    client.close()


class _HeldReads:
    """A real asyncio Redis client whose ``HGETALL`` (the record read) waits for ``release``: a test can make a
    second message arrive while the first one's re-read is in flight, which is otherwise a matter of luck."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    async def hgetall(self, key: str) -> object:
        self.reading.set()
        await self.release.wait()
        return await self._client.hgetall(key)


def test_a_message_that_comes_during_the_generation_reread_gets_the_new_record(redis_url: str) -> None:
    """``producer purge`` (or a lost Redis) and a new submit mint a new generation. The first message of it makes
    the worker re-read the record; a second one that comes while that read is in flight must wait for it, not take
    the cached old record — with which it would be skipped as a purged generation's message and acked (the CI
    failure of test_redis_lost_entirely_resubmit: 5 of 26 re-submitted prompts acked, never stored)."""
    keys = Keys(prefix=f"t{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_url)
    client.hset(keys.job("j"), mapping={"name": json.dumps("j"), "generation": json.dumps("old")})

    async def run() -> tuple[str, str, str]:
        async with aioredis.Redis.from_url(redis_url) as r:
            held = _HeldReads(r)
            held.release.set()
            cache = JobCache(held, keys)  # type: ignore[arg-type]
            before = (await cache.get("j", None, "old")).generation
            client.hset(keys.job("j"), "generation", json.dumps("new"))  # the re-submit's MULTI
            held.release.clear()
            held.reading.clear()
            first = asyncio.create_task(cache.get("j", None, "new"))
            await held.reading.wait()  # the first message's re-read is in flight…
            second = asyncio.create_task(cache.get("j", None, "new"))  # …when the second message comes
            await asyncio.sleep(0)
            held.release.set()
            return before, (await first).generation, (await second).generation

    try:
        assert asyncio.run(run()) == ("old", "new", "new")
    finally:
        client.delete(keys.job("j"))
        client.close()


def test_a_job_without_a_record_reads_as_none_everywhere(redis_url: str, tmp_path: Path) -> None:
    keys = Keys()
    client = redis.Redis.from_url(redis_url)
    assert JobRecord.load(client, keys, "nope") is None

    async def aload() -> JobRecord | None:
        async with aioredis.Redis.from_url(redis_url) as r:
            return await JobRecord.aload(r, keys, "nope")

    assert asyncio.run(aload()) is None
    state = jobstate.load_job_state(Settings(redis_url=redis_url, output_uri=str(tmp_path)), "nope")
    assert state.redis_ok and state.record == {}
    assert jobstate.span_tokens(state.record) == KIMI_TOKENS
    client.close()


def test_work_without_a_message_reads_the_record_in_force_after_a_purge_and_resubmit(redis_url: str) -> None:
    """A turn a worker derives from a stored row has no message to name a generation: ``JobCache.current`` reads
    the record's generation each time and re-reads the record when it changed (a purge and a new submit), and says
    UnknownJob while the job has no record — a worker that cached the first record must not derive with it (its
    turns would carry the purged generation and be skipped: issue 32, scenario 3)."""
    from workers.jobs import UnknownJob
    from workers.turns import TurnChainer

    keys = Keys(prefix=f"t{uuid.uuid4().hex[:8]}")
    client = redis.Redis.from_url(redis_url)
    turns = json.dumps({"mode": "all", "conversations": 1})
    client.hset(keys.job("j"), mapping={"name": json.dumps("j"), "generation": json.dumps("g1"), "turns": turns})
    settings = Settings(redis_url=redis_url, key_prefix=keys.prefix)

    async def run() -> tuple[str, bool, str, str, bool, int]:
        async with aioredis.Redis.from_url(redis_url) as r:
            cache = JobCache(r, keys)
            chainer = TurnChainer(r, keys, settings, jobs=cache)
            first = (await cache.current("j")).generation
            multi = await chainer.multi_turn("j")
            client.delete(keys.job("j"))  # producer purge
            try:
                await cache.current("j")
                purged = "record"
            except UnknownJob:
                purged = "none"
            gone = await chainer.multi_turn("j")
            client.hset(  # the new submit, at another priority
                keys.job("j"),
                mapping={"name": json.dumps("j"), "generation": json.dumps("g2"), "turns": turns, "priority": "3"},
            )
            return first, multi, purged, (await cache.current("j")).generation, gone, await chainer.priority("j")

    try:
        assert asyncio.run(run()) == ("g1", True, "none", "g2", False, 3)
    finally:
        client.delete(keys.job("j"))
        client.close()
