"""``producer retry --truncated`` of a ``--turns all`` job re-derives the turns after the re-run turn, at the job's
priority.

Given 3-turn conversations submitted with ``--priority 3`` and a budget so small that turn 0 stops on length,
run to the end by a worker against the simulator, when the truncated rows are re-run with a large budget, then
only turn 0 of each conversation is re-run (its later turns are re-derived from the new answer: their
``input_ids`` are the template's rendering with the NEW turn-0 answer, their revisions above the old ones),
every turn is current exactly once and verify passes; the later turns went to the job's priority list. A
re-derived turn that now calls a tool ends its chain there: the turns after it (stored from the old chain) are
superseded — out of ``done``, listed by verify, skipped by export.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import redis
import redis.asyncio as aioredis

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import expected_generation
from sglang_sim.testing import SimulatorProcess
from storage.conversations import ToolMarkers, output_message
from storage.exports import export_job
from storage.reader import read_committed
from storage.verify import verify_job
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import priority_list
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import plan_conversation, turn_messages
from workers.turns import TurnChainer

CONVERSATIONS, TURNS, SMALL, LARGE, PRIORITY = 3, 3, 8, 4000, 3


def _conversations(path: Path) -> Path:
    rows = conversation_rows(CONVERSATIONS, TURNS, 8, "Be careful.", seed_step=10)
    return write_jsonl(path, rows)


def _answer(tok: object, row: dict, markers: ToolMarkers) -> dict:
    return output_message(
        tok,
        row["output_ids"],
        (row["reasoning_start"], row["reasoning_end"]),
        (row["answer_start"], row["answer_end"]),
        [(s["start"], s["end"]) for s in row["tool_call_spans"]],
        markers,
    )


def _past_end(rows: dict[str, dict]) -> set[str]:
    """The turns after a (new) row that calls a tool: that row ended its chain."""
    ends = {(r["conversation_id"], r["turn_index"]) for r in rows.values() if r["tool_call_spans"]}
    return {p for p, r in rows.items() if any(c == r["conversation_id"] and t < r["turn_index"] for c, t in ends)}


def _current(settings: object, job: str) -> dict[str, dict]:
    return {r["prompt_id"]: r for r in read_committed(settings.output_uri, job).to_pylist()}  # type: ignore[attr-defined]


def test_truncated_turn_rerun_rederives_later_turns_at_the_jobs_priority(redis_url: str, tmp_path: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    k, job, total = settings.keys, "rerun", CONVERSATIONS * TURNS
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    data = _conversations(tmp_path / "chat.jsonl")
    sim = SimulatorProcess("--time-scale", "400")
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url), tmp_path).start()
    try:
        worker.wait_ready(client, k)
        # Given every turn run with a budget of SMALL tokens at priority 3.
        submitted = producer_cli(
            settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
            "--no-progress", "--max-new-tokens", str(SMALL), "--seed", "3", "--context-length", "131072",
            "--turns", "all", "--priority", str(PRIORITY), "--json",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        wait_until(lambda: job_progress(client, k, job)["done"] == total, 120, what=f"{total} turns")
        before = _current(settings, job)
        assert all(r["finish_reason"] == "length" for r in before.values()), "a budget this small truncates"
        # When the truncated rows are re-run with a large budget.
        retry = producer_cli(settings, "retry", job, "--truncated", "--max-new-tokens", str(LARGE), "--json")
        assert retry.returncode == 0, retry.stderr
        # Then only the earliest truncated turn of each (settled) conversation is re-run.
        assert sorted(json.loads(retry.stdout)["prompt_ids"]) == [f"chat/c{c}/t0" for c in range(CONVERSATIONS)]

        def rederived() -> bool:
            rows = _current(settings, job)
            return all(r["revision"] > before[p]["revision"] for p, r in rows.items() if p not in _past_end(rows))

        wait_until(rederived, 120, what="every turn re-derived")
        wait_until(
            lambda: job_progress(client, k, job)["done"] >= total - len(_past_end(_current(settings, job))),
            60,
            what="settled",
        )
    finally:
        worker.terminate()
        sim.kill()

    rows = _current(settings, job)
    assert sorted(rows) == sorted(before), "every turn stored, exactly once"
    superseded = _past_end(rows)
    record = JobRecord.load(client, k, job)
    assert record is not None
    tok = load_tokenizer(str(tok_dir))
    markers = ToolMarkers.of(record)
    source = [json.loads(line) for line in data.read_text().splitlines()]
    for c, conv_row in enumerate(source):
        conv = plan_conversation(conv_row["messages"])
        assert conv is not None
        answers: list[dict] = []
        for t in range(TURNS):
            row = rows[f"chat/c{c}/t{t}"]
            if row["prompt_id"] in superseded:
                assert row["revision"] == before[row["prompt_id"]]["revision"], "a superseded turn is not re-run"
                continue
            # The prompt: rendered with the model's NEW answers of the earlier turns; its output: byte-exact,
            # with the re-run's budget (carried along the chain).
            want = render_ids(tok, turn_messages(conv, answers), None, record.chat_template_kwargs)
            assert row["input_ids"] == want, f"turn {t} of c{c} was not re-derived from the new answers"
            sampling = json.loads(row["sampling_params"])
            assert sampling["max_new_tokens"] == LARGE
            assert row["output_ids"] == expected_generation(row["input_ids"], sampling).output_ids
            if t:
                assert row["input_ids"] != before[f"chat/c{c}/t{t}"]["input_ids"]
            answers.append(_answer(tok, row, markers))
    done = total - len(superseded)
    assert client.scard(k.done(job)) == done, "a superseded turn is not done"
    assert int(client.hget(k.counters(job), "done") or 0) == done, "the done counter follows the re-derivations"
    # A superseded turn leaves the job (no chain derives it): nothing pending, so status calls it finished.
    assert client.hlen(k.prompts(job)) == int(client.hget(k.counters(job), "submitted") or 0) == done
    status = producer_cli(settings, "status", job, "--json", "--deep")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["unaccounted"] == 0 and json.loads(status.stdout)["finished"], status.stdout
    report = verify_job(settings, job)
    assert report.ok, report.to_dict()
    assert report.superseded == sorted(superseded) and not report.missing and not report.not_submitted
    exported = export_job(settings, job, "eagle3", str(tmp_path / "eagle3"))
    assert exported.rows == done and exported.skipped.get("superseded", 0) == len(superseded)

    # And the next turn of a row goes onto the job's priority list, its message saying that priority.
    async def plan() -> tuple[str, bytes]:
        r = aioredis.Redis.from_url(redis_url)
        try:
            chainer = TurnChainer(r, k, settings)
            nxt = (await chainer.plan(job, "chat", [rows["chat/c0/t0"]]))[0]
            assert nxt is not None
            return await chainer.queue_for(job), nxt.next_message
        finally:
            await r.aclose()

    queue, message = asyncio.run(plan())
    assert queue == priority_list(settings.queue, PRIORITY) != settings.queue
    assert json.loads(message)["properties"]["priority"] == PRIORITY
