"""Next turns where their prefix is cached: today's placement (affinity off) vs host-affine, in prefill saved.

    .venv/bin/python -m bench.bench_affinity                      (≈ 6 min on the 2-core dev VM)
    .venv/bin/python -m bench.bench_affinity --from-json bench/results/affinity.json

Four simulated hosts (a real ``worker`` each, its own simulator and so its own prefix cache, as each GPU host has
its own radix cache), one private Redis, jobs submitted with the real ``producer`` CLI and the test tokenizer:

- **multi-turn**: conversations of 5 user turns (``--turns all``), each under one of 4 long system prompts;
- **agentic**: conversations of 2 user turns, each going through two rounds of tool calls
  (``--tool-results replay``: 3 steps a turn), under the same long system prompts.

Each workload runs twice in one run, with ``THINKFLEET_AFFINITY=false`` (every next turn on the shared queue: the
placement before host affinity) and ``true``, on fresh simulators. Then the multi-turn workload runs once more,
affine, with one host SIGKILLed at 40 % of its turns (not restarted): its conversations must go on elsewhere, and
``producer wait`` / ``producer verify`` must pass.

Figures, from the committed rows: *hit rate* = cached / reusable tokens over the later turns (the reusable prefix is
what the previous turn's server computed: ``prefix_reusable_tokens``); *prefill* = prompt tokens the servers
computed (``prompt_tokens − cached_tokens`` over every row); *makespan* = wall seconds from the submit until every
turn is stored; *tail* = the seconds the last 5 % of the turns took, and the p99 of a turn's ``/generate`` latency.
The simulator prefills uncached tokens at ``PREFILL_TOK_S`` (decode pauses meanwhile, as SGLang's prefill batches
run between decode batches), so prefill saved shows in the makespan.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import redis

from bench.harness import RESULTS, code_version, write_json
from bench.report import code_stamp, table, update_section
from sglang_sim.testing import SimulatorProcess
from storage.prefix_cache import prefix_summary
from storage.reader import read_committed
from testing.corpus import synthetic_text
from testing.datasets import agentic_rows, conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, wait_for_port, worker_env
from testing.harness import FAST_WORKER, producer_cli, tokenizer_roots_for_tests
from testing.redis_process import RedisProcess
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings

JSON = RESULTS / "affinity.json"
PLOT = RESULTS / "affinity.png"
HOSTS = 4
INFLIGHT = 8
TIME_SCALE = 10.0
#: Uncached prompt tokens a simulated host prefills per (simulated) second: a long history costs seconds.
PREFILL_TOK_S = 6000.0
MAX_NEW_TOKENS = 400
LENGTH_MEDIAN = 180.0
#: Conversations per workload, system prompts (words), user turns (words).
MULTI_CONVERSATIONS, MULTI_TURNS = 48, 5
AGENTIC_CONVERSATIONS, AGENTIC_TURNS = 24, 2
SYSTEM_PROMPTS, SYSTEM_WORDS, USER_WORDS = 4, 900, 60
KILL_AT = 0.4
WAIT_S = 3.0
#: The tests' fast worker, with a longer lease and the default request deadline (no timeout is a fault here).
WORKER = {
    **FAST_WORKER,
    "lease_s": 8,
    "request_timeout_floor_s": 120,
    "request_min_decode_tok_s": Settings.model_fields["request_min_decode_tok_s"].default,
    "affinity_wait_s": WAIT_S,
}
_COLUMNS = [
    "conversation_id", "turn_index", "step_index", "worker", "cached_tokens", "prefix_reusable_tokens",
    "prompt_tokens", "latency_s", "created_at",
]  # fmt: skip


def _systems() -> list[str]:
    return [synthetic_text(SYSTEM_WORDS, 7000 + k) for k in range(SYSTEM_PROMPTS)]


def _dataset(workload: str, path: Path) -> Path:
    systems = _systems()
    if workload == "multi-turn":
        rows = conversation_rows(MULTI_CONVERSATIONS, MULTI_TURNS, USER_WORDS, "", reasoning="x")
    else:
        rows = agentic_rows(AGENTIC_CONVERSATIONS, AGENTIC_TURNS)
    for c, row in enumerate(rows):
        row["messages"][0]["content"] = systems[c % SYSTEM_PROMPTS]
    return write_jsonl(path, rows)


class Fleet:
    """HOSTS simulators (fresh caches) and a worker on each."""

    def __init__(self, settings: Settings, workdir: Path, name: str, affinity: bool, sim_args: list[str]) -> None:
        self.sims = [SimulatorProcess(*sim_args).start(wait=False) for _ in range(HOSTS)]
        logs = workdir / f"logs-{name}"
        self.workers: list[WorkerProcess] = []
        for i, sim in enumerate(self.sims):
            wait_for_port(sim.port, 60)
            env = worker_env(
                settings.redis_url, sim.url, settings.output_uri, max_inflight=INFLIGHT, key_prefix=settings.key_prefix,
                queue=settings.queue, tokenizer_roots=tokenizer_roots_for_tests(), affinity=str(affinity).lower(),
                **WORKER,
            )  # fmt: skip
            self.workers.append(WorkerProcess(f"host{i}", env, logs).start())
        client = redis.Redis.from_url(settings.redis_url)
        for w in self.workers:
            w.wait_ready(client, settings.keys, timeout_s=120)

    def stop(self) -> None:
        for w in self.workers:
            w.terminate()
        for s in self.sims:
            s.kill()


def _pending(client: redis.Redis, settings: Settings, job: str) -> tuple[int, int]:
    """(turns stored or dead, turns the job holds): equal exactly when nothing is pending — the finalize that
    stores a turn adds its successor to the job in the same step."""
    keys = settings.keys
    with client.pipeline(transaction=False) as p:
        p.scard(keys.done(job))
        p.hlen(keys.dead(job))
        p.hlen(keys.prompts(job))
        done, dead, total = p.execute()
    return int(done) + int(dead), int(total)


def run(workload: str, affinity: bool, redis_url: str, workdir: Path, kill: bool = False) -> dict[str, Any]:
    name = f"{workload}-{'on' if affinity else 'off'}{'-kill' if kill else ''}"
    settings = Settings(
        redis_url=redis_url, output_uri=str(workdir / f"out-{name}"), key_prefix=f"b{name}", queue=f"q{name}",
        tokenizer_roots=tokenizer_roots_for_tests(),
    )  # fmt: skip
    tok_dir = build_test_tokenizer(default_test_tokenizer_dir())
    data = _dataset(workload, workdir / f"{name}.jsonl")
    sim_args = ["--time-scale", str(TIME_SCALE), "--prefill-tok-s", str(PREFILL_TOK_S), "--log-level", "WARNING",
                "--length-median-tokens", str(LENGTH_MEDIAN), "--max-tick-lag-ms", "1e12"]  # fmt: skip
    tools: list[str] = []
    if workload == "agentic":
        from producer.render import load_tokenizer
        from sglang_sim.tools import write_catalogue

        catalogue = write_catalogue(workdir / "tools.json", load_tokenizer(str(tok_dir)), "kimi")
        sim_args += ["--tool-catalogue", str(catalogue), "--tool-call-share", "0.6", "--max-tool-calls", "2"]
        tools = ["--tool-results", "replay", "--tool-mismatch", "keep_recorded", "--max-tool-steps", "3"]
    else:
        sim_args += ["--tool-call-share", "0"]
    client = redis.Redis.from_url(redis_url)
    fleet = Fleet(settings, workdir, name, affinity, sim_args)
    killed: dict[str, Any] | None = None
    samples: list[tuple[float, int]] = []
    try:
        submitted = producer_cli(
            settings, "submit", str(data), "--job", name, "--tokenizer", str(tok_dir), "--processes", "1",
            "--no-progress", "--max-new-tokens", str(MAX_NEW_TOKENS), "--seed", "11", "--context-length", "131072",
            "--turns", "all", "--json", *tools, timeout_s=600,
        )  # fmt: skip
        if submitted.returncode != 0:
            raise RuntimeError(submitted.stderr)
        # From the moment the submit's messages are on the queue: the submit itself (tokenizer load, rendering)
        # is the same work whatever the placement, and on a loaded box its time varies more than the job's.
        started = time.monotonic()
        planned = int(json.loads(client.hget(settings.keys.job(name), "turns") or b"{}").get("turns") or 1)
        while True:
            done, total = _pending(client, settings, name)
            samples.append((time.monotonic() - started, done))
            if kill and killed is None and done >= KILL_AT * planned:
                victim = fleet.workers[-1]
                victim.kill()
                killed = {"host": victim.name, "at_s": samples[-1][0], "done": done}
            if done and done == total:
                break
            if time.monotonic() - started > 1800:
                raise RuntimeError(f"{name}: {done}/{total} after 30 min")
            time.sleep(0.1)
        makespan = samples[-1][0]
        waited = producer_cli(settings, "wait", name, "--timeout", "300", timeout_s=400).returncode
        verified = producer_cli(settings, "verify", name, timeout_s=400).returncode
    finally:
        fleet.stop()
    table_ = read_committed(settings.output_uri, name, columns=_COLUMNS)
    rows = table_.to_pylist()
    prefix = prefix_summary(table_) or {}
    prompt = int(pc.sum(table_["prompt_tokens"]).as_py() or 0)
    cached = int(pc.sum(table_["cached_tokens"].fill_null(0)).as_py() or 0)
    latencies = sorted(r["latency_s"] for r in rows if r["latency_s"] is not None)
    n = len(rows)
    tail_from = math.ceil(0.95 * n)
    t95 = next((t for t, d in samples if d >= tail_from), makespan)
    out: dict[str, Any] = {
        "workload": workload, "affinity": affinity, "killed": killed, "turns": n, "makespan_s": makespan,
        "tail_s": makespan - t95,
        "first_turn_s": next((t for t, d in samples if d > 0), makespan),
        "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached, "prefix": prefix,
        "prefill_sim_s_per_host": (prompt - cached) / PREFILL_TOK_S / HOSTS,
        "wait_rc": waited, "verify_rc": verified, "timeline": samples[:: max(1, len(samples) // 300)],
        "per_host": {w.name: sum(1 for r in rows if r["worker"] == w.name) for w in fleet.workers},
    }  # fmt: skip
    if killed is not None:
        out["killed"].update(_moved_on(rows, killed["host"]))
    return out


def _moved_on(rows: list[dict[str, Any]], host: str) -> dict[str, Any]:
    """The dead host's conversations: those with a turn stored by it, and of them the later turns stored by others."""
    convs = {r["conversation_id"] for r in rows if r["worker"] == host}
    after = [r for r in rows if r["conversation_id"] in convs and r["worker"] != host]
    by_others = {r["conversation_id"] for r in after}
    return {"conversations": len(convs), "went_on_elsewhere": len(by_others & convs), "turns_elsewhere": len(after)}


def bench() -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    server = RedisProcess(workdir / "redis").start()
    started = time.monotonic()
    try:
        runs = [run(w, on, server.url(), workdir) for w in ("multi-turn", "agentic") for on in (False, True)]
        runs.append(run("multi-turn", True, server.url(), workdir, kill=True))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    data = {
        "hosts": HOSTS, "inflight": INFLIGHT, "time_scale": TIME_SCALE, "prefill_tok_s": PREFILL_TOK_S,
        "max_new_tokens": MAX_NEW_TOKENS, "length_median": LENGTH_MEDIAN, "wait_s": WAIT_S,
        "multi": [MULTI_CONVERSATIONS, MULTI_TURNS], "agentic": [AGENTIC_CONVERSATIONS, AGENTIC_TURNS],
        "system": [SYSTEM_PROMPTS, SYSTEM_WORDS], "kill_at": KILL_AT, "wall_s": time.monotonic() - started,
        "lease_s": WORKER["lease_s"],
        "runs": runs, "code": code_version(), "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    data["plot"] = plot(data)
    return data


def plot(data: dict[str, Any]) -> str | None:
    """bench/results/affinity.png: hit rate and prefill per run, and turns stored over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is not installed: figures only
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [_label(r) for r in data["runs"]]
    colors = ["#c44e52" if not r["affinity"] else "#55a868" for r in data["runs"]]
    a.bar(labels, [100 * (r["prefix"].get("hit_rate") or 0) for r in data["runs"]], color=colors)
    a.set(title="prefix cache hit rate, later turns (%)", ylim=(0, 100))
    b.bar(labels, [r["prefill_tokens"] / 1e3 for r in data["runs"]], color=colors)
    b.set(title="prompt tokens prefilled (thousands)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    for r in data["runs"]:
        first = _first(r)
        points = [(t - first, done) for t, done in r["timeline"] if t >= first]
        t, done = zip(*points, strict=True) if points else ((), ())
        style = ":" if r.get("killed") else ("-" if r["affinity"] else "--")
        c.plot(t, done, style, label=_label(r))
        if r.get("killed"):
            c.axvline(r["killed"]["at_s"] - first, color="grey", lw=0.8)
    c.set(title="turns stored, from the first", xlabel="wall s since the first stored turn", ylabel="turns")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)
    return str(PLOT.relative_to(RESULTS.parent.parent))


def _label(run: dict[str, Any]) -> str:
    kill = ", 1 host killed" if run.get("killed") else ""
    return f"{run['workload']} {'affine' if run['affinity'] else 'shared'}{kill}"


def _first(run: dict[str, Any]) -> float:
    """Seconds from the queued submit to the first stored turn (saved runs before the field: from the timeline)."""
    if run.get("first_turn_s") is not None:
        return float(run["first_turn_s"])
    return next((t for t, done in run["timeline"] if done > 0), run["makespan_s"])


def _spread(per_host: dict[str, int]) -> str:
    return " / ".join(str(n) for _, n in sorted(per_host.items())) or "–"


def render(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        p = r["prefix"]
        same = p.get("same_host_share")
        rows.append([
            f"**{_label(r)}**", r["turns"], f"{same:.0%}" if same is not None else "–",
            f"**{p.get('hit_rate', 0):.1%}**" if p.get("hit_rate") is not None else "–",
            f"{r['prefill_tokens']:,}", f"{r['prefill_sim_s_per_host']:.1f}", f"{r['prompt_tokens']:,}",
            f"{_first(r):.1f}", f"{r['makespan_s'] - _first(r):.1f}", f"{r['tail_s']:.1f}",
            _spread(r.get("per_host") or {}),
            f"{r['latency_p99_s']:.2f}" if r["latency_p99_s"] is not None else "–",
            "ok" if r["wait_rc"] == 0 and r["verify_rc"] == 0 else f"wait {r['wait_rc']} verify {r['verify_rc']}",
        ])  # fmt: skip
    header = ["run", "turns", "on previous turn's host", "hit rate", "prefilled tokens", "prefill s / host",
              "prompt tokens", "first turn s", "then to the last s", "last 5 % s", "turns per host", "p99 latency s",
              "wait + verify"]  # fmt: skip
    pairs = []
    for workload in ("multi-turn", "agentic"):
        off = next(r for r in data["runs"] if r["workload"] == workload and not r["affinity"] and not r["killed"])
        on = next(r for r in data["runs"] if r["workload"] == workload and r["affinity"] and not r["killed"])
        saved = 1 - on["prefill_tokens"] / off["prefill_tokens"] if off["prefill_tokens"] else 0.0
        pairs.append(f"{workload}: {saved:.0%} less prefill")
    kill = next((r for r in data["runs"] if r.get("killed")), None)
    killed = ""
    if kill:
        k = kill["killed"]
        killed = (
            f"\n\nKilled run: `{k['host']}` SIGKILLed at {k['at_s']:.1f} s ({k['done']} turns stored). Of the "
            f"{k['conversations']} conversations it had stored a turn of, {k['went_on_elsewhere']} went on on other "
            f"hosts ({k['turns_elsewhere']} turns), with no restart: its offered turns were moved to the shared "
            f"queue once its heartbeat expired, its delivered ones restored after the lease ({data['lease_s']:g} s: "
            f"the plateau in the plot), and every turn was stored once (`producer verify`)."
        )
    plot_line = "\n\n![affinity](bench/results/affinity.png)" if data.get("plot") else ""
    m_convs, m_turns = data["multi"]
    a_convs, a_turns = data["agentic"]
    return f"""{code_stamp(data.get("code"))} Run {data["date"]}, {data["wall_s"]:.0f} s of wall.

    .venv/bin/python -m bench.bench_affinity

{data["hosts"]} hosts (a real worker each, {data["inflight"]} in flight, its own simulator at {data["time_scale"]:g}× —
its own prefix cache — prefilling {data["prefill_tok_s"]:,.0f} uncached tokens per simulated second, decode paused
meanwhile), one private Redis, `THINKFLEET_AFFINITY_WAIT_S` {data["wait_s"]:g}. Multi-turn: {m_convs} conversations
of {m_turns} turns; agentic: {a_convs} conversations of {a_turns} turns through tool calls (`--tool-results replay`,
3 steps a turn at most); each under one of {data["system"][0]} system prompts of ~{data["system"][1]} words (the
test tokenizer); answers of median {data["length_median"]:g} tokens. *shared* = `THINKFLEET_AFFINITY=false`, every
next turn on the shared queue (the placement before host affinity); *affine* = offered to the host that ran the
turn before it. Same run, fresh simulators for each.

{table(header, rows)}

{"; ".join(pairs)}. Even shared, a later turn finds its system prompt cached on any host that served it
once (and a finalizing host often pops the turn it just pushed onto the queue's consuming end); what affinity adds
is the rest of its history. *prefill s / host*: the simulated GPU seconds those prefilled tokens cost each host
(decode paused meanwhile). Times run from the moment the submit's messages are queued: *first turn s* is each
worker's one-off start on the job (loading its tokenizer before its first next-turn render: seconds, varying with
the box's load), *then to the last s* the job itself. On the 2-core VM that is bound by the workers' CPU (rendering
next turns, commits; four workers and four simulators on two cores), not by the simulated GPU, so affinity leaves it
about where it was — never worse beyond the noise: an idle host takes a full host's waiting turns after
`THINKFLEET_AFFINITY_IDLE_WAIT_S` — while the prefill it saves is GPU time on real hosts.{killed}{plot_line}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-json", type=Path, help="re-render BENCHMARKS.md from a saved run")
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        data["plot"] = plot(data) or data.get("plot")
    else:
        data = bench()
        write_json(JSON, data)
    for r in data["runs"]:
        print(
            f"{_label(r)}: hit rate {r['prefix'].get('hit_rate')}, same host {r['prefix'].get('same_host_share')}, "
            f"prefill {r['prefill_tokens']:,}, makespan {r['makespan_s']:.1f} s, tail {r['tail_s']:.1f} s"
        )
    update_section("bench_affinity", "Next turns where their prefix is cached: host affinity", render(data))


if __name__ == "__main__":
    main()
