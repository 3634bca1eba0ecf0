"""RELIABILITY.md from the fault-injection suite's own results.

Every scenario in ``tests/test_reliability_*.py`` writes one JSON row (scenario, broker, prompts,
faults, lost, duplicated, altered, recovery times, ``status`` pass/fail/skip, the code ``version``)
into ``$THINKFLEET_RELIABILITY_RESULTS`` when that is set — a failing scenario too, even one that timed
out before its checks (tests/conftest.py's report hook). This script runs the suite with it set
(``--run``; ``--slow`` adds the soak) and renders the rows as RELIABILITY.md. ``--run`` first sets the
previous rows of the scenarios it will run aside (a removed or renamed scenario disappears; a failing
one keeps its name) and stamps every row with the tree's version (``git rev-parse HEAD``, "-dirty"
when ``git status --porcelain`` lists anything):

    .venv/bin/python -m bench.reliability_report --run            # CI subset (≈ 12 min on 2 cores, -n 3)
    .venv/bin/python -m bench.reliability_report --run --slow     # CI subset + soak
    .venv/bin/python -m bench.reliability_report --run --files 'test_reliability_failover*'   # some files
    .venv/bin/python -m bench.reliability_report                  # re-render from stored results

``--files GLOB`` (repeatable) runs only the scenario files it matches and sets aside only their rows; the other
rows stay as stored, with their own version stamps. ``-n N`` runs N pytest processes (pytest-xdist, whole files per
process as scripts/test.sh does; the default 3 shares two cores well because most scenarios wait on subprocesses).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results" / "reliability"
RELIABILITY_MD = ROOT / "RELIABILITY.md"
RESULTS_ENV = "THINKFLEET_RELIABILITY_RESULTS"
VERSION_ENV = "THINKFLEET_RELIABILITY_VERSION"
_RUNS = "_runs.json"
#: Where the previous run's rows wait while the suite runs (tests/worker_harness.py PREVIOUS_DIR).
_PREVIOUS = "_previous"


def code_version(root: Path = ROOT) -> str:
    """``git rev-parse HEAD``, plus "-dirty" when ``git status --porcelain`` lists anything."""
    from testing.record import git_version

    return git_version(root)


def clear_stale(results: Path, slow: bool, files: list[Path] | None = None) -> list[Path]:
    """Set aside the rows this run will rewrite: all of them with ``--slow``, else the CI subset's (the
    soak's rows stay, with their own version stamp); with ``files``, only rows of those test files.
    Returns what was set aside."""
    only = None if files is None else {f"tests/{p.name}" for p in files}
    previous = results / _PREVIOUS
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir(parents=True)
    moved = []
    for path in sorted(results.glob("*.json")):
        if path.name == _RUNS:
            continue
        try:
            row = json.loads(path.read_text())
        except ValueError:
            row = {}
        ci = row.get("ci", True)
        if only is not None and str(row.get("test", "")).split("::")[0] not in only:
            continue
        if slow or ci:
            moved.append(path.rename(previous / path.name))
    return moved


def run_suite(results: Path, slow: bool, patterns: list[str] | None = None, processes: int = 3) -> int:
    """Run the reliability tests with results recording on; returns pytest's exit code."""
    version = code_version()  # before the old rows move aside (which makes the tree look dirty)
    files = _test_files(patterns)
    if not files:
        print(f"no scenario file matches {patterns} (scenario files: {', '.join(SCENARIO_GLOBS)})", file=sys.stderr)
        return 2
    results.mkdir(parents=True, exist_ok=True)
    clear_stale(results, slow, files if patterns else None)
    marker = "slow or not slow" if slow else "not slow"
    parallel = ["-n", str(processes), "--dist", "loadfile"] if processes > 0 else []
    command = [sys.executable, "-m", "pytest", "-q", "-rs", *parallel, "-m", marker, *(str(p) for p in files)]
    started = time.monotonic()
    env = {**os.environ, RESULTS_ENV: str(results), VERSION_ENV: version}
    try:
        code = subprocess.call(command, cwd=ROOT, env=env)
    finally:
        shutil.rmtree(results / _PREVIOUS, ignore_errors=True)
    runs_path = results / _RUNS
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    if patterns:  # a partial run: its rows carry their own version; the whole-suite record stays
        return code
    runs["all" if slow else "ci"] = {
        "command": f"pytest -m '{marker}' " + " ".join(f"tests/{g}" for g in SCENARIO_GLOBS),
        "wall_s": round(time.monotonic() - started, 1),
        "exit_code": code,
        "version": version,
        "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    runs_path.write_text(json.dumps(runs, indent=2, sort_keys=True) + "\n")
    return code


#: The test files whose scenarios fill RELIABILITY.md (tests/conftest.py records failures of the same).
SCENARIO_GLOBS = (
    "test_reliability_*.py",
    "test_worker_fidelity.py",
    "test_security_*.py",
    "test_producer_lifecycle.py",
)


def is_scenario_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in SCENARIO_GLOBS)


def _test_files(patterns: list[str] | None = None) -> list[Path]:
    """The scenario files; with ``patterns``, those whose name matches one of them."""
    files = sorted({p for pattern in SCENARIO_GLOBS for p in (ROOT / "tests").glob(pattern)})
    if patterns:
        files = [p for p in files if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    return files


def load(results: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sorted(results.glob("*.json")) if p.name != _RUNS]
    rows.sort(key=lambda r: (not r.get("ci", True), r.get("broker") != "redis", r.get("at", 0)))
    runs_path = results / _RUNS
    return rows, (json.loads(runs_path.read_text()) if runs_path.exists() else {})


def _recovery(values: list[float | None] | None) -> str:
    if not values:
        return "—"
    return ", ".join("—" if v is None else f"{v:.1f}" for v in values)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def status_of(row: dict[str, Any]) -> str:
    """pass / fail / skip; rows from before the status field pass only if their checks did."""
    if row.get("status"):
        return str(row["status"])
    clean = not (row.get("lost") or row.get("duplicated") or row.get("altered"))
    return "pass" if clean and row.get("verify_ok") and row.get("status_agrees") else "fail"


def _n(value: object) -> str:
    """A count; "?" where a failed scenario could not measure it."""
    if value is None:
        return "?"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _total(rows: list[dict[str, Any]], key: str) -> int:
    return sum(r.get(key) or 0 for r in rows)


def _result(row: dict[str, Any]) -> str:
    status = status_of(row)
    if status == "pass":
        return "pass"
    if status == "skip":
        return "SKIP"
    return "**FAIL**"


def _version(value: object) -> str:
    text = str(value or "—")
    return text[:10] + ("-dirty" if text.endswith("-dirty") else "") if len(text) >= 40 else text


def render(rows: list[dict[str, Any]], runs: dict[str, Any]) -> str:
    ran = [r for r in rows if status_of(r) != "skip"]
    lost, duplicated, altered = _total(ran, "lost"), _total(ran, "duplicated"), _total(ran, "altered")
    prompts = _total(ran, "prompts")
    failed = [r for r in rows if status_of(r) == "fail"]
    skipped = [r for r in rows if status_of(r) == "skip"]
    versions = sorted({str(r["version"]) for r in rows if r.get("version")})
    unstamped = sum(not r.get("version") for r in rows)
    if failed:
        verdict = f" **{len(failed)} FAILED: {', '.join(r['scenario'] for r in failed)}** (see the errors below)."
    else:
        verdict = " `producer verify` passed and `producer status --json` agreed with storage after every scenario."
    out = [
        "# Reliability",
        "",
        "Written by `bench/reliability_report.py` from the results the fault-injection suite "
        "(`tests/test_reliability_*.py`, `tests/test_worker_fidelity.py`, `tests/test_security_*.py`, "
        "`tests/test_producer_lifecycle.py`) records "
        "as it runs; do not edit by hand. Regenerate:",
        "",
        "```bash",
        ".venv/bin/python -m bench.reliability_report --run          # CI subset",
        ".venv/bin/python -m bench.reliability_report --run --slow   # + the soak (-m slow)",
        ".venv/bin/python -m bench.reliability_report --run --files 'test_reliability_failover*'   # some files",
        "```",
        "",
        f"**{len(ran)} scenarios, {prompts:,} prompts: {lost} lost, {duplicated} duplicated, {altered} altered.**"
        + verdict
        + (f" {len(skipped)} skipped (not run: no evidence either way)." if skipped else ""),
        "",
        f"Code version{'s' if len(versions) > 1 else ''}: {', '.join(f'`{v}`' for v in versions) or 'none'} "
        "(`git rev-parse HEAD`, `-dirty` when the tree had uncommitted changes)"
        + (f"; {unstamped} row(s) recorded before rows were stamped." if unstamped else "."),
        "",
        "Every scenario runs real processes: its own `redis-server`, `worker` (celery) "
        "subprocesses, the SGLang simulator over loopback, real Parquet. After each one the suite checks "
        "that every submitted prompt has exactly one row in the committed view whose `output_ids` equal "
        "the simulator's deterministic output byte for byte (`sglang_sim.content.expected_generation`), "
        "that the real `producer verify JOB` exits 0, and that `producer status JOB --json` counts "
        "(total/done/dead/queued/running/unaccounted) equal storage's. Some scenarios also sample the live "
        "invariant `total = done + dead + queued + running` while the faults happen "
        "(`testing/invariant_watch.py`).",
        "",
        "- **result**: pass, **FAIL** (a check failed, or the scenario did not finish: its counts are what "
        "Redis and storage held when it failed, `?` where unknown) or SKIP (not run).",
        "- **lost**: submitted, not stored, not an expected dead letter (for a scenario that did not finish: "
        "in no place at all — not stored, dead-lettered, queued or running). **duplicated**: more than one "
        "stored row at the winning revision (raw, before read-time dedupe). **altered**: stored ids differ "
        "from the simulator's.",
        "- **recovery s**: per injected fault, seconds from the fault until every prompt that was in "
        "flight at that moment is stored and the job has advanced (recorded, never asserted; in the soak "
        "faults overlap, so one fault's recovery includes the next ones).",
        "",
    ]
    header = ["scenario", "result", "broker", "workers", "prompts", "stored", "faults injected", "lost", "dup.",
              "altered", "dead (expected)", "recovery s", "wall s", "suite", "version"]  # fmt: skip
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        cells = [
            r["scenario"], _result(r), r.get("broker", "?"), _n(r.get("workers")), _n(r.get("prompts")),
            _n(r.get("stored")), r.get("faults") or "—", _n(r.get("lost")), _n(r.get("duplicated")),
            _n(r.get("altered")), _n(r.get("dead_lettered")), _recovery(r.get("recovery_s")),
            "—" if r.get("wall_s") is None else f"{r['wall_s']:.0f}", "CI" if r.get("ci", True) else "soak",
            f"`{_version(r.get('version'))}`" if r.get("version") else "—",
        ]  # fmt: skip
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    problems = [r for r in rows if status_of(r) != "pass"]
    if problems:
        out += ["", "Failures and skips:", ""]
        for r in problems:
            extra = ""
            if r.get("queued") is not None or r.get("running") is not None:
                extra = f" — at failure: queued {_n(r.get('queued'))}, running {_n(r.get('running'))}."
            test = f" (`{r['test']}`)" if r.get("test") else ""
            out.append(f"- **{status_of(r).upper()}** *{r['scenario']}*{test}: {_cell(r.get('error') or '—')}{extra}")
    notes = [f"- *{r['scenario']}* ({r.get('broker')}): {r['notes']}" for r in rows if r.get("notes")]
    if notes:
        out += ["", "Notes:", "", *notes]
    if runs:
        out += ["", "Suite runtime (2 shared cores):", ""]
        for mode, run in sorted(runs.items()):
            label = "CI subset" if mode == "ci" else "CI subset + soak"
            version = f", version `{_version(run['version'])}`" if run.get("version") else ""
            out.append(
                f"- {label}: `{run['command']}` — {run['wall_s']:.0f} s, exit {run['exit_code']}{version} ({run['at']})"
            )
    out += ["", _BODY]
    return "\n".join(out) + "\n"


_BODY = """\
## What the suite found, and what changed

- **A SIGKILLed worker lost the message it had just popped.** Kombu's Redis transport takes a message
  with `BRPOP` and records it in its `unacked` hash only afterwards; a busy worker keeps that popped
  reply unread until a pool slot frees, so a SIGKILL at almost any moment lost one prompt for good
  (the job never finished). `thinkfleet/broker/transit.py` pops with `BLMOVE` into a per-worker transit list
  instead, so a message is always in Redis; live workers return a dead worker's transit messages (and
  their own, stranded ones) to the queue. Test:
  `test_message_popped_by_a_worker_killed_before_kombu_records_it_is_not_lost`.
- **A Redis restart lost the prompts in flight.** The worker's Redis client had no retries, so a
  restart failed the tasks, and Celery acks a failed task: after the restart the ack removed the
  message. The client now retries through a restart (≈ 30 s per command), and a task that still
  cannot reach Redis is handed back (`Reject(requeue=True)`), never acked; a claim it could not
  release is released later. Tests: `test_redis_restarted_with_aof_mid_job_…`, soak
  `test_redis_away_longer_than_the_worker_retries_hands_work_back`.
- **A worker restarted under the same name stranded its previous run's prompts.** Its fresh heartbeat
  made the dead run's claims look alive, so copies redelivered to other workers waited on them forever
  (seen with a broker that redelivers at once). A starting worker now releases its previous run's
  claims (keeping their part, so a committed row is only finalized). Test:
  `test_a_worker_restarted_under_its_name_gives_up_its_dead_runs_claims`.
- **A restarted worker could stay idle forever.** When its first health probe succeeded while Celery
  was attaching the consumer, a check-then-act on two threads cancelled consuming after the gate had
  already switched it on, and nothing switched it back. `workers/runtime.py` now sets consuming from
  the gate's current state under a lock. Test:
  `test_a_worker_whose_server_turns_healthy_while_it_attaches_keeps_consuming` (seen as a stalled
  SIGKILL ×3 run).
- **One non-JSON item on the queue stopped a worker** ("Unrecoverable error: JSONDecodeError", exit 0).
  The transit transport drops and logs it. Test: `test_hostile_and_malformed_messages_…`.
- **`rediss://` brokers did not verify the server certificate** (kombu's default). `thinkfleet/broker/celery_app.py`
  now requires verification unless the URL says `?ssl_cert_reqs=none|optional`.
- **Operators and conversations (issue 32).** A paused worker's late ack deleted the unacked entry of the
  worker that had taken its message over (kombu acks by delivery tag, and a restore keeps the tag): if that
  worker then died, nothing restored the message. Each delivery now has its own tag and ack/reject act only on
  their own entry (`test_a_fenced_runs_late_ack_leaves_the_takers_delivery_and_the_prompt_is_still_stored`).
  `producer cancel` lost the prompts whose claims a dead worker held (its dead-letter call passed too few
  arguments: every claim looked fenced, the message was removed anyway); a paused revision-0 run was finalized
  after `producer retry --truncated` (revisions are now fenced like epochs); a straggler's dead letter brought a
  purged job's keys back; a re-submit after purge or a lost Redis stranded every conversation at its last stored
  turn, and a worker kept running across the purge skipped (acked) every next turn as the old generation's; a
  step regenerated after its tool ran ended `tool_error`; `wait` said finished while `verify` flagged chains
  that had ended with a recorded reason. Tests: `tests/test_reliability_operators.py`,
  `tests/test_chain_resume.py`, `tests/test_chain_ends.py`, `tests/test_tool_runs.py`, the operator nemesis
  (`tests/test_reliability_operator_nemesis.py`).
- **The nemesis grown to the operator found two more.** A leftover revision-0 copy of a prompt retried
  `--truncated` became the prompt's dead letter when the job was cancelled; `retry --error-class cancelled` resent
  revision 0, which every claim refuses, and `wait` never finished (dead_letter.lua and cancel.lua now end such a
  copy unrecorded). A finalize replayed after a rollback swapped its old fence into the worker's held fences across
  an await: a live redelivered run of the same prompt marked its part under it, was fenced by its own claim, and was
  acked unstored (CI, 2 in 41 runs under load; the fence is now passed, never swapped). The operators' own moves are
  one Lua call each (a pause could overwrite a cancel; purge deleted a running submit's lock and staging).
- **Host deaths made a one-at-a-time tail.** Bystanders of repeated kills became last-chance suspects that a
  host ran one at a time (0.03 prompts/s against 1.7); a worker paused past its lease was charged as dead.
  Suspects now run together and a group is split only when it dies again; a worker that comes back takes its
  charge back (`tests/test_reliability_fault_cost.py`, `bench/bench_fault_cost.py`: tail at 0.79 of the
  healthy rate against 0.21).
- **A lost write hid behind a later one.** A rollback's lost finalize was detected only by comparing the
  worker's latest mark, which its next finalize rewrote; now each write carries the last mark Redis answered and
  flags a gap (`test_a_rollback_is_seen_even_after_a_later_finalize_wrote_a_newer_mark`).

## The broker is the job-state Redis

The queue lives in the same Redis as the job state (claims, done, dead letters, counters), and nowhere else:
a next turn, a retry and a re-derived tool step are enqueued in the same Redis transaction as the state change
that owes them (`thinkfleet/state/lua/finalize.lua`, the submit commit, `producer retry`), so each is enqueued
exactly when it is owed. A broker apart from it cannot share that transaction: with RabbitMQ, `producer submit`
and every next turn were pushed onto Redis lists no RabbitMQ worker read (0 of 50 prompts stored). So a
`THINKFLEET_BROKER_URL` other than `THINKFLEET_REDIS_URL` (RabbitMQ or another Redis) is refused at start, by
every `producer` command (usage error) and by the worker (exit 78, nothing consumed), naming the fix: unset it.
Test: `test_a_worker_that_cannot_start_consumes_nothing_and_exits_naming_the_cause[broker_apart]`.

Acks over Redis are emulated: a message not acknowledged within the visibility timeout is redelivered.
thinkfleet sets it to `lease_s` and live workers renew what they hold, so long generations are not redelivered;
when a copy is (a worker frozen past its lease, or another worker configured with a shorter lease — the shortest
wins), the claims make it cost nothing. Use AOF (`appendfsync everysec` or `always`) so a restart keeps the queue.

## Not covered

- Storage faults (a full disk, S3 errors mid-write) are not injected here; storage has its own tests.
- `rediss://` is checked at the configuration level only (no TLS Redis in the test environment), and
  uses kombu's stock transport (the transit fix applies to `redis://`).
- A network partition that keeps a worker alive but cut off from Redis longer than its lease: its
  prompts re-run elsewhere and the claims/part protocol keeps the output exactly-once, but that case
  is argued in `workers/lease.py`, not injected.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="run the suite first (records fresh results)")
    parser.add_argument("--slow", action="store_true", help="with --run: include the soak (-m slow)")
    parser.add_argument("--files", action="append", metavar="GLOB", help="with --run: only these scenario files")
    parser.add_argument("-n", type=int, default=3, dest="processes", help="with --run: pytest processes [3]")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help=f"results dir [{RESULTS_DIR}]")
    parser.add_argument("--out", type=Path, default=RELIABILITY_MD, help=f"markdown to write [{RELIABILITY_MD}]")
    args = parser.parse_args(argv)
    code = run_suite(args.results, args.slow, args.files, args.processes) if args.run else 0
    rows, runs = load(args.results)
    if not rows:
        print(f"no results in {args.results}; run with --run", file=sys.stderr)
        return 1
    from testing.operator_matrix import keep_block  # the operator matrix's table is written by its own run

    args.out.write_text(keep_block(render(rows, runs), args.out))
    lost, duplicated = _total(rows, "lost"), _total(rows, "duplicated")
    failed = [r["scenario"] for r in rows if status_of(r) == "fail"]
    skipped = sum(status_of(r) == "skip" for r in rows)
    print(
        f"{args.out}: {len(rows) - skipped} scenarios, {lost} lost, {duplicated} duplicated"
        + (f", {skipped} skipped" if skipped else "")
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return code or (1 if lost or duplicated or failed else 0)


if __name__ == "__main__":
    sys.exit(main())
