"""A conversation's end is recorded with its last row, and ``producer wait``, ``status`` and ``verify`` agree.

Every conversation of a ``--turns all`` job (and every agentic turn's chain of steps) ends in exactly one recorded
way: ``complete`` (its last turn answered), or ended with a reason (``tool_mismatch``, ``max_tool_steps``,
``tool_error``, ``tool_call``, ``error: …``) — stored in the ``chain_end`` column of the chain's last row in Parquet
(thinkfleet/chain_end.py), so it survives a purge or the loss of Redis. A row whose chain goes on says ``""`` there;
its successor (the next step, or the next turn) must then be stored, pending or dead-lettered — a conversation whose
last stored row goes on to nothing *stopped without a reason*: verify fails on it (MISSING TURNS) and wait does not
call the job finished (exit 3) — one rule, :func:`thinkfleet.chain_end.owed_successors`.

End to end (real workers — one SIGKILLed between a part write and its finalize, its orphan part finalized by the
other from the stored rows —, the simulator with the dataset's tools in its catalogue, real Parquet, the CLI); every
stored row's ``chain_end`` is what its finalize did (the answer record's reason, "" with a ``next``, else complete):

- an agentic replay job whose recorded turn 0 calls one tool: the model's calls decode; many chains end at a tool
  call the dataset has no result for (parallel calls, or a call at a step the dataset answers) — some at a step
  after results were fed back, before the last turn. ``wait`` finishes and ``verify`` passes (it flagged those
  conversations' next turn as MISSING before), and every ended chain's last row carries its reason;
- an agentic executor job whose chains end at ``max_tool_steps`` before their last turn: the same;
- a ``--turns all`` job one of whose next turns is lost after its predecessor was stored (as a purge and re-submit
  of issue 32 lost them): ``wait`` exits 3 naming the conversation and ``verify`` fails with the same turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from producer.render import load_tokenizer
from sglang_sim.tools import write_catalogue
from storage.reader import read_committed
from testing.datasets import write_jsonl
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.settings import Settings
from thinkfleet.turns import split_step_id
from workers.tool_exec import TRUSTED_ENV

if TYPE_CHECKING:
    from testing.services import RedisServer

ROOT = Path(__file__).parents[1]
EXECUTOR = f"{ROOT / 'docs/examples/agentic/tools.py'}:execute"
CONVERSATIONS = 40
EXEC_CONVERSATIONS = 24
SIM_CONTENT = {"tool_call_share": 0.6, "length_median_tokens": 40.0, "max_tool_calls": 2}
REPLAY, EXEC = "ends-replay", "ends-exec"


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"functions.{name}:{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _rows(n: int) -> list[dict[str, Any]]:
    """Two user turns; the recorded turn 0 calls the calculator once (one result) before its answer."""
    rows = []
    for c in range(n):
        msgs = [
            {"role": "system", "content": "You are a careful assistant with tools."},
            {"role": "user", "content": f"How long is trip {c}?"},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, "calculator", {"expression": "240 / 80"})]},
            {"role": "tool", "tool_call_id": "functions.calculator:0", "content": f"recorded 3 ({c})"},
            {"role": "assistant", "content": "Three hours."},
            {"role": "user", "content": f"And back, for chat {c}?"},
            {"role": "assistant", "content": "Three again."},
        ]
        rows.append({"id": f"c{c}", "messages": msgs})
    return rows


@dataclass
class Fleet:
    settings: Settings
    client: redis.Redis
    tmp: Path
    tok_dir: Path


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Both agentic jobs submitted through the CLI and run to their end by two real workers on the simulator."""
    tmp = tmp_path_factory.mktemp("chain-ends")
    (tmp / "logs").mkdir()
    settings = isolated_settings(redis_server.url(0), str(tmp / "out"))
    client = redis.Redis.from_url(settings.redis_url)
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp / "tools.json", load_tokenizer(str(tok_dir)), "kimi")
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "400"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    common = [
        "--tokenizer", str(tok_dir), "--processes", "1", "--no-progress", "--max-new-tokens", "400", "--seed", "5",
        "--context-length", "131072", "--turns", "all", "--json",
    ]  # fmt: skip
    replay = write_jsonl(tmp / "replay" / "chat.jsonl", _rows(CONVERSATIONS))
    executor = write_jsonl(tmp / "exec" / "chat.jsonl", _rows(EXEC_CONVERSATIONS))
    with simulator(tmp / "logs", *sim_args) as sim:
        env = {**fast_env(settings, sim, max_inflight=8), TRUSTED_ENV: EXECUTOR}
        env.pop(failpoints.TIMES_ENV, None)
        # w0 dies between a part write and its finalize: w1 finalizes the orphan part from the stored rows (the
        # recovery re-plans each row: its finalize must match the chain_end the dead run stored with it).
        armed = {**env, failpoints.ENV: "after_part_write=kill", failpoints.DIR_ENV: str(tmp / "failpoints")}
        (tmp / "failpoints").mkdir()
        workers = [WorkerProcess("w0", armed, tmp / "logs").start(), WorkerProcess("w1", env, tmp / "logs").start()]
        try:
            submits = (
                (REPLAY, replay, ["--tool-results", "replay", "--max-tool-steps", "3"]),
                (EXEC, executor, ["--tool-results", "executor", "--tool-executor", EXECUTOR, "--max-tool-steps", "2"]),
            )
            # The submits run while the workers start (each job's prompts wait in Redis for them).
            with ThreadPoolExecutor(len(submits)) as pool:
                running = [
                    pool.submit(producer_cli, settings, "submit", str(data), "--job", job, *common, *extra)
                    for job, data, extra in submits
                ]
                for w in workers:
                    w.wait_ready(client, settings.keys)
                for done in (f.result() for f in running):
                    assert done.returncode == 0, done.stderr

            def settled() -> bool:
                for job in (REPLAY, EXEC):
                    p = job_progress(client, settings.keys, job)
                    if not (p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]):
                        return False
                return True

            wait_until(settled, 240, what="both agentic jobs")
            assert (tmp / "failpoints" / "failpoint-after_part_write-0").exists(), "w0 died after a part write"
            yield Fleet(settings, client, tmp, tok_dir)
        finally:
            for w in workers:
                w.terminate()
    client.close()


def _answers(run: Fleet, job: str) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.turn_answers(job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _wait_and_verify(run: Fleet, job: str) -> tuple[Any, Any]:
    # queries of the outcome, not operators' processes: in this process (≈ 1.5–3 CPU-s less each)
    waited = producer_cli(run.settings, "wait", job, "--timeout", "60", "--json", in_process=True)
    verified = producer_cli(run.settings, "verify", job, "--json", in_process=True)
    return waited, verified


def _last_rows(run: Fleet, job: str) -> dict[str, dict[str, Any]]:
    """Per conversation, its stored row furthest along the chain (by turn, then step)."""
    rows = read_committed(run.settings.output_uri, job).to_pylist()
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        conv, turn, step = split_step_id(row["prompt_id"]) or ("", 0, 0)
        held = last.get(conv)
        if held is None or (turn, step) > split_step_id(held["prompt_id"])[1:]:  # type: ignore[index]
            last[conv] = row
    return last


def _assert_agree_and_recorded(run: Fleet, job: str, conversations: int, reason: str) -> None:
    waited, verified = _wait_and_verify(run, job)
    report = json.loads(verified.stdout)
    assert (waited.returncode == 0) == (verified.returncode == 0), (waited.stderr, verified.stdout)
    assert waited.returncode == 0, waited.stderr
    assert verified.returncode == 0 and report["missing_turns"] == [], verified.stdout
    # wait's status: every conversation settled — complete or ended with its reason — none stranded, and the
    # stored chains confirmed by verify's rule.
    convs = json.loads(waited.stdout)["conversations"]
    assert convs["total"] == conversations and convs["in_progress"] == 0 and convs["stranded"] == 0, convs
    assert convs["complete"] + convs["chain_ended"] + convs["dead"] == conversations, convs
    assert json.loads(waited.stdout)["missing_turns"] == []
    answers = _answers(run, job)
    # Every stored step records what its finalize did (the dead run's rows, finalized by the recovery, too): goes
    # on ("", the record names its next), complete (neither), or the record's reason.
    for row in read_committed(run.settings.output_uri, job).to_pylist():
        record = answers[row["prompt_id"]]
        want = record.get("chain_end") or ("" if record.get("next") else "complete")
        assert row["chain_end"] == want, (row["prompt_id"], row["chain_end"], record)
    last = _last_rows(run, job)
    assert len(last) == conversations
    early = 0
    ended: dict[str, int] = {}
    for conv, row in last.items():
        record = answers[row["prompt_id"]]
        want = record.get("chain_end") or "complete"
        # The chain's last row carries how it ended (storage), as the answer record (Redis' copy) says.
        assert row["chain_end"] == want, (conv, row["prompt_id"], row["chain_end"], record)
        if want != "complete":
            ended[want] = ended.get(want, 0) + 1
        _, turn, step = split_step_id(row["prompt_id"]) or ("", 0, 0)
        early += want == reason and turn + 1 < row["turn_count"] and step > 0
    assert convs["ends"] == ended
    # The case verify used to flag: a chain ended at a step after results were fed back, before the last turn.
    assert early >= 1, f"no chain of {job} ended with {reason} at a step > 0 before its last turn"


def test_replay_chains_ending_at_a_call_the_dataset_cannot_answer_finish_and_verify(fleet: Fleet) -> None:
    _assert_agree_and_recorded(fleet, REPLAY, CONVERSATIONS, "tool_mismatch")
    # The ends are storage's: with Redis' answer records gone, the stored chains still say where each one stands.
    from storage.chains import owed_in_storage

    key = fleet.settings.keys.turn_answers(REPLAY)
    fleet.client.rename(key, key + ":aside")
    try:
        assert owed_in_storage(fleet.settings, REPLAY, fleet.client) == {}
    finally:
        fleet.client.rename(key + ":aside", key)


def test_executor_chains_ending_at_max_tool_steps_finish_and_verify(fleet: Fleet) -> None:
    _assert_agree_and_recorded(fleet, EXEC, EXEC_CONVERSATIONS, "max_tool_steps")


# -- the rule ------------------------------------------------------------------------------------------------
def test_a_chain_that_stopped_without_a_reason_is_owed_and_one_that_ended_with_a_reason_is_not() -> None:
    from thinkfleet.chain_end import COMPLETE, CONTINUES, owed_successors, record_link, stored_link, walk

    def row(pid: str, end: str | None, calls: bool = False, agentic: bool = True, record: Any = None) -> Any:
        return stored_link(pid, 2, 0 if agentic else None, calls, end, record)

    rows = [
        # a: t0 called tools and went on to its step 1, which ended the chain with a reason before turn 1 (the
        # shape verify flagged as MISSING TURNS before the walk).
        row("a/t0", CONTINUES, calls=True), row("a/t0s1", "tool_mismatch", calls=True),
        # b: complete after two turns, through a step.
        row("b/t0", CONTINUES, calls=True), row("b/t0s1", CONTINUES), row("b/t1", COMPLETE),
        # c: t0 answered without a call and went on to turn 1 — which nobody enqueued: stopped without a reason.
        row("c/t0", CONTINUES),
        # d: t0 went on to its step 1, which is pending (submitted, not stored).
        row("d/t0", CONTINUES, calls=True),
        # e: t0 went on to turn 1, which was dead-lettered (a dead turn ends the chain, in the dead letters).
        row("e/t0", CONTINUES),
        # f: max_tool_steps at step 1 of turn 0.
        row("f/t0", CONTINUES, calls=True), row("f/t0s1", "max_tool_steps", calls=True),
    ]  # fmt: skip
    links = {link.prompt_id: link for link in rows}
    assert walk("a", links) == (["a/t0", "a/t0s1"], "")
    assert walk("c", links) == (["c/t0"], "c/t1")
    assert walk("d", links) == (["d/t0"], "d/t0s1")
    present = {"d/t0s1", "e/t1"}  # submitted or dead-lettered
    owed = owed_successors("abcdef", links, present)
    assert owed == {"c": "c/t1"}
    # The same with a look-up function (status and wait ask Redis about the candidates only).
    asked: list[list[str]] = []
    assert owed_successors("abcdef", links, lambda ids: asked.append(ids) or [p for p in ids if p in present]) == owed
    assert asked == [["c/t1", "d/t0s1", "e/t1"]]
    # Rows written before the column: their Redis answer record decides; without one, a call ends a plain chain.
    old = row("g/t0", None, agentic=False, record={"role": "assistant", "chain_end": "tool_call"})
    assert (old.ends, old.end) == (True, "tool_call")
    assert row("g/t0", None, agentic=False, record={"role": "assistant"}).following == "g/t1"
    assert row("g/t0", None, calls=True, agentic=False).ends
    assert row("g/t1", None, agentic=False).end == COMPLETE
    # An agentic record names what it enqueued; without next nor chain_end it completed its conversation.
    assert record_link("h/t0", 2, {"next": "h/t0s1"}, True).following == "h/t0s1"
    assert record_link("h/t1s2", 2, {}, True).end == COMPLETE


# -- wait and verify on a chain that stopped without a reason ------------------------------------------------
def test_wait_exits_3_and_verify_fails_on_a_stranded_conversation_and_both_pass_once_it_ends(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """A hand-built job state: c0 complete, c1 ended with a reason at turn 0, c2's turn 0 stored saying the chain
    goes on — and its turn 1 never enqueued (the enqueue lost, as issue 32's purge + re-submit lost them)."""
    from producer.submit import submit
    from producer.submit_options import SubmitOptions
    from storage.writer import PartWriter
    from testing.rows import make_row

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    k, job, r = settings.keys, "stranded", redis_client
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    convs = [
        {"id": f"c{c}", "messages": [{"role": "user", "content": f"q{c}.{t}"} if i % 2 == 0 else
                                     {"role": "assistant", "content": f"a{c}.{t}"} for t in range(2) for i in (0, 1)]}
        for c in range(3)
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "chat.jsonl", convs)
    submit(settings, SubmitOptions(paths=[data], job=job, tokenizer=str(tok), processes=1, turns="all"))
    ends = {"chat/c0/t0": "", "chat/c0/t1": "complete", "chat/c1/t0": "tool_call", "chat/c2/t0": ""}
    rows = [
        make_row(pid, dataset="chat", job=job, seed=i, conversation_id=pid.rsplit("/", 1)[0], turn_index=int(pid[-1]),
                 turn_count=2, chain_end=end)
        for i, (pid, end) in enumerate(ends.items())
    ]  # fmt: skip
    PartWriter(settings.output_uri, "w1").write(job, "chat", rows)
    # What the finalizes wrote: done, the answer records (c1's says its chain end), c0's turn 1 submitted.
    r.hset(k.prompts(job), mapping={row["prompt_id"]: row["content_hash"] for row in rows})
    r.hset(k.prompt_dataset(job), mapping=dict.fromkeys(ends, "chat"))
    r.sadd(k.done(job), *ends)
    for pid, end in ends.items():
        r.hset(k.turn_answers(job), pid, json.dumps({"role": "assistant", "content": "a", **({"chain_end": end} if end
                                                     not in ("", "complete") else {})}))  # fmt: skip

    def outcome() -> tuple[int, dict[str, Any], int, dict[str, Any]]:
        waited = producer_cli(settings, "wait", job, "--timeout", "30", "--interval", "0.2", "--json", in_process=True)
        verified = producer_cli(settings, "verify", job, "--json", in_process=True)
        return waited.returncode, json.loads(waited.stdout), verified.returncode, json.loads(verified.stdout)

    wait_rc, st, verify_rc, report = outcome()
    assert (wait_rc, verify_rc) == (3, 1), (st, report)
    assert st["remaining"] == 0 and not st["finished"]
    assert st["conversations"]["stranded"] == 1 and st["conversations"]["stranded_ids"] == ["chat/c2/t1"]
    assert st["conversations"]["ends"] == {"tool_call": 1} and st["conversations"]["complete"] == 1
    assert report["missing_turns"] == ["chat/c2/t1"]
    view = producer_cli(settings, "status", job, in_process=True)
    assert "1 conversation(s) stopped without a recorded end" in " ".join(view.stdout.split()), view.stdout

    # Redis' copy says c2's chain ended (as a recovery that diverged from the stored row could leave it): status
    # believes it, but storage — the truth, which verify reads — says the chain goes on: wait confirms from storage.
    r.hset(k.turn_answers(job), "chat/c2/t0", json.dumps({"role": "assistant", "chain_end": "tool_call"}))
    wait_rc, st, verify_rc, report = outcome()
    assert st["conversations"]["stranded"] == 0, st["conversations"]
    assert (wait_rc, verify_rc) == (3, 1) and st["missing_turns"] == report["missing_turns"] == ["chat/c2/t1"]

    # Once the turn is dead-lettered (a dead turn ends the chain, in the dead letters), both call the job done.
    r.hset(k.turn_answers(job), "chat/c2/t0", json.dumps({"role": "assistant"}))
    r.hset(k.dead(job), "chat/c2/t1", json.dumps({"error_class": "context_overflow"}))
    r.hset(k.prompts(job), "chat/c2/t1", "h-chat/c2/t1")
    r.hset(k.prompt_dataset(job), "chat/c2/t1", "chat")
    wait_rc, st, verify_rc, report = outcome()
    assert (wait_rc, verify_rc) == (0, 0), (st, report)
    assert st["finished"] and st["conversations"]["dead"] == 1 and report["missing_turns"] == []
