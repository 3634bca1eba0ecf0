"""The nemesis grows to the operator: a seeded schedule of the operator's commands — pause/resume, cancel then resume
and ``retry --error-class cancelled``, ``purge --force`` and the same ``producer submit`` again, ``compact``,
``retry --truncated`` — worker kills and Redis rolled back to a snapshot taken moments before (its last writes lost),
all while two workers run one job submitted with the real producer: single prompts, and ``--turns all``
conversations (each turn i+1 must be rendered from the committed turn i: testing/chains.py) whose every request
draws its own answer (``--sample-per-request``: a re-run of turn i answers otherwise, so turn i+1 rendered from any
run but the committed one shows). Every command goes through the ``producer`` CLI's command group, as an operator
types it, in this process (click's runner: what it races is the worker processes, through Redis and storage) —
the agentic run's as processes of their own, spaced as before (…_agentic.py says why); ``producer wait`` runs as a
process of its own.
The CI seed's ``--turns all`` and agentic runs are in files of their own (…_turns.py, …_agentic.py): the suite's
processes share the three.

Then ``producer wait`` says finished (exit 0), and so does everything after it: every prompt is stored exactly once,
byte-exact against the simulator, ``producer verify`` passes and ``producer status`` agrees with storage.

The schedule is drawn from a seed (:func:`schedule`): ``THINKFLEET_OPERATOR_SEED=N .venv/bin/pytest
tests/test_reliability_operator_nemesis.py -m slow`` re-runs one. CI runs :data:`CI_SEED` (each command once).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path

import pytest
import redis

from producer import render
from sglang_sim.tools import write_catalogue
from storage.reader import raw_duplicates, read_committed
from storage.verify_steps import unreachable_steps
from testing.chains import chain_problems
from testing.datasets import agentic_rows, chat_rows, conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, draw_schedule, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.record import Outcome, check_job, record_result
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.turns import beyond_chain_ends
from workers.tool_exec import TRUSTED_ENV

OPERATIONS = ("pause_resume", "cancel_retry", "purge_resubmit", "compact", "kill", "retry_truncated", "rollback")
#: Simulated seconds per wall second: slow enough that the job still runs when the operator acts (a worker restart,
#: as kill and cancel take, lasts 10-15 s on the loaded CI box; at 16 the whole job was stored before the last command,
#: the cancel, with the commands in this process; at 40, with a CLI process each, before the first).
TIME_SCALE = "8"
#: The agentic run: the example executor answers every call (docs/examples/agentic/tools.py), and the simulator's
#: answers call its tools often, briefly (as tests/test_agentic_replay.py's).
EXECUTOR = f"{Path(__file__).parents[1] / 'docs/examples/agentic/tools.py'}:execute"
AGENTIC_CONTENT = {"tool_call_share": 0.6, "length_median_tokens": 60.0, "max_tool_calls": 2}
#: ``retry --truncated`` raises the budget of length-stopped rows to this (the job's is 1024: ~30% stop on length).
RETRY_BUDGET = 2048
CI_SEED = 3
JOB = "ops"
DATASET = "alpha"


@dataclass(frozen=True)
class Operation:
    at: float  # share of the job stored when the operator acts
    kind: str  # one of OPERATIONS
    target: int  # which worker (kill)


def schedule(seed: int, operations: int) -> list[Operation]:
    """``operations`` commands at increasing shares of the job, each kind at least once when there is room."""
    rng = random.Random(seed)
    drawn = draw_schedule(rng, OPERATIONS, operations, 0.05, 0.8)
    return [Operation(share, kind, rng.randrange(2)) for share, kind in drawn]


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


def _stored(client: redis.Redis, settings: Settings) -> int:
    try:
        return job_progress(client, settings.keys, JOB)["done"]
    except redis.RedisError:
        return -1


def _cli(settings: Settings, *args: str, process: bool = False) -> str:
    """Run one operator command through the ``producer`` command group, in this process (click's runner: the same
    code against the same Redis and storage while the worker processes run; a new interpreter per command costs
    ≈ 1.5-4 CPU-s on the 2-core CI box) or, ``process``, as a CLI process of its own (a second or more each, which
    spaces the commands out). It must succeed (one that fails is a finding)."""
    result = producer_cli(settings, *args, timeout_s=180.0, in_process=not process)
    assert result.returncode == 0, f"producer {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


def _nothing_runs(settings: Settings) -> bool:
    # the test's own wait, polled every half second, not an operator's command
    st = json.loads(_cli(settings, "status", JOB, "--json", "--deep"))
    return st.get("queued") == 0 and st.get("running") == 0


def run_operators(
    tmp_path: Path,
    tok_dir: Path,
    seed: int,
    units: int,
    operations: int,
    turns: int = 0,
    agentic: bool = False,
    processes: bool = False,
) -> None:
    """``units`` prompts (``turns`` = 0) or conversations of ``turns`` user turns each (``--turns all``); ``agentic``:
    conversations that call tools, run step by step with the example executor (``--tool-results executor``);
    ``processes``: the submit and every operator command a CLI process of its own (see :func:`_cli`)."""
    plan = schedule(seed, operations)
    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    if agentic:
        rows = agentic_rows(units, turns)
    elif turns:
        rows = conversation_rows(units, turns, 10, "You are a careful assistant.", reasoning="x", seed_step=seed + 100)
    else:
        rows = chat_rows(units, words=20, seed=seed)
    data = write_jsonl(tmp_path / f"{DATASET}.jsonl", rows)
    total = units * (turns or 1)
    submit = ("submit", str(data), "--job", JOB, "--tokenizer", str(tok_dir), "--processes", "1")
    submit += ("--max-new-tokens", "1024", "--seed", "7", "--json", "--no-progress")
    if turns:
        submit += ("--turns", "all", "--context-length", "131072")
    # --turns all: every request its own answer (turn i+1 must follow the committed run of turn i, not any run).
    sim_args = ["--time-scale", TIME_SCALE, *(["--sample-per-request"] if turns else [])]
    extra_env: dict[str, str] = {}
    if agentic:
        catalogue = write_catalogue(tmp_path / "tools.json", render.load_tokenizer(str(tok_dir)), "kimi")
        sim_args += ["--tool-catalogue", str(catalogue)]
        for key, value in AGENTIC_CONTENT.items():
            sim_args += [f"--{key.replace('_', '-')}", str(value)]
        submit += ("--tool-results", "executor", "--tool-executor", EXECUTOR, "--max-tool-steps", "3")
        extra_env[TRUSTED_ENV] = EXECUTOR
    started = time.monotonic()
    done: list[str] = []
    try:
        with simulator(tmp_path, *sim_args) as sim:
            env = fast_env(settings, sim, max_inflight=4, request_timeout_floor_s=60)  # a slow simulator
            env.update(extra_env)
            workers = [WorkerProcess(f"op{i}", env, tmp_path).start() for i in range(2)]
            try:
                for w in workers:
                    w.wait_ready(client, settings.keys)
                assert json.loads(_cli(settings, *submit, process=processes))["enqueued"] == units
                for op in plan:
                    wait_until(lambda o=op: _stored(client, settings) >= o.at * total, 300, 0.2, what=str(op))
                    _operate(op, settings, client, workers, submit, server, processes)
                    done.append(f"{op.kind}@{op.at:.2f}")
                # Then `producer wait` says finished: every prompt stored or dead-lettered…
                waited = producer_cli(settings, "wait", JOB, "--timeout", "400", "--json", timeout_s=450)
                assert waited.returncode == 0, f"wait exited {waited.returncode}:\n{waited.stderr[-3000:]}"
                alive = [w for w in workers if w.alive()]
                assert len(alive) == len(workers), "a worker exited on its own"
            finally:
                for w in workers:
                    w.terminate()
        # …and storage, verify and status agree with it: every prompt (every turn) stored once, byte-exact, none dead.
        record = JobRecord.load(client, settings.keys, JOB)
        assert record is not None
        if agentic:
            outcome = _check_steps(settings)
        elif turns:
            outcome = _check_turns(settings, data, tok_dir, record, total)
        else:
            tok = render.load_tokenizer(str(tok_dir))
            expected = {
                f"{DATASET}/r{i}": render.render_ids(tok, row["messages"][:2], None, {"thinking": True})
                for i, row in enumerate(rows)
            }
            # A row retried for length is committed at its new revision, with the budget the retry gave it.
            committed = read_committed(settings.output_uri, JOB, columns=["prompt_id", "revision"]).to_pylist()
            retried = {r["prompt_id"]: {"max_new_tokens": RETRY_BUDGET} for r in committed if r["revision"]}
            outcome = check_job(settings, JOB, expected, record.sampling_params, overrides=retried)
        record_result(
            f"operator nemesis{' agentic' if agentic else ' --turns all' if turns else ''}: {operations} commands "
            f"(seed {seed})",
            outcome,
            ", ".join(done),
            [],
            time.monotonic() - started,
            workers=2,
            notes="pause/resume, kill + cancel + resume + retry --error-class cancelled, purge --force + the same "
            "submit, compact, retry --truncated, worker kills and Redis rolled back to a snapshot, each through the "
            "producer CLI while the job runs" + ("; every request its own answer" if turns else ""),
        )
        outcome.assert_clean()
    finally:
        server.stop()


def _check_turns(settings: Settings, data: Path, tok_dir: Path, record: JobRecord, total: int) -> Outcome:
    """check_job for a ``--turns all`` job: verify, status and storage agree, and every chain is whole and exact."""
    verify = producer_cli(settings, "verify", JOB, "--json", in_process=True)
    problems = [] if verify.returncode == 0 else [f"producer verify failed: {verify.stdout[-3000:]}"]
    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, JOB).to_pylist()}
    # A turn past its conversation's chain end is superseded (a retry of an earlier turn ended the chain there):
    # kept in storage, left out of the exports and of the job's counts, listed by verify.
    for pid in beyond_chain_ends(rows, [p for p, r in rows.items() if r.get("chain_end")]):
        del rows[pid]
    dups = raw_duplicates(settings.output_uri, JOB)
    duplicated = sorted(set(dups["prompt_id"].to_pylist())) if dups.num_rows else []
    problems += chain_problems(data, DATASET, tok_dir, record, rows, exact_outputs=False)
    st = json.loads(_cli(settings, "status", JOB, "--json"))
    got = {k: st.get(k) for k in ("total", "done", "dead", "queued", "running", "finished")}
    # A chain that ended early with a recorded reason (the model called a tool) owes no later turn.
    want = {"total": len(rows), "done": len(rows), "dead": 0, "queued": 0, "running": 0, "finished": True}
    if got != want:
        problems.append(f"producer status {got} disagrees with storage {want}")
    lost = [p.split(":")[0] for p in problems if "not stored" in p]
    return Outcome(len(rows), len(rows), 0, lost, duplicated, [], verify.returncode == 0, got == want, problems)


def _check_steps(settings: Settings) -> Outcome:
    """check_job for an agentic job: verify passes (every chain whole: at its end or a recorded reason), no step is
    stored twice, and status counts what storage holds on the current chains — a step no current chain reaches (a
    re-run took another path) and a turn past a chain end are superseded, as the exports and verify say."""
    verify = producer_cli(settings, "verify", JOB, "--json", in_process=True)
    problems = [] if verify.returncode == 0 else [f"producer verify failed: {verify.stdout[-3000:]}"]
    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, JOB).to_pylist()}
    dups = raw_duplicates(settings.output_uri, JOB)
    duplicated = sorted(set(dups["prompt_id"].to_pylist())) if dups.num_rows else []
    superseded = beyond_chain_ends(rows, [p for p, r in rows.items() if r.get("chain_end")])
    superseded |= unreachable_steps(settings, JOB, rows)
    current = len(rows) - len(superseded)
    st = json.loads(_cli(settings, "status", JOB, "--json"))
    got = {k: st.get(k) for k in ("total", "done", "dead", "queued", "running", "finished")}
    want = {"total": current, "done": current, "dead": 0, "queued": 0, "running": 0, "finished": True}
    if got != want:
        problems.append(f"producer status {got} disagrees with storage {want} ({len(superseded)} superseded)")
    return Outcome(current, current, 0, [], duplicated, [], verify.returncode == 0, got == want, problems)


def _operate(
    op: Operation,
    settings: Settings,
    client: redis.Redis,
    workers: list[WorkerProcess],
    submit: tuple[str, ...],
    server: RedisServer,
    processes: bool,
) -> None:
    cli = partial(_cli, settings, process=processes)
    if op.kind == "pause_resume":
        cli("pause", JOB)
        time.sleep(1.0)  # the pause itself: workers park what they pop, in-flight generations finish
        cli("resume", JOB)
    elif op.kind == "cancel_retry":
        # A host dies and the operator cancels while its claims are still held (its prompts parked), then takes
        # the documented way back: wait until nothing of the job runs, resume, revive the cancelled prompts.
        worker = workers[op.target]
        worker.kill()
        cli("cancel", JOB)
        wait_until(lambda: _nothing_runs(settings), 120, 0.5, what="the cancelled job quiet")
        worker.start()
        worker.wait_ready(client, settings.keys)
        cli("resume", JOB)
        cli("retry", JOB, "--error-class", "cancelled")
    elif op.kind == "purge_resubmit":
        cli("purge", JOB, "--force")
        cli(*submit)
    elif op.kind == "compact":
        cli("compact", JOB, "--dataset", DATASET)
    elif op.kind == "retry_truncated":
        cli("retry", JOB, "--truncated", "--max-new-tokens", str(RETRY_BUDGET))
    elif op.kind == "rollback":
        # A snapshot, the job going on past it (rows stored, finalized, acked), then Redis killed and back from
        # that snapshot: the writes since are lost (a head without AOF, or a promoted replica that lagged).
        before, stored = client.lastsave(), _stored(client, settings)
        # LASTSAVE counts whole seconds: a snapshot in the same second as the last (a Redis just restarted by an
        # earlier rollback) would never look written.
        while (datetime.now() - before).total_seconds() < 1.5:
            time.sleep(0.1)
        client.bgsave()
        wait_until(lambda: client.lastsave() != before, 60, 0.1, what="the snapshot written")
        total = json.loads(cli("status", JOB, "--json"))["total"]
        past = min(total, stored + 2)
        wait_until(lambda: _stored(client, settings) >= past, 120, 0.1, what="rows past the snapshot")
        server.stop(kill=True)
        server.start()
    elif op.kind == "kill":
        worker = workers[op.target]
        worker.kill()
        worker.start()
        worker.wait_ready(client, settings.keys)


def test_schedule_is_reproducible_and_covers_every_operation() -> None:
    assert schedule(7, 8) == schedule(7, 8)
    assert {o.kind for o in schedule(CI_SEED, len(OPERATIONS))} == set(OPERATIONS)


def test_operator_nemesis_short_fixed_seed(tmp_path: Path, tok_dir: Path) -> None:
    run_operators(tmp_path, tok_dir, CI_SEED, units=48, operations=len(OPERATIONS))


@pytest.mark.slow
def test_operator_nemesis_soak(tmp_path: Path, tok_dir: Path) -> None:
    seed = int(os.environ.get("THINKFLEET_OPERATOR_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"operator nemesis seed {seed} (THINKFLEET_OPERATOR_SEED={seed} re-runs this schedule)")
    run_operators(tmp_path, tok_dir, seed, units=200, operations=12)
    run_operators(tmp_path / "turns", tok_dir, seed, units=40, operations=12, turns=3)
    run_operators(tmp_path / "agentic", tok_dir, seed, units=24, operations=12, turns=2, agentic=True)
