"""Fault to resumed throughput on a Sentinel head: the primary SIGKILLed against SIGSTOPped (frozen for good).

    .venv/bin/python -m bench.bench_failover                                  (≈ 3 min on the 2-core dev VM)
    .venv/bin/python -m bench.bench_failover --from-json bench/results/failover.json   # the section only

One Sentinel head (1 primary, 2 replicas, 3 Sentinels, down-after 1 s: testing/sentinel.py), two workers (lease
15 s, so every Redis command times out after 5 s: thinkfleet/redis_client.py ``command_timeout_s``) and the
simulator; one job per fault. Once a quarter of the job is stored, the primary is killed (every socket to it is
reset) or stopped (its sockets stay open and silent: a frozen VM, a partition). The stored count is sampled every
0.2 s through the ``sentinel://`` URL. Figures, from the fault:

- *promoted*: until the Sentinels' majority names another primary and it answers as one;
- *resumed*: until a tenth of the job more than was stored at the fault is stored (read on the promoted primary);
- *finished*: until every prompt is stored;
- rows per second before the fault (from 5 % of the job) and after it resumed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
from testing.fleet import job_progress_or_down
from testing.harness import make_prompts, submit_ids
from testing.record import check_job
from testing.sentinel import DOWN_AFTER_MS, sentinel_fleet
from thinkfleet.redis_client import command_timeout_s, sync_client

JSON = RESULTS / "failover.json"
LEASE_S = 15.0
#: Progress past the fault that counts as resumed throughput, as a share of the job.
RESUMED_SHARE = 0.1
FAULTS = ("killed", "frozen")


class Sampler(threading.Thread):
    """The stored count every 0.2 s, (monotonic time, rows) while a primary answers."""

    def __init__(self, url: str, keys: Any, job: str) -> None:
        super().__init__(daemon=True)
        self.client = sync_client(url, timeout_s=2, connect_timeout_s=2)
        self.keys, self.job = keys, job
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            done = job_progress_or_down(self.client, self.keys, self.job)["done"]
            if done >= 0:
                self.samples.append((time.monotonic(), done))
            time.sleep(0.2)

    def rows_at(self, t: float) -> int:
        return max((n for at, n in self.samples if at <= t), default=0)


def first_at(samples: list[tuple[float, int]], rows: int, after: float = 0.0) -> float | None:
    """The first sample time (after ``after``) with at least ``rows`` stored."""
    return next((at for at, n in samples if at >= after and n >= rows), None)


def run_one(fault: str, prompts: int, workdir: Path) -> dict[str, Any]:
    with sentinel_fleet(workdir / fault, worker_options={"lease_s": LEASE_S}) as fleet:
        head = fleet.head
        sampler = Sampler(fleet.settings.redis_url, fleet.settings.keys, fault)
        sampler.start()  # before the job: the baseline from its first rows
        job = submit_ids(fleet.settings, fault, make_prompts(prompts))
        fleet.wait_done(fault, prompts // 4, "a quarter stored", 240)
        old = head.primary_port()
        assert old is not None
        process = head.process_on(old)
        fault_at = time.monotonic()
        at_fault = sampler.rows_at(fault_at)
        if fault == "killed":
            process.stop(kill=True)
        else:
            os.kill(process.pid, signal.SIGSTOP)
        head.wait_for_new_primary(old)
        promoted_s = time.monotonic() - fault_at
        fleet.wait_done(fault, prompts, "every row", 600)
        finished_s = time.monotonic() - fault_at
        time.sleep(0.5)  # the last samples
        sampler.done.set()
        samples = sampler.samples
        t5 = first_at(samples, prompts // 20) or fault_at
        resumed_at = first_at(samples, at_fault + int(prompts * RESUMED_SHARE), after=fault_at)
        done_at = first_at(samples, prompts, after=fault_at) or time.monotonic()
        resumed_rows = sampler.rows_at(resumed_at) if resumed_at else prompts
        fleet.head.stable_primary()
        fleet.head.freeze()
        fleet.stop_workers()
        outcome = check_job(fleet.settings, fault, job.prompts, job.sampling_params)
        return {
            "fault": fault,
            "prompts": prompts,
            "rate_before": (at_fault - sampler.rows_at(t5)) / max(1e-6, fault_at - t5),
            "rate_after": (prompts - resumed_rows) / max(1e-6, done_at - (resumed_at or done_at)),
            "promoted_s": promoted_s,
            "resumed_s": None if resumed_at is None else resumed_at - fault_at,
            "finished_s": finished_s,
            "stored": outcome.stored,
            "duplicated": len(outcome.duplicated),
            "lost": len(outcome.lost),
            "verify_ok": not outcome.problems,
        }


def render(data: dict[str, Any]) -> None:
    def fmt(x: float | None) -> str:
        return "—" if x is None else f"{x:.1f} s"

    rows = [
        [r["fault"], fmt(r["promoted_s"]), fmt(r["resumed_s"]), fmt(r["finished_s"]), f"{r['rate_before']:.1f}",
         f"{r['rate_after']:.1f}", f"{r['stored']}/{r['prompts']}", r["duplicated"], r["lost"]]
        for r in data["runs"]
    ]  # fmt: skip
    body = (
        "`.venv/bin/python -m bench.bench_failover` — " + (__doc__ or "").split("\n\n", 2)[2].strip() + "\n\n"
        f"Lease {data['lease_s']:.0f} s, command timeout {data['timeout_s']:.0f} s, down-after "
        f"{data['down_after_ms'] / 1000:.0f} s; {data['prompts']} prompts per job, 2 workers.\n\n"
        + table(
            [
                "primary",
                "promoted",
                "throughput resumed",
                "job finished",
                "rows/s before",
                "rows/s after",
                "stored",
                "dup",
                "lost",
            ],
            rows,
        )
        + "\n\nTimes are from the fault. Before issue 43 a frozen primary stopped the fleet for good (the issue's run:"
        " `wait` 124 after 400 s): no kombu connection had a timeout. With the timeouts alone, the frozen job here"
        " finished 138 s after the promotion: redis-py retries a failed command on the address it had, the frozen"
        " primary's, so the workers' commits stalled through 20 retries; every Sentinel connection now asks the"
        " Sentinels again when it reconnects.\n\n"
        f"{code_stamp(data.get('code'))} Raw figures: `bench/results/failover.json`."
    )
    print(body)
    update_section("bench_failover", "Failover: a killed against a frozen primary", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args()
    if args.from_json:
        render(__import__("json").loads(args.from_json.read_text()))
        return
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        runs = [run_one(fault, args.prompts, Path(tmp)) for fault in FAULTS]
    data = {
        "lease_s": LEASE_S,
        "timeout_s": command_timeout_s(LEASE_S),
        "down_after_ms": DOWN_AFTER_MS,
        "prompts": args.prompts,
        "runs": runs,
        "code": code_version(),
    }
    write_json(JSON, data)
    render(data)
    if not all(r["verify_ok"] and r["stored"] == r["prompts"] for r in runs):
        sys.exit("a job did not end with every prompt stored once: see bench/results/failover.json")


if __name__ == "__main__":
    main()
