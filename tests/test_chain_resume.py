"""A ``--turns all`` job's conversations resume from storage after ``producer purge`` or a lost Redis.

Given 3-turn conversations submitted with the real CLI and the Kimi test tokenizer, run by a real worker against
the simulator to about half done (some conversations stored up to turn 0, some up to turn 1), when the job's
Redis state goes away — ``producer purge --force`` (workers stopped; or one worker kept running across it), or
Redis lost entirely — and the same ``producer submit`` runs again, then for every conversation the last stored
turn decides what comes next: its successor is derived from the stored row as a worker's finalize would (the
same tokenizer, template and the new generation), every conversation completes, ``producer wait`` exits 0,
``producer verify`` passes, and each turn i+1's prompt is the template's rendering of the conversation with the
model's own (stored) answers of turns 0..i. The same for an agentic job's step chains (``--tool-results
replay``). And the plan itself (producer/chains.py), read from real parts: which stored turns get a settled claim
naming their part, and which one per conversation is enqueued again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import expected_generation
from storage.conversations import ToolMarkers, output_message
from storage.reader import raw_duplicates, read_committed, stored_prompt_ids
from storage.verify import verify_job
from testing.datasets import agentic_rows, conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, sim_stats, simulator
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import plan_conversation, turn_messages

#: Enough conversations that stopping at about half leaves some at each of their turns.
CONVERSATIONS, TURNS = 20, 3
TOTAL = CONVERSATIONS * TURNS
#: Fields of a verify report that say nothing is wrong.
OK_FIELDS = {
    "job", "submitted_source", "submitted", "stored_rows", "committed", "thinking_rows", "think_end_rows",
    "reasoning_spans", "per_dataset", "notes", "superseded", "quality_flags",
}  # fmt: skip
#: Stop the first run once this many turns are stored: about half, so chains stand at turn 0 and turn 1.
HALF = TOTAL // 2


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return Path(build_test_tokenizer(default_test_tokenizer_dir()))


def _submit_args(data: Path, job: str, tok_dir: Path) -> tuple[str, ...]:
    return (
        "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1", "--no-progress",
        "--max-new-tokens", "300", "--seed", "3", "--context-length", "131072", "--turns", "all", "--json",
    )  # fmt: skip


def _data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", conversation_rows(CONVERSATIONS, TURNS, 10, "Be careful.", "x"))


def _progress(client: redis.Redis, settings: Settings, job: str) -> int:
    try:
        return job_progress(client, settings.keys, job)["done"]
    except redis.RedisError:
        return -1


def _stranded_before(settings: Settings, job: str) -> set[str]:
    """Conversations whose last stored turn has a successor (not the last turn): what a re-submit must resume."""
    stored = stored_prompt_ids(settings.output_uri, job)
    last: dict[str, int] = {}
    for pid in stored:
        conv, _, t = pid.rpartition("/t")
        last[conv] = max(last.get(conv, -1), int(t))
    return {c for c, t in last.items() if t + 1 < TURNS}


def _resubmit_and_finish(settings: Settings, args: tuple[str, ...], job: str) -> dict:
    again = producer_cli(settings, *args, in_process=True)
    assert again.returncode == 0, again.stdout + again.stderr
    report = json.loads(again.stdout)
    waited = producer_cli(settings, "wait", job, "--timeout", "150", "--interval", "0.5", "--json", in_process=True)
    assert waited.returncode == 0, f"wait exited {waited.returncode}: {waited.stdout[-2000:]} {waited.stderr}"
    return {"report": report, "wait": json.loads(waited.stdout.strip().splitlines()[-1])}


def _assert_every_chain_complete(settings: Settings, client: redis.Redis, job: str, data: Path, tok_dir: Path) -> None:
    """Every conversation went on to its last turn, or to the turn whose answer calls a tool (the chain ends there,
    recorded): each of those turns stored once, rendered from the stored answers before it, byte-exact; no turn
    stored past a chain end; verify passes and status agrees."""
    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, job).to_pylist()}
    assert raw_duplicates(settings.output_uri, job).num_rows == 0, "no turn stored twice"
    record = JobRecord.load(client, settings.keys, job)
    assert record is not None
    tok = load_tokenizer(str(tok_dir))
    markers = ToolMarkers.of(record)
    source = [json.loads(line) for line in data.read_text().splitlines()]
    expected: set[str] = set()
    ended = 0
    for c, conv_row in enumerate(source):
        conv = plan_conversation(conv_row["messages"])
        assert conv is not None
        answers: list[dict] = []
        for t in range(TURNS):
            pid = f"chat/c{c}/t{t}"
            expected.add(pid)
            assert pid in rows, f"{pid} never stored: its conversation stopped without a chain end"
            row = rows[pid]
            want = render_ids(tok, turn_messages(conv, answers), None, record.chat_template_kwargs)
            assert row["input_ids"] == want, f"turn {t} of c{c} is not rendered from the stored answers before it"
            sampling = json.loads(row["sampling_params"])
            assert row["output_ids"] == expected_generation(row["input_ids"], sampling).output_ids
            spans = [(s["start"], s["end"]) for s in row["tool_call_spans"]]
            span = (row["reasoning_start"], row["reasoning_end"]), (row["answer_start"], row["answer_end"])
            answers.append(output_message(tok, row["output_ids"], *span, spans, markers))
            if answers[-1].get("tool_calls") and t + 1 < TURNS:
                ended += 1  # the next user turn would follow a call with no result: the chain ends here
                break
    assert set(rows) == expected, f"stored past a chain end: {sorted(set(rows) - expected)[:5]}"
    report = verify_job(settings, job)
    assert report.ok, report.to_dict()
    status = producer_cli(settings, "status", job, "--json", "--deep", in_process=True)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["finished"] and st["unaccounted"] == 0 and st["done"] == st["total"] == len(expected), status.stdout
    convs = st["conversations"]
    assert convs["complete"] == CONVERSATIONS - ended and convs["chain_ended"] == ended, convs


def test_purge_force_and_the_same_submit_resume_every_conversation(
    redis_url: str, tmp_path: Path, tok_dir: Path
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job, data = "resume", _data(tmp_path)
    args = _submit_args(data, job, tok_dir)
    with simulator(tmp_path, "--time-scale", "100") as sim:
        env = fast_env(settings, sim, max_inflight=4)
        # Given the job run to about half done, its workers then stopped.
        first = WorkerProcess("w1", env, tmp_path).start()
        try:
            first.wait_ready(client, settings.keys)
            submitted = producer_cli(settings, *args, in_process=True)
            assert submitted.returncode == 0, submitted.stderr
            wait_until(lambda: _progress(client, settings, job) >= HALF, 240, 0.05, what=f"{HALF} turns stored")
        finally:
            first.terminate()
        stranded = _stranded_before(settings, job)
        assert stranded, "some conversations stand between their first and last turn"
        # When the job is purged (--force: its queued turns are cancelled first) and submitted again.
        purged = producer_cli(settings, "purge", job, "--force", in_process=True)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        # (And one conversation's turn 1 is stored with other content than its turn 0 renders — as a turn 1 derived
        # from an answer that is no longer the committed one: it must be generated again, never finalized.)
        _store_foreign_turn(settings, job)
        second = WorkerProcess("w2", env, tmp_path).start()
        try:
            second.wait_ready(client, settings.keys)
            done = _resubmit_and_finish(settings, args, job)
        finally:
            second.terminate()
    # Then the re-submit enqueued the successor of every stranded conversation's last stored turn, and every
    # conversation completed from its stored turns.
    assert done["report"]["enqueued"] >= len(stranded), done["report"]
    _assert_every_chain_complete(settings, client, job, data, tok_dir)


def _store_foreign_turn(settings: Settings, job: str) -> str:
    """A row for turn 1 of the first conversation whose turn 0 is stored, with content no chain renders, the
    winner among its rows now (epoch just above every stored row's)."""
    from storage.reader import read_keys
    from storage.writer import PartWriter
    from testing.rows import make_row

    keys = read_keys(settings.output_uri, job)
    stored = set(keys["prompt_id"].to_pylist())
    conv = next(f"chat/c{c}" for c in range(CONVERSATIONS) if f"chat/c{c}/t0" in stored)
    epoch = max(e or 0 for e in keys["epoch"].to_pylist()) + 1
    row = make_row(
        f"{conv}/t1", dataset="chat", job=job, seed=5, conversation_id=conv, turn_index=1, turn_count=TURNS,
        row_index=int(conv.rsplit("c", 1)[1]), epoch=epoch,
    )  # fmt: skip
    PartWriter(settings.output_uri, "forger").write(job, "chat", [row])
    return row["prompt_id"]


@pytest.mark.slow  # a purge racing a running worker: CI runs tests/test_reliability_generations.py's
def test_purge_force_and_resubmit_with_a_worker_kept_running(redis_url: str, tmp_path: Path, tok_dir: Path) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job, data = "kept", _data(tmp_path)
    args = _submit_args(data, job, tok_dir)
    with simulator(tmp_path, "--time-scale", "100") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path).start()
        try:
            worker.wait_ready(client, settings.keys)
            submitted = producer_cli(settings, *args, in_process=True)
            assert submitted.returncode == 0, submitted.stderr
            wait_until(lambda: _progress(client, settings, job) >= HALF, 240, 0.05, what=f"{HALF} turns stored")
            # When the job is purged under the running worker (which has cached its record and tokenizer) and
            # submitted again: a new generation.
            purged = producer_cli(settings, "purge", job, "--force", in_process=True)
            assert purged.returncode == 0, purged.stdout + purged.stderr
            done = _resubmit_and_finish(settings, args, job)
        finally:
            worker.terminate()
    # Then the worker derived the later turns with the new generation: every conversation completed.
    assert done["report"]["enqueued"] > 0, done["report"]
    _assert_every_chain_complete(settings, client, job, data, tok_dir)


def test_redis_lost_entirely_and_the_same_submit_resume_every_conversation(tmp_path: Path, tok_dir: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        settings = isolated_settings(server.url(), str(tmp_path / "out"))
        client = redis.Redis.from_url(server.url())
        job, data = "lost", _data(tmp_path)
        args = _submit_args(data, job, tok_dir)
        with simulator(tmp_path, "--time-scale", "100") as sim:
            worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path).start()
            try:
                worker.wait_ready(client, settings.keys)
                submitted = producer_cli(settings, *args, in_process=True)
                assert submitted.returncode == 0, submitted.stderr
                wait_until(lambda: _progress(client, settings, job) >= HALF, 240, 0.05, what=f"{HALF} turns stored")
                # When Redis is lost entirely (killed, an empty one in its place), the worker kept running…
                server.stop(kill=True)
                server.start()
                worker.wait_ready(client, settings.keys)
                # …its in-flight requests settled (stored, or handed back to nowhere),
                settled = [-1]

                def quiet() -> bool:
                    completed = int(sim_stats(sim)["completed"])
                    still, settled[0] = completed == settled[0], completed
                    return still

                wait_until(quiet, 60, interval_s=1.5, what="in-flight requests settled")
                # …and the same `producer submit` runs again.
                done = _resubmit_and_finish(settings, args, job)
            finally:
                worker.terminate()
        assert done["report"]["enqueued"] > 0, done["report"]
        _assert_every_chain_complete(settings, client, job, data, tok_dir)
    finally:
        server.stop()


def test_purge_force_and_resubmit_resume_agentic_step_chains(redis_url: str, tmp_path: Path, tok_dir: Path) -> None:
    """The same for an agentic job (``--tool-results replay``): a chain of steps resumes at its last stored step,
    each step's prompt the rendering of the conversation up to it with the results fed back."""
    from sglang_sim.content import ContentConfig
    from sglang_sim.tools import write_catalogue
    from tests.test_agentic_replay import SIM_CONTENT, AgenticJob, _check_chains

    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job = "agentic-resume"
    data = write_jsonl(tmp_path / "chat.jsonl", agentic_rows(16, 2))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok_dir)), "kimi")
    content = ContentConfig(tool_catalogue=str(catalogue), **SIM_CONTENT)  # type: ignore[arg-type]
    args = (
        "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1", "--no-progress",
        "--max-new-tokens", "400", "--seed", "3", "--context-length", "131072", "--turns", "all",
        "--max-tool-steps", "3", "--tool-results", "replay", "--tool-mismatch", "keep_recorded", "--json",
    )  # fmt: skip
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "100"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    with simulator(tmp_path, *sim_args) as sim:
        env = fast_env(settings, sim, max_inflight=4)
        first = WorkerProcess("w1", env, tmp_path).start()
        try:
            first.wait_ready(client, settings.keys)
            submitted = producer_cli(settings, *args, in_process=True)
            assert submitted.returncode == 0, submitted.stderr
            wait_until(lambda: _progress(client, settings, job) >= 30, 240, 0.05, what="30 steps stored")
        finally:
            first.terminate()
        purged = producer_cli(settings, "purge", job, "--force", in_process=True)
        assert purged.returncode == 0, purged.stdout + purged.stderr
        second = WorkerProcess("w2", env, tmp_path).start()
        try:
            second.wait_ready(client, settings.keys)
            done = _resubmit_and_finish(settings, args, job)
        finally:
            second.terminate()
    assert done["report"]["resumed"] > 0, done["report"]
    run = AgenticJob(settings, client, job, data, tok_dir, content, tmp_path, "", tmp_path / "none")
    _check_chains(run, job)  # every chain walked from t0 along `next` is stored, rendered from what precedes it
    report = verify_job(settings, job)
    # verify agrees: no chain that ended with a recorded reason is flagged (thinkfleet/chain_end.py), none is missing.
    problems = {k: v for k, v in report.to_dict().items() if v and k not in OK_FIELDS and k != "ok"}
    assert report.ok, json.dumps(report.to_dict())[:3000]
    assert not problems, json.dumps(problems)[:3000]
    status = producer_cli(settings, "status", job, "--json", "--deep", in_process=True)
    st = json.loads(status.stdout)
    assert st["finished"] and st["unaccounted"] == 0 and st["conversations"]["in_progress"] == 0, st["conversations"]


def test_the_replay_plan_claims_every_unfinalized_stored_turn_and_enqueues_each_conversations_earliest(
    tmp_path: Path,
) -> None:
    """The plan a re-submit writes (producer/chains.py), read from real parts: every stored turn Redis does not count
    finished gets a settled claim naming the part its winning row is in; each conversation's earliest such turn
    (steps order within their turn: t0s2 before t1) is enqueued again from its stored row, with the new generation."""
    from producer.chains import plan_replay, replay_candidates
    from storage.writer import PartWriter
    from testing.rows import make_row
    from thinkfleet.message import content_hash, unpack_ids

    def row(pid: str, seed: int, revision: int = 0) -> dict:
        conv, _, _ = pid.rpartition("/t")
        made = make_row(pid, dataset="chat", job="mt", seed=seed, conversation_id=conv, revision=revision)
        # the hash of its ids, as a submit stores it: a replayed turn is checked against it before it is enqueued
        return {**made, "content_hash": content_hash(made["input_ids"])}

    stored = ["chat/c0/t0", "chat/c0/t0s1", "chat/c0/t0s2", "chat/c0/t1", "chat/c1/t0", "chat/c1/t1", "chat/c2/t0"]
    writer = PartWriter(str(tmp_path / "out"), "w1")
    first = writer.write("mt", "chat", [row(p, i) for i, p in enumerate(stored)])
    # c1/t1 re-run (revision 1) in another part: its winner is there.
    second = writer.write("mt", "chat", [row("chat/c1/t1", 99, revision=1)])
    settings = Settings(output_uri=str(tmp_path / "out"))
    # c0's first two steps and c1/t0 are done (finalized in this Redis), c2 is not a conversation of this submit.
    finished = {"chat/c0/t0", "chat/c0/t0s1", "chat/c1/t0"}
    candidates = replay_candidates(stored, finished, {"chat/c0", "chat/c1"})
    assert candidates == {"chat/c0/t0s2", "chat/c0/t1", "chat/c1/t1"}
    plan = plan_replay(settings, "mt", candidates, "gen2")
    assert plan.held == candidates
    parts = {pid: json.loads(claim)["part"] for pid, claim in plan.claims.items()}
    assert parts["chat/c1/t1"] == second and parts["chat/c0/t0s2"] == first
    assert all(json.loads(c)["settled"] and json.loads(c)["worker"] == "" for c in plan.claims.values())
    assert [t.prompt_id for t in plan.heads] == ["chat/c0/t0s2", "chat/c1/t1"]
    head = plan.heads[1]
    assert (head.revision, head.generation, head.dataset) == (1, "gen2", "chat")
    ids = unpack_ids(head.ids_blob, None)
    assert ids == row("chat/c1/t1", 99, revision=1)["input_ids"] and head.content_hash == content_hash(ids)
