"""`producer status` of a ``--turns all`` job: conversations and turns counted from a hand-built Redis state."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from click.testing import CliRunner

from producer.cli import cli
from producer.submit import submit
from producer.submit_options import SubmitOptions
from testing.datasets import write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.turns import answers_key


def _conversation(c: int, turns: int, tool_after: int | None = None) -> dict:
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {c}.{t}"})
        if tool_after == t:
            call = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "content": "42", "tool_call_id": "x"})
        messages.append({"role": "assistant", "content": f"answer {c}.{t}"})
    return {"id": f"c{c}", "messages": messages}


def test_status_counts_conversations_and_turns(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    # c0..c3: 3 turns; c4: a tool call after its 2nd user turn cuts it to 2 turns.
    rows = [_conversation(c, 3) for c in range(4)] + [_conversation(4, 3, tool_after=1)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    submit(settings, SubmitOptions(paths=[path], job="mt", tokenizer=str(tok), processes=1, turns="all"))
    k, r = settings.keys, redis_client
    answers = answers_key(k, "mt")
    # c0 complete (3 turns done); c1 at turn 1 (t0 done, t1 enqueued); c2's model called a tool at t0;
    # c3's t1 was dead-lettered; c4 (2 turns) only enqueued.
    done = ["chat/c0/t0", "chat/c0/t1", "chat/c0/t2", "chat/c1/t0", "chat/c2/t0", "chat/c3/t0"]
    r.sadd(k.done("mt"), *done)
    for pid in done:
        r.hset(answers, pid, json.dumps({"role": "assistant", "content": "a"}))
    r.hset(answers, "chat/c2/t0", json.dumps({"role": "assistant", "content": "", "chain_end": "tool_call"}))
    r.hset(k.dead("mt"), "chat/c3/t1", json.dumps({"error_class": "context_overflow"}))
    r.hset(k.counters("mt"), mapping={"done": len(done), "turns_enqueued": 4})  # c0 t1,t2; c1 t1; c3 t1
    # (each enqueued turn joined the submitted set in its finalize: a turn nobody submitted would be stranded)
    r.hset(k.prompts("mt"), mapping=dict.fromkeys(["chat/c0/t1", "chat/c0/t2", "chat/c1/t1", "chat/c3/t1"], "h"))

    result = CliRunner().invoke(cli, ["status", "mt", "--json", "--redis-url", redis_url])
    assert result.exit_code == 0, result.output
    st = json.loads(result.output)
    assert st["conversations"] == {
        "total": 5, "complete": 1, "in_progress": 2, "cut_at_tool": 1, "chain_ended": 1, "ends": {"tool_call": 1},
        "dead": 1, "stranded": 0, "stranded_ids": [],
    }  # fmt: skip
    assert st["turns"] == {"planned": 14, "enqueued": 9, "done": 6}

    view = CliRunner().invoke(cli, ["status", "mt", "--redis-url", redis_url])
    assert view.exit_code == 0, view.output
    assert "conversations (--turns all): 1/5 complete" in view.output.replace("\n", " ")


def test_status_of_a_single_turn_job_has_no_conversations(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    path = write_jsonl(tmp_path / "chat.jsonl", [_conversation(0, 2)])
    submit(settings, SubmitOptions(paths=[path], job="st", tokenizer=str(tok), processes=1))
    result = CliRunner().invoke(cli, ["status", "st", "--json", "--redis-url", redis_url])
    st = json.loads(result.output)
    assert "conversations" not in st and "turns" not in st


# -- producer verify -----------------------------------------------------------------------------------------
def _turn_rows(convs: int, turns: int) -> list[dict]:
    from testing.rows import make_row

    return [
        make_row(
            f"chat/c{c}/t{t}",
            dataset="chat",
            job="mt",
            seed=c * 10 + t,
            conversation_id=f"chat/c{c}",
            turn_index=t,
            turn_count=turns,
        )
        for c in range(convs)
        for t in range(turns)
    ]


def _store(tmp_path: Path, client: redis.Redis, settings: Settings, rows: list[dict], submitted: list[dict]) -> None:
    from storage.writer import PartWriter

    PartWriter(str(tmp_path / "out"), "w1").write("mt", "chat", rows)
    k = settings.keys
    client.hset(k.prompts("mt"), mapping={r["prompt_id"]: r["content_hash"] for r in submitted})
    client.hset(k.prompt_dataset("mt"), mapping={r["prompt_id"]: "chat" for r in submitted})


def test_verify_passes_every_turn_once_and_names_a_conversation_missing_a_later_turn(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    from storage.verify import verify_job
    from storage.verify_report import format_report

    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    rows = _turn_rows(3, 3)
    # c0, c1 complete; c2: turn 1 stored (its answer says no chain end), turn 2 never enqueued nor stored.
    stored = [r for r in rows if r["prompt_id"] != "chat/c2/t2"]
    _store(tmp_path, redis_client, settings, stored, stored)
    answers = answers_key(settings.keys, "mt")
    for r in stored:
        redis_client.hset(answers, r["prompt_id"], json.dumps({"role": "assistant", "content": "a"}))
    report = verify_job(settings, "mt")
    assert not report.ok and report.missing == [] and report.missing_turns == ["chat/c2/t2"]
    assert "conversation chat/c2: turn 2" in format_report(report)
    code = CliRunner().invoke(cli, ["verify", "mt", "--redis-url", redis_url, "--output-uri", str(tmp_path / "out")])
    assert code.exit_code != 0 and "chat/c2" in code.output

    # The model called a tool at c2's turn 1: its chain ended there, nothing is missing.
    redis_client.hset(answers, "chat/c2/t1", json.dumps({"role": "assistant", "content": "", "chain_end": "tool_call"}))
    assert verify_job(settings, "mt").ok
    # A dead-lettered turn 2 is a permanent failure, not a missing turn.
    redis_client.hset(answers, "chat/c2/t1", json.dumps({"role": "assistant", "content": "a"}))
    redis_client.hset(settings.keys.dead("mt"), "chat/c2/t2", json.dumps({"error_class": "context_overflow"}))
    report = verify_job(settings, "mt")
    assert report.ok and report.permanent_failures == ["chat/c2/t2"]

    # Every turn stored once: OK.
    redis_client.delete(settings.keys.dead("mt"))
    _store(tmp_path, redis_client, settings, [rows[-1]], rows)
    report = verify_job(settings, "mt")
    assert report.ok, report.to_dict()
    assert (report.committed, report.missing_turns) == (9, [])


# -- re-submit with another --turns --------------------------------------------------------------------------
def test_a_resubmit_with_another_turns_is_refused(redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    import pytest

    from producer.submit_options import SubmitError

    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))
    tok = str(build_test_tokenizer(default_test_tokenizer_dir()))
    path = write_jsonl(tmp_path / "chat.jsonl", [_conversation(c, 2) for c in range(2)])
    submit(settings, SubmitOptions(paths=[path], job="all", tokenizer=tok, processes=1, turns="all"))
    submit(settings, SubmitOptions(paths=[path], job="last", tokenizer=tok, processes=1))
    queued = redis_client.llen(settings.queue)
    with pytest.raises(SubmitError, match="--turns all ≠ last"):
        submit(settings, SubmitOptions(paths=[path], job="all", tokenizer=tok, processes=1, turns="last"))
    with pytest.raises(SubmitError, match="--turns last ≠ all"):
        submit(settings, SubmitOptions(paths=[path], job="last", tokenizer=tok, processes=1, turns="all"))
    assert redis_client.llen(settings.queue) == queued, "a refused submit enqueues nothing"
    # The same --turns again is fine (nothing new to enqueue).
    report = submit(settings, SubmitOptions(paths=[path], job="all", tokenizer=tok, processes=1, turns="all"))
    assert report is not None
    assert redis_client.llen(settings.queue) == queued


# -- producer retry of a dead-lettered later turn --------------------------------------------------------------
def test_retry_of_a_dead_lettered_turn_requeues_it_and_the_chain_goes_on(redis_url: str, tmp_path: Path) -> None:
    """Turn 1 overflows the server's context (turn 0 fits): it is dead-lettered with its whole message and the
    chain stops there. With a longer context, `producer retry` re-queues ``chat/c0/t1``, and the worker that
    stores it enqueues turn 2: every turn is stored once and verify passes."""
    from producer.render import load_tokenizer, render_ids
    from sglang_sim.testing import SimulatorProcess
    from storage.reader import raw_duplicates, read_committed
    from storage.verify import verify_job
    from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
    from testing.harness import fast_env, isolated_settings, producer_cli
    from thinkfleet.state.job import JobRecord
    from thinkfleet.turns import plan_conversation

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    k, job, budget = settings.keys, "chain", 300
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    row = _conversation(0, 3)
    data = write_jsonl(tmp_path / "chat.jsonl", [row])
    submitted = producer_cli(
        settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
        "--no-progress", "--max-new-tokens", str(budget), "--seed", "3", "--context-length", "131072",
        "--turns", "all", "--json", in_process=True,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    record = JobRecord.load(client, k, job)
    assert record is not None
    plan = plan_conversation(row["messages"])
    assert plan is not None
    first = plan["messages"][: plan["users"][0] + 1]
    p0 = len(render_ids(load_tokenizer(str(tok_dir)), first, None, record.chat_template_kwargs))
    # Turn 0 (p0 + budget tokens) fits; turn 1, whose prompt holds turn 0's answer, does not.
    sim = SimulatorProcess("--time-scale", "400", "--context-length", str(p0 + budget + 1))
    sim.log_path = str(tmp_path / "sim.log")
    sim.start()
    worker = WorkerProcess("w1", fast_env(settings, sim.url), tmp_path).start()
    try:
        worker.wait_ready(client, k)
        wait_until(lambda: "chat/c0/t1" in dead_letters(client, k, job), 120, what="turn 1 dead-lettered")
        dead = dead_letters(client, k, job)
        assert set(dead) == {"chat/c0/t1"} and dead["chat/c0/t1"]["error_class"] == "context_overflow"
        assert client.sismember(k.done(job), "chat/c0/t0") and not client.hexists(k.prompts(job), "chat/c0/t2")
        status = json.loads(CliRunner().invoke(cli, ["status", job, "--json", "--redis-url", redis_url,
                                                     "--key-prefix", settings.key_prefix]).output)  # fmt: skip
        assert status["conversations"]["dead"] == 1 and status["turns"] == {"planned": 3, "enqueued": 2, "done": 1}
        # When the server comes back with a longer context and the operator retries the turn.
        closed = worker.gate_closures()
        sim.kill()
        wait_until(lambda: worker.gate_closures() > closed, 30, what="the worker saw the server go")
        sim.args = ["--time-scale", "400"]
        sim.start()
        retry = producer_cli(settings, "retry", job, "--json", in_process=True)
        assert retry.returncode == 0, retry.stderr
        assert json.loads(retry.stdout)["prompt_ids"] == ["chat/c0/t1"]
        wait_until(lambda: job_progress(client, k, job)["done"] == 3, 120, what="the chain finished")
    finally:
        worker.terminate()
        sim.kill()
    assert dead_letters(client, k, job) == {}
    rows = read_committed(settings.output_uri, job).to_pylist()
    assert sorted(r["prompt_id"] for r in rows) == ["chat/c0/t0", "chat/c0/t1", "chat/c0/t2"]
    assert raw_duplicates(settings.output_uri, job).num_rows == 0
    report = verify_job(settings, job)
    assert report.ok, report.to_dict()
