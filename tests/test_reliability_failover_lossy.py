"""A head that fails over and loses acknowledged writes (issue 34): the Sentinel-managed head of
test_reliability_failover.py, its replicas cut off from the primary while the workers store and ack rows, then the
primary killed and a replica without those writes promoted — the worst failover, for single prompts and for a
``--turns all`` job whose every request draws its own answer.

Redis then lacks finalizes, acks and next turns the workers already acted on: a rollback, which the workers' finalize
marks notice and recover from the stored parts. Each job must end exactly once and (single prompts) byte-exact, every
chain whole, and ``producer wait`` — started before the failover — must return 0 on its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from storage.reader import raw_duplicates, read_committed
from testing.chains import chain_problems
from testing.datasets import conversation_rows, write_jsonl
from testing.harness import make_prompts, producer_cli, submit_ids
from testing.record import Outcome, check_job, record_result
from testing.sentinel import SentinelFleet, sentinel_fleet
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.state.job import JobRecord


def _lose_writes(fleet: SentinelFleet, job: str, stored: int) -> tuple[int, int]:
    """Cut the replicas off, wait until the workers store (and ack) ``stored`` more rows, kill the primary, wait for
    the promotion of a replica without them. Returns (rows stored while cut off, the new primary's port)."""
    head = fleet.head
    old = head.primary_port()
    assert old is not None
    replicas = head.cut_replication(old)
    cut_done = fleet.done(job)
    try:
        fleet.wait_done(job, cut_done + stored, f"{stored} rows stored while the replicas receive nothing", 120)
        lost = fleet.done(job) - cut_done
        head.process_on(old).stop(kill=True)
    finally:
        head.restore_replication(replicas)
    return lost, head.wait_for_new_primary(old)


def test_a_failover_that_loses_acknowledged_writes_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    started = time.monotonic()
    with sentinel_fleet(tmp_path) as fleet:
        job = submit_ids(fleet.settings, "lossy", make_prompts(80))
        waiter, wait_err = fleet.start_wait("lossy")
        fleet.wait_done("lossy", 15, "15 rows", 120)
        # When the replicas stop receiving while the workers store and ack ten more rows, the primary dies, and a
        # replica without those writes is promoted…
        failed_at = time.monotonic()
        lost, new = _lose_writes(fleet, "lossy", min(10, 80 - fleet.done("lossy")))
        fleet.settle("lossy", 80)
        recovered_s = time.monotonic() - failed_at
        # Then wait returns 0 by itself, and every prompt is stored once, byte-exact.
        assert waiter.wait(timeout=120) == 0, wait_err.read_text()
        assert "Traceback" not in wait_err.read_text(), wait_err.read_text()
        fleet.stop_workers()
        outcome = check_job(fleet.settings, "lossy", job.prompts, job.sampling_params)
    record_result(
        "Sentinel head: acknowledged writes lost in a failover",
        outcome,
        f"replicas cut off while {lost} rows were stored and acked, primary killed, a replica without them promoted "
        f"(port {new})",
        [recovered_s],
        time.monotonic() - started,
        workers=2,
    )
    outcome.assert_clean()


def test_a_turns_all_job_whose_failover_loses_acknowledged_writes_keeps_every_chain_whole(tmp_path: Path) -> None:
    # The lost writes include finalizes that enqueued next turns, and every request draws its own answer
    # (--sample-per-request): each chain must still run turn by turn, turn i+1 rendered from the committed turn i,
    # once — never from an answer generated again after the loss.
    conversations, turns = 10, 3
    total = conversations * turns
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    data = write_jsonl(tmp_path / "chat.jsonl", conversation_rows(conversations, turns, 10, "Be careful."))
    started = time.monotonic()
    with sentinel_fleet(tmp_path, sim_args=("--sample-per-request", "--tool-call-share", "0")) as fleet:
        settings = fleet.settings
        submitted = producer_cli(
            settings, "submit", str(data), "--job", "chains", "--tokenizer", str(tok_dir), "--processes", "1",
            "--no-progress", "--max-new-tokens", "200", "--context-length", "131072", "--turns", "all",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        fleet.wait_done("chains", 8, "8 turns", 120)
        lost, _ = _lose_writes(fleet, "chains", min(8, total - fleet.done("chains")))
        fleet.settle("chains", total)
        fleet.stop_workers()
        verify = producer_cli(settings, "verify", "chains", "--json")
        dups = raw_duplicates(settings.output_uri, "chains")
        duplicated = sorted(set(dups["prompt_id"].to_pylist())) if dups.num_rows else []
        rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "chains").to_pylist()}
        record = JobRecord.load(fleet.client, settings.keys, "chains")
        assert record is not None
        problems = chain_problems(data, "chat", tok_dir, record, rows, exact_outputs=False)
        status = json.loads(producer_cli(settings, "status", "chains", "--json").stdout)
    finished = status.get("finished") is True
    record_result(
        "Sentinel head: a --turns all job's failover loses acknowledged writes",
        Outcome(total, len(rows), 0, [], duplicated, [], verify.returncode == 0, finished, problems),
        f"replicas cut off while {lost} turns were stored and acked (next turns enqueued), primary killed; every "
        "request its own answer",
        [],
        time.monotonic() - started,
        workers=2,
    )
    assert verify.returncode == 0, verify.stdout[-3000:]
    assert not duplicated and not problems, (duplicated, problems)
    assert len(rows) == total and finished, status
