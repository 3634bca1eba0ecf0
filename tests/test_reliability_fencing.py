"""A worker *paused* past its lease — a GC pause, a frozen VM, a partition, a CPU-starved box — comes back
after another worker took its prompts over. Fencing (thinkfleet/state/ledger.py) keeps every prompt once:

- paused with rows waiting for their group commit, it finds its claims taken at ``mark_part`` and writes
  nothing (its messages are acked as ``fenced``);
- paused between that check and the part write (failpoint ``after_mark=stop``), its part lands after the
  other worker's, with a lower epoch: ``finalize`` refuses it, the committed view leaves it out (``verify``
  reports it as fenced, not duplicated) and ``producer compact`` removes it.

Real ``worker`` processes, a real Redis, the simulator over HTTP; every wait is on an event, not a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import redis

from sglang_sim.testing import SimulatorProcess
from storage import reader
from storage.schema import EPOCH, PROMPT_ID
from testing.fleet import WorkerProcess, in_flight, job_progress, job_settled, wait_until
from testing.harness import fast_env, isolated_settings, make_prompts, producer_cli, submit_ids
from testing.invariant_watch import InvariantWatch
from testing.record import Outcome, check_job, record_result
from thinkfleet import failpoints
from thinkfleet.settings import Settings

PROMPTS = 48
#: Short enough that the test does not wait long for the paused worker's lease to lapse; the other worker's
#: lease may lapse too on a busy box — fencing makes that harmless, which is the point.
LEASE = {"lease_s": 4, "reaper_interval_s": 0.5}


def _fenced_count(client: redis.Redis, settings: Settings, job: str) -> int:
    return int(client.hget(settings.keys.counters(job), "fenced") or 0)


def _committed_epochs_match(client: redis.Redis, settings: Settings, job: str) -> None:
    """Storage's committed row of every prompt is the very row Redis finalized (its epoch)."""
    winners = reader.read_committed(settings.output_uri, job, columns=[PROMPT_ID, EPOCH])
    stored = dict(zip(winners[PROMPT_ID].to_pylist(), winners[EPOCH].to_pylist(), strict=True))
    recorded = {k.decode(): int(v) for k, v in client.hgetall(settings.keys.committed_epochs(job)).items()}
    assert stored == recorded, "the committed view must be the row Redis counted"


def _run(
    tmp_path: Path, sim: SimulatorProcess, redis_url: str, job_name: str, zombie_env: dict[str, str]
) -> tuple[Settings, redis.Redis, WorkerProcess, WorkerProcess, float]:
    """Start the zombie-to-be and the other worker; submit; returns once the job is submitted."""
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    env = fast_env(settings, sim.url, max_inflight=8, flush_interval_s=10, **LEASE)
    zombie = WorkerProcess("zombie", {**env, **zombie_env}, tmp_path).start()
    other = WorkerProcess("other", env, tmp_path)
    zombie.wait_ready(client, settings.keys)
    return settings, client, zombie, other, time.monotonic()


def test_a_worker_paused_past_its_lease_with_rows_waiting_to_commit_stores_nothing_twice(
    sim: SimulatorProcess, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker holding finished rows that wait for their group commit (flush every 10 s).
    job_name = "zombie-pending"
    settings, client, zombie, other, started = _run(tmp_path, sim, redis_url, job_name, {})
    keys = settings.keys
    invariant = InvariantWatch(settings, job_name, interval_s=0.25)
    try:
        job = submit_ids(settings, job_name, make_prompts(PROMPTS, seed=3), max_new_tokens=256)
        invariant.start()
        wait_until(lambda: len(in_flight(client, keys, job_name, "zombie")) >= 4, 120, 0.05, what="zombie claims")
        # When it is paused (SIGSTOP: every thread, the heartbeat too) past its lease while another worker
        # takes over its prompts and finishes the whole job.
        assert zombie.proc is not None
        os.kill(zombie.proc.pid, signal.SIGSTOP)
        wait_until(lambda: zombie.stopped(), 30, 0.05, what="the zombie stopped")
        held = in_flight(client, keys, job_name, "zombie")
        other.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, job_name)["done"] == PROMPTS, 180, 0.1, what="all stored")
        paused_s = time.monotonic() - started
        # And then it resumes: its commit finds its claims are other runs' now.
        os.kill(zombie.proc.pid, signal.SIGCONT)
        wait_until(lambda: _fenced_count(client, settings, job_name) >= 1, 120, 0.1, what="the zombie fenced")
        wait_until(lambda: job_settled(client, settings, job_name, PROMPTS), 120, 0.1, what="every message settled")
    finally:
        invariant.stop()
        zombie.cont()
        zombie.kill()
        other.kill()
    # Then every prompt is stored once, byte-exact; verify passes; storage's committed rows are Redis's.
    outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
    record_result(
        "worker paused (SIGSTOP) past its lease with rows waiting to commit, then SIGCONT",
        outcome,
        f"2 workers, lease {LEASE['lease_s']} s, flush 10 s, {len(held)} claims held when paused",
        [paused_s],
        time.monotonic() - started,
        workers=2,
        notes=f"{_fenced_count(client, settings, job_name)} runs fenced (acked, nothing stored)",
    )
    outcome.assert_clean()
    invariant.assert_held()
    _committed_epochs_match(client, settings, job_name)
    assert zombie.log_path.read_text(errors="replace").count("fenced:") >= 1
    status = producer_cli(settings, "status", job_name, "--json", in_process=True)
    assert json.loads(status.stdout)["fenced"] >= 1, "producer status says runs were fenced"


def test_a_pause_between_the_claim_check_and_the_part_write_is_fenced_in_storage(
    sim: SimulatorProcess, redis_url: str, tmp_path: Path
) -> None:
    # Given a worker that stops itself (SIGSTOP) right after mark_part checked its claims, before it writes.
    job_name = "zombie-write"
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    armed = {failpoints.ENV: "after_mark=stop", failpoints.DIR_ENV: str(fp_dir), failpoints.TIMES_ENV: "1"}
    settings, client, zombie, other, started = _run(tmp_path, sim, redis_url, job_name, armed)
    keys = settings.keys
    invariant = InvariantWatch(settings, job_name, interval_s=0.25)
    try:
        job = submit_ids(settings, job_name, make_prompts(PROMPTS, seed=4), max_new_tokens=256)
        invariant.start()
        wait_until(lambda: zombie.stopped(), 120, 0.05, what="the zombie stopped at after_mark")
        # When another worker takes its prompts over after its lease and stores the whole job.
        other.start().wait_ready(client, keys)
        wait_until(lambda: job_progress(client, keys, job_name)["done"] == PROMPTS, 180, 0.1, what="all stored")
        paused_s = time.monotonic() - started
        # And the zombie resumes: its part lands now, then its finalize is refused.
        assert zombie.proc is not None
        os.kill(zombie.proc.pid, signal.SIGCONT)
        wait_until(lambda: _fenced_count(client, settings, job_name) >= 1, 120, 0.1, what="the zombie fenced")
        wait_until(lambda: job_settled(client, settings, job_name, PROMPTS), 120, 0.1, what="every message settled")
    finally:
        invariant.stop()
        zombie.cont()
        zombie.kill()
        other.kill()
    # Then the zombie's rows are in storage but fenced: a lower epoch than the committed row of their prompt.
    keys_table = reader.read_keys(settings.output_uri, job_name)
    fenced = reader.fenced_rows(keys_table)
    assert fenced.num_rows >= 1, "the zombie's part should have landed (the failpoint stops before the write)"
    assert set(fenced["worker"].to_pylist()) == {"zombie"}
    assert reader.duplicate_rows(keys_table).num_rows == 0
    # And the committed view is exactly once, byte-exact, and the very rows Redis counted; verify passes.
    outcome = check_job(settings, job_name, job.prompts, job.sampling_params)
    record_result(
        "worker paused (failpoint after_mark=stop) between its claim check and its part write, then SIGCONT",
        outcome,
        f"2 workers, lease {LEASE['lease_s']} s, flush 10 s",
        [paused_s],
        time.monotonic() - started,
        workers=2,
        notes=f"{fenced.num_rows} fenced rows in storage, left out of the view; compact removes them",
    )
    outcome.assert_clean()
    invariant.assert_held()
    _committed_epochs_match(client, settings, job_name)
    # And producer compact removes the fenced rows, keeping the committed view as it was.
    before = reader.read_committed(settings.output_uri, job_name, columns=[PROMPT_ID, EPOCH])
    result = producer_cli(settings, "compact", job_name, in_process=True)
    assert result.returncode == 0, result.stdout + result.stderr
    after_keys = reader.read_keys(settings.output_uri, job_name)
    assert reader.fenced_rows(after_keys).num_rows == 0
    assert reader.read_committed(settings.output_uri, job_name, columns=[PROMPT_ID, EPOCH]).equals(before)


def test_a_paused_turn_of_a_multi_turn_job_never_changes_what_the_next_turn_was_rendered_from(
    redis_url: str, tmp_path: Path
) -> None:
    """A ``--turns all`` job whose outputs differ per attempt (temperature > 0: ``--sample-per-request``): the zombie's
    turn row lands after another worker regenerated that turn differently and rendered the next turn from its own
    answer. The committed view must keep the answer the next turn was rendered from, before and after compact."""
    from producer.render import load_tokenizer, render_ids
    from storage.conversations import ToolMarkers, output_message
    from testing.datasets import conversation_rows, write_jsonl
    from testing.harness import simulator
    from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
    from thinkfleet.state.job import JobRecord
    from thinkfleet.turns import plan_conversation, turn_messages

    conversations, turns = 6, 3
    total = conversations * turns
    job_name = "zombie-turns"
    (tmp_path / "logs").mkdir()
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    rows = conversation_rows(conversations, turns, 10, "Be careful.", reasoning="x")
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    started = time.monotonic()
    with simulator(tmp_path / "logs", "--time-scale", "400", "--sample-per-request", "--tool-call-share", "0") as sim:
        env = fast_env(settings, sim, max_inflight=4, flush_interval_s=2, **LEASE)
        armed = {failpoints.ENV: "after_mark=stop", failpoints.DIR_ENV: str(fp_dir), failpoints.TIMES_ENV: "1"}
        zombie = WorkerProcess("zombie", {**env, **armed}, tmp_path / "logs").start()
        other = WorkerProcess("other", env, tmp_path / "logs")
        try:
            zombie.wait_ready(client, keys)
            submitted = producer_cli(
                settings, "submit", str(data), "--job", job_name, "--tokenizer", str(tok_dir), "--processes", "1",
                "--no-progress", "--max-new-tokens", "200", "--context-length", "131072", "--turns", "all", "--json",
                in_process=True,
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            # Given the zombie stopped between its claim check and its part write.
            wait_until(lambda: zombie.stopped(), 120, 0.05, what="the zombie stopped at after_mark")
            # When the other worker regenerates its turns (differently) and finishes every conversation.
            other.start().wait_ready(client, keys)
            wait_until(lambda: job_progress(client, keys, job_name)["done"] == total, 180, 0.1, what="all turns")
            # And the zombie resumes: its turn rows land, its finalize is refused.
            assert zombie.proc is not None
            os.kill(zombie.proc.pid, signal.SIGCONT)
            wait_until(lambda: _fenced_count(client, settings, job_name) >= 1, 120, 0.1, what="the zombie fenced")
            wait_until(lambda: not client.hlen(keys.claims(job_name)), 120, 0.1, what="no claim left")
        finally:
            if zombie.alive() and zombie.proc is not None:
                os.kill(zombie.proc.pid, signal.SIGCONT)
            zombie.kill()
            other.kill()
    fenced = reader.fenced_rows(reader.read_keys(settings.output_uri, job_name))
    assert fenced.num_rows >= 1 and set(fenced["worker"].to_pylist()) == {"zombie"}
    verify = producer_cli(settings, "verify", job_name, "--json", in_process=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    record = JobRecord.load(client, keys, job_name)
    assert record is not None
    tok = load_tokenizer(str(tok_dir))
    markers = ToolMarkers.of(record)
    source = [json.loads(line) for line in data.read_text().splitlines()]

    def mismatches() -> list[str]:
        """Stored turns whose prompt is not the template's rendering of the committed earlier turns."""
        rows = {r["prompt_id"]: r for r in reader.read_committed(settings.output_uri, job_name).to_pylist()}
        assert len(rows) == total
        bad = []
        for c, conv_row in enumerate(source):
            conv = plan_conversation(conv_row["messages"])
            assert conv is not None
            answers: list[dict] = []
            for t in range(turns):
                row = rows[f"chat/c{c}/t{t}"]
                want = render_ids(tok, turn_messages(conv, answers), None, record.chat_template_kwargs)
                if row["input_ids"] != want:
                    bad.append(row["prompt_id"])
                spans = [(s["start"], s["end"]) for s in row["tool_call_spans"]]
                reasoning = (row["reasoning_start"], row["reasoning_end"])
                answer = (row["answer_start"], row["answer_end"])
                answers.append(output_message(tok, row["output_ids"], reasoning, answer, spans, markers))
        return bad

    # Then every stored turn's prompt renders the committed previous turns — before compact and after it.
    assert mismatches() == []
    compacted = producer_cli(settings, "compact", job_name, in_process=True)
    assert compacted.returncode == 0, compacted.stdout + compacted.stderr
    assert reader.fenced_rows(reader.read_keys(settings.output_uri, job_name)).num_rows == 0
    assert mismatches() == []
    record_result(
        "--turns all: a worker paused between its claim check and its part write, outputs differing per attempt",
        Outcome(total, total, 0, [], [], [], verify_ok=True, status_agrees=True, problems=[]),
        f"2 workers, lease {LEASE['lease_s']} s, {conversations}×{turns} turns, --sample-per-request",
        [],
        time.monotonic() - started,
        workers=2,
        notes=f"{fenced.num_rows} fenced turn rows; every turn renders the committed previous turns",
    )
