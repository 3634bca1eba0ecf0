"""A 200 answer that cannot be a generation (issue 20 item 3): an output id outside ``[0, vocab)`` or past
int32, a ``stop`` finish with more ids than ``max_new_tokens``, counts that disagree. Each is caught when the
answer arrives (workers/sglang.py ``parse_response`` → :class:`BadOutput`), retried as a server fault the
server *answered* (no outage suspected), and dead-lettered ``bad_output`` with the server's answer kept — so a
bad row never joins a commit group, never fails its neighbours' encode and never closes the storage gate.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import requests

from sglang_sim.faults import FaultConfig, FaultInjector
from sglang_sim.generate import _prompt_key
from sglang_sim.testing import SimulatorThread
from testing.fleet import WorkerProcess, dead_letters, job_progress
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, register_ids, sim_stats, simulator
from testing.record import check_job, record_result
from thinkfleet import kimi
from thinkfleet.broker.celery_app import send_tasks as publish
from thinkfleet.keys import Keys
from thinkfleet.message import PromptTask, pack_ids
from thinkfleet.settings import Settings
from thinkfleet.state.ledger import ANSWER_IDS_KEPT, ANSWER_MAX_CHARS, Ledger, bounded_answer
from workers.attempts import RequestAttempts
from workers.metrics import WorkerMetrics
from workers.sglang import (
    BadOutput,
    Generation,
    PermanentError,
    ServerFault,
    answer_excerpt,
    parse_response,
)

VOCAB = kimi.VOCAB_SIZE
STOP = kimi.DEFAULT_STOP_TOKEN_IDS[0]


def _answer(ids: list[Any], finish: Any = None, **meta: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": "r1",
        "finish_reason": finish if finish is not None else {"type": "stop", "matched": STOP},
        "prompt_tokens": 3,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": "default",
    }
    info.update(meta)
    return {"text": "t", "output_ids": ids, "meta_info": info}


# -- the answer is validated when it arrives ------------------------------------------------------------
def test_an_id_past_int32_is_a_bad_output_carrying_the_answer() -> None:
    with pytest.raises(BadOutput) as caught:
        parse_response(_answer([5, 2**31, STOP]), "r1", 100)
    exc = caught.value
    assert isinstance(exc, ServerFault), "a server fault: retried"
    assert exc.error_class == exc.exhausted_class == "bad_output" and exc.answered
    assert "2147483648" in str(exc) and "position 1" in str(exc)
    assert exc.answer is not None
    assert exc.answer["output_ids"] == [5, 2**31, STOP] and exc.answer["output_ids_count"] == 3
    assert exc.answer["meta_info"]["completion_tokens"] == 3


def test_ids_are_bounded_by_the_vocabulary_when_it_is_known_else_by_int32() -> None:
    assert parse_response(_answer([VOCAB - 1, STOP]), "r1", 100, vocab_size=VOCAB).output_ids == [VOCAB - 1, STOP]
    with pytest.raises(BadOutput, match=f"vocabulary size {VOCAB}"):
        parse_response(_answer([VOCAB, STOP]), "r1", 100, vocab_size=VOCAB)
    # vocabulary unknown: only the int32 bound (every id column is int32)
    assert parse_response(_answer([VOCAB, STOP]), "r1", 100).output_ids == [VOCAB, STOP]
    assert parse_response(_answer([2**31 - 1, STOP]), "r1", 100).output_ids == [2**31 - 1, STOP]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "7", None])
def test_a_negative_or_non_integer_id_is_a_bad_output(bad: Any) -> None:
    with pytest.raises(BadOutput):
        parse_response(_answer([5, bad, STOP]), "r1", 100, vocab_size=VOCAB)


@pytest.mark.parametrize("finish", [{"type": "stop", "matched": STOP}, {"type": "length", "length": 4}])
def test_more_ids_than_max_new_tokens_is_a_bad_output_for_either_finish(finish: dict[str, Any]) -> None:
    assert len(parse_response(_answer([1, 2, 3, STOP], finish), "r1", 4).output_ids) == 4
    with pytest.raises(BadOutput, match="max_new_tokens=3"):
        parse_response(_answer([1, 2, 3, STOP], finish), "r1", 3)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"completion_tokens": 5}, "completion_tokens"),
        ({"cached_tokens": -1}, "cached_tokens"),
        ({"prompt_tokens": -3}, "prompt_tokens"),
        ({"reasoning_tokens": 2**31}, "reasoning_tokens"),
        ({"num_retractions": True}, "num_retractions"),
        ({"total_retractions": "2"}, "total_retractions"),
        ({"reasoning_tokens": 3}, "reasoning_tokens=3 > len"),
    ],
)
def test_negative_oversized_or_inconsistent_counts_are_a_bad_output(meta: dict[str, Any], match: str) -> None:
    with pytest.raises(BadOutput, match=match):
        parse_response(_answer([1, STOP], **meta), "r1", 100)


def test_prompt_tokens_must_match_the_prompt_sent_when_the_client_says_its_length() -> None:
    assert parse_response(_answer([1, STOP]), "r1", 100, prompt_len=3).prompt_tokens == 3
    with pytest.raises(BadOutput, match="prompt_tokens=3 != the 4 prompt ids sent"):
        parse_response(_answer([1, STOP]), "r1", 100, prompt_len=4)
    # a count the server left out (or null) is not checked and stays None
    gen = parse_response(_answer([1, STOP], cached_tokens=None, reasoning_tokens=None), "r1", 100, prompt_len=3)
    assert gen.cached_tokens is None and gen.reasoning_tokens is None


def test_a_top_logprob_id_outside_the_vocabulary_is_a_bad_output() -> None:
    lp = {
        "output_token_logprobs": [[-0.1, 1, None], [-0.2, STOP, None]],
        "output_top_logprobs": [[[-0.1, 1, None], [-2.0, VOCAB, None]], [[-0.2, STOP, None]]],
    }
    with pytest.raises(BadOutput, match=r"output_top_logprobs\[0\]"):
        parse_response(_answer([1, STOP], **lp), "r1", 100, logprobs=2, vocab_size=VOCAB)
    lp["output_top_logprobs"][0][1][1] = 2**31  # type: ignore[index]
    with pytest.raises(BadOutput, match="2147483648"):
        parse_response(_answer([1, STOP], **lp), "r1", 100, logprobs=2)


def test_a_nan_stop_is_still_its_own_fault_not_a_bad_output() -> None:
    from workers.sglang import NanStop

    with pytest.raises(NanStop):
        parse_response(_answer([5, STOP], {"type": "stop", "matched": "NaN happened"}), "r1", 100, vocab_size=VOCAB)


def test_the_answer_excerpt_keeps_the_first_ids_and_cuts_every_list() -> None:
    ids = list(range(10_000))
    meta = {"output_token_logprobs": [[-0.1, i, None] for i in ids], "completion_tokens": 10_000}
    excerpt = answer_excerpt({"output_ids": ids, "meta_info": meta, "text": "x" * 5000})
    assert excerpt["output_ids"] == ids[:4096] and excerpt["output_ids_count"] == 10_000
    assert len(excerpt["meta_info"]["output_token_logprobs"]) == 16
    assert excerpt["meta_info"]["completion_tokens"] == 10_000 and len(excerpt["text"]) == 2000
    assert answer_excerpt([1, 2]) == {"body": "[1, 2]"}


# -- the retries: an answering server is not an outage ---------------------------------------------------
class FakeGate:
    healthy = True
    info = None

    async def refresh_info(self, seen: Any) -> Any:
        return seen

    def __init__(self) -> None:
        self.completions = self.failures = self.waits = 0

    def note_completion(self) -> None:
        self.completions += 1

    def report_failure(self) -> None:
        self.failures += 1

    def alive_since(self, t: float) -> bool:
        return False

    async def wait_news(self, timeout_s: float) -> None:
        self.waits += 1


class Scripted:
    """``generate`` raises or returns from a script (the last entry repeats) and records its vocab_size."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.vocabs: list[int | None] = []

    async def generate(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str, deadline: float, vocab_size: int | None = None
    ) -> Any:
        self.vocabs.append(vocab_size)
        item = self.script[0] if len(self.script) == 1 else self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


GEN = Generation([1, STOP], "stop", str(STOP), 3, 2, 0, None, 0, "default", None, "r")
TASK = SimpleNamespace(task_id="job/p1", prompt_id="p1", job="job")


def _run(client: Scripted, attempts: int = 3) -> tuple[Any, FakeGate, WorkerMetrics]:
    s = Settings(retry_base_s=0.001, retry_max_backoff_s=0.001, max_inflight=4, retry_max_attempts=attempts)
    metrics = WorkerMetrics("t", 4)
    gate = FakeGate()
    rt = RequestAttempts(s, client, gate, metrics, draining=lambda: False)  # type: ignore[arg-type]

    async def go() -> Any:
        try:
            return await rt.run(TASK, [1, 2, 163606], {"max_new_tokens": 8}, VOCAB)  # type: ignore[arg-type]
        except PermanentError as exc:
            return exc

    return asyncio.run(go()), gate, metrics


def test_a_bad_output_is_retried_and_a_clean_answer_kept() -> None:
    client = Scripted(BadOutput("id 2**31", {"output_ids": [2**31]}), GEN)
    (gen, attempts, _), _, metrics = _run(client)
    assert gen is GEN and attempts == 2
    assert client.vocabs == [VOCAB, VOCAB], "the vocabulary bounds every attempt's answer"
    assert metrics.registry.get_sample_value("thinkfleet_retried_total", {"error_class": "bad_output"}) == 1


def test_bad_outputs_until_retries_run_out_dead_letter_as_bad_output_with_the_answer() -> None:
    answer = {"output_ids": [5, 2**31], "meta_info": {"completion_tokens": 2}}
    client = Scripted(BadOutput("id 2**31", answer))
    exc, gate, _ = _run(client, attempts=3)
    assert isinstance(exc, PermanentError)
    assert exc.error_class == "bad_output", "its own class, not retries_exhausted:bad_output"
    assert exc.answer == answer and exc.attempts == 3  # type: ignore[attr-defined]
    # the server answered every time: no probe forced, no waiting for the gate's verdict
    assert gate.failures == 0 and gate.waits == 0 and gate.completions == 3


# -- the dead letter keeps the answer, bounded -------------------------------------------------------------
def test_bounded_answer_keeps_the_first_ids_and_stays_under_its_size() -> None:
    small = {"output_ids": [1, 2], "meta_info": {"x": 1}}
    assert bounded_answer(small) == {**small, "output_ids_count": 2}
    big = bounded_answer({"output_ids": [2**40 + i for i in range(20_000)], "meta_info": {}})
    assert big["output_ids_count"] == 20_000 and 0 < len(big["output_ids"]) <= ANSWER_IDS_KEPT
    assert big["output_ids"][0] == 2**40
    assert len(json.dumps(big)) <= ANSWER_MAX_CHARS
    huge = bounded_answer({"meta_info": {"blob": "y" * (2 * ANSWER_MAX_CHARS)}})
    assert huge["truncated"] is True and len(huge["excerpt"]) == ANSWER_MAX_CHARS


def test_the_dead_letter_record_keeps_the_answer(redis_url: str) -> None:
    keys = Keys(f"bo{uuid.uuid4().hex[:6]}")
    task = PromptTask("j", "ds", "p1", 0, "h", pack_ids([1, 2, 3]))
    answer = {"output_ids": [*range(5000), 2**31], "meta_info": {"completion_tokens": 5001}}

    async def scenario() -> dict[str, Any]:
        client = aioredis.from_url(redis_url)
        try:
            await client.set(keys.heartbeat("w"), "1")
            ledger = Ledger(client, keys, "w")
            assert (await ledger.claim("j", "p1")).state == "new"
            assert await ledger.dead_letter(task, "bad_output", "id 2**31", 8, answer=answer)
            return json.loads(await client.hget(keys.dead("j"), "p1"))
        finally:
            await client.aclose()

    record = asyncio.run(scenario())
    assert record["error_class"] == "bad_output" and record["attempts"] == 8
    assert record["answer"]["output_ids"] == list(range(ANSWER_IDS_KEPT))
    assert record["answer"]["output_ids_count"] == 5001 and record["answer"]["meta_info"] == answer["meta_info"]
    assert "task" in record, "the whole message is still kept for producer retry"


# -- the simulator's fault ---------------------------------------------------------------------------------
def _generate(url: str, ids: list[int], rid: str, max_new: int = 64) -> dict[str, Any]:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": max_new}}
    resp = requests.post(f"{url}/generate", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize(("kind", "bad_id"), [("int32", 2**31), ("vocab", VOCAB)])
def test_the_simulator_answers_200_with_a_bad_id_on_every_attempt_of_a_chosen_prompt(kind: str, bad_id: int) -> None:
    prompt = make_prompts(1, seed=4)["p00000"]
    with SimulatorThread(time_scale=1000, bad_output_rate=1.0, bad_output_kind=kind) as sim:
        answers = [_generate(sim.url, prompt, f"r{i}") for i in range(3)]
        stats = requests.get(f"{sim.url}/control/stats", timeout=5).json()
    for data in answers:
        ids = data["output_ids"]
        assert ids.count(bad_id) == 1 and ids[-1] != bad_id, "one id replaced, never the stop id"
        assert data["meta_info"]["completion_tokens"] == len(ids)
        with pytest.raises(BadOutput):
            parse_response(data, "r", 64, vocab_size=VOCAB, prompt_len=len(prompt))
    assert stats["bad_output_rids"] == ["r0", "r1", "r2"]
    assert stats["faults"] == {f"bad_output:{kind}": 3}


def test_the_simulators_overlong_fault_is_a_stop_finish_past_max_new_tokens() -> None:
    prompt = make_prompts(1, seed=4)["p00000"]
    with SimulatorThread(time_scale=1000, bad_output_rate=1.0, bad_output_kind="overlong") as sim:
        data = _generate(sim.url, prompt, "r0", max_new=20)
    assert len(data["output_ids"]) == 21 and data["meta_info"]["finish_reason"]["type"] == "stop"
    with pytest.raises(BadOutput, match="max_new_tokens=20"):
        parse_response(data, "r", 20, vocab_size=VOCAB, prompt_len=len(prompt))


def test_bad_prompts_are_chosen_per_prompt_and_reproducibly_unless_per_attempt() -> None:
    prompts = make_prompts(60, seed=9, length=16)
    injector = FaultInjector(FaultConfig(bad_output_rate=0.3, fault_seed=3))
    chosen = {pid for pid, ids in prompts.items() if injector.choose_bad_output(_prompt_key(ids), pid) is not None}
    assert 5 <= len(chosen) <= 35
    with SimulatorThread(time_scale=1000, bad_output_rate=0.3, fault_seed=3) as sim:
        for attempt in range(2):  # every attempt of a chosen prompt is bad, and only those
            bad = {
                pid
                for pid, ids in prompts.items()
                if 2**31 in _generate(sim.url, ids, f"{pid}/a{attempt}")["output_ids"]
            }
            assert bad == chosen
        requests.post(f"{sim.url}/control/faults", json={"bad_output_per_attempt": True}, timeout=5).raise_for_status()
        draws = [
            {pid for pid, ids in prompts.items() if 2**31 in _generate(sim.url, ids, pid)["output_ids"]}
            for _ in range(2)
        ]
    assert draws[0] != draws[1], "per attempt: a retry (same rid, next call) draws afresh"
    with pytest.raises(ValueError, match="bad_output_kind"):
        FaultConfig(bad_output_kind="nope")


# -- end to end: a real worker, 2 % of prompts answered with a bad id ------------------------------------
def _worker_metric(client: redis.Redis, settings: Settings, worker: str, name: str) -> float:
    import urllib.request

    port = json.loads(client.hget(settings.keys.workers, worker))["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = [line for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name]
    assert samples, f"{name} is not exported"
    return sum(float(line.rpartition(" ")[2]) for line in samples)


@pytest.mark.parametrize(("kind", "bad_id"), [("int32", 2**31), ("vocab", VOCAB)])
def test_bad_output_ids_are_dead_lettered_and_never_stall_their_neighbours(
    redis_url: str, tmp_path: Path, kind: str, bad_id: int
) -> None:
    """One host, 2 % of prompts answered 200 with a bad id on every attempt (``int32``: 2**31 with the
    vocabulary unknown; ``vocab``: the vocabulary size, the job record knowing it). Every good prompt is
    stored exactly once and byte-exact, every bad one dead-lettered ``bad_output`` with the answer kept,
    ``producer wait`` finishes, and no commit ever fails (the storage gate stays open)."""
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    prompts = make_prompts(200, seed=21)
    rate, seed, attempts = 0.02, 5, 3
    injector = FaultInjector(FaultConfig(bad_output_rate=rate, fault_seed=seed))
    bad = {pid for pid, ids in prompts.items() if injector.choose_bad_output(_prompt_key(ids), pid) is not None}
    assert 1 <= len(bad) <= 12, bad
    started = time.monotonic()
    sim_args = ("--time-scale", "400", "--bad-output-rate", str(rate), "--bad-output-kind", kind)
    with simulator(tmp_path / "logs", *sim_args, "--fault-seed", str(seed)) as sim:
        env = fast_env(settings, sim, max_inflight=16, retry_max_attempts=attempts)
        worker = WorkerProcess("w1", env, tmp_path / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            job, tasks = register_ids(settings, "bad", prompts, max_new_tokens=512)
            if kind == "vocab":  # the server reports none: the job record's (config.json's) bounds the ids
                client.hset(settings.keys.job("bad"), "vocab_size", json.dumps(VOCAB))
            publish(settings, tasks)
            waited = producer_cli(
                settings, "wait", "bad", "--timeout", "150", "--interval", "0.5", "--json", in_process=True
            )
            storage_failures = _worker_metric(client, settings, "w1", "thinkfleet_storage_failures_total")
            stats = sim_stats(sim)
        finally:
            worker.terminate()
    dead = dead_letters(client, settings.keys, "bad")
    log = worker.log_path.read_text()
    outcome = check_job(settings, "bad", prompts, job.sampling_params, expected_dead=bad)
    record_result(
        f"bad output ids ({kind}, 2 %)",
        outcome,
        faults=f"{len(bad)} of {len(prompts)} prompts answered 200 with an id of {bad_id} on every attempt",
        wall_s=time.monotonic() - started,
        notes="each retried, then dead-lettered bad_output with the answer kept; no commit failed",
    )
    assert waited.returncode == 0, waited.stdout + waited.stderr
    outcome.assert_clean()
    assert set(dead) == bad
    for record in dead.values():
        assert record["error_class"] == "bad_output" and record["attempts"] == attempts, record
        answer = record["answer"]
        assert bad_id in answer["output_ids"] and answer["output_ids_count"] == len(answer["output_ids"])
        assert answer["meta_info"]["completion_tokens"] == answer["output_ids_count"]
    assert len(stats["bad_output_rids"]) == attempts * len(bad), "every attempt of a bad prompt was bad"
    assert storage_failures == 0
    assert not re.search(r"commit of .* failed", log) and "commit failing at" not in log, "the gate never closed"
    assert job_progress(client, settings.keys, "bad")["done"] == len(prompts) - len(bad)
