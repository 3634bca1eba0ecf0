"""A Redis rollback under an agentic executor job: the step finalized again from its row goes on to its next step.

A worker that finds Redis lost finalizes of its own (a head restored from an older snapshot, a promoted replica that
lagged) finalizes its recent rows again from their parts (``GroupCommitter.replay``). For an agentic step with tool
calls that finalize runs the executor's record (workers/tool_exec.py), which is fenced by the run's claim: with no
fence held any more (the run had ended) the record read as fenced, and the step was marked done with no answer and
no next step — its conversation stranded while ``wait`` waited (found by the agentic operator nemesis, 2 runs of 5
when its commands ran in the test's process). The replay now runs its hooks under the stored run's fence
(``Ledger.holding``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from sglang_sim.tools import write_catalogue
from storage.reader import raw_duplicates, read_committed
from testing.datasets import write_jsonl
from testing.fleet import WorkerProcess, job_progress_or_down, stuck_report, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.record import Outcome, record_result
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.broker.keys import KombuKeys
from thinkfleet.template import load_tokenizer
from workers.tool_exec import TRUSTED_ENV

JOB = "rollback-steps"
TOOLS = [("calculator", {"expression": f"{a} * {a + 1}"}) for a in range(8)]
EXECUTOR = """
import json

def execute(request):
    return [json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in request["calls"]]
"""


def test_a_rolled_back_agentic_step_is_finalized_again_and_its_chain_goes_on(tmp_path: Path) -> None:
    started = time.monotonic()
    server = RedisServer(tmp_path / "redis").start()
    settings = isolated_settings(server.url(), str(tmp_path / "out"))
    client = redis.Redis.from_url(server.url())
    keys = settings.keys
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok_dir)), "kimi", TOOLS)
    executor = tmp_path / "tools_exec.py"
    executor.write_text(EXECUTOR)
    spec = f"{executor}:execute"
    messages = [
        {"role": "system", "content": "You compute with a calculator tool."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "42"},
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "c0", "messages": messages}])
    # Every answer calls a tool, each ~5 s long at 40 tokens/s: a snapshot fits inside the first step's run.
    sim_args = ("--tool-catalogue", str(catalogue), "--tool-call-share", "1.0", "--max-tool-calls", "1")
    sim_args += ("--time-scale", "1", "--per-request-tok-s", "40", "--length-median-tokens", "200")
    try:
        with simulator(tmp_path, *sim_args) as sim:
            env = {**fast_env(settings, sim, max_inflight=2, request_timeout_floor_s=120), TRUSTED_ENV: spec}
            worker = WorkerProcess("w1", env, tmp_path).start()
            try:
                worker.wait_ready(client, keys)
                submitted = producer_cli(
                    settings, "submit", str(data), "--job", JOB, "--tokenizer", str(tok_dir), "--processes", "1",
                    "--no-progress", "--max-new-tokens", "400", "--context-length", "131072", "--turns", "all",
                    "--tool-results", "executor", "--tool-executor", spec, "--max-tool-steps", "3", "--json",
                    in_process=True,
                )  # fmt: skip
                assert submitted.returncode == 0, submitted.stderr
                first = client.hkeys(keys.prompts(JOB))
                assert len(first) == 1, first
                step0 = first[0].decode()  # the conversation's first turn: its first step
                # Given the first step claimed and generating, a snapshot then (it holds the claim and the message)…
                wait_until(lambda: client.hexists(keys.claims(JOB), step0), 120, what="the first step's claim")
                before = client.lastsave()
                client.bgsave()
                assert not client.sismember(keys.done(JOB), step0), "the first step finished before the snapshot"
                wait_until(lambda: client.lastsave() != before, 60, what="the snapshot written")
                # …and the step then stored, its tool run and recorded, its next step enqueued: all after the snapshot.
                wait_until(lambda: client.hexists(keys.turn_answers(JOB), step0), 120, what="the first step finalized")
                assert json.loads(client.hget(keys.turn_answers(JOB), step0) or b"{}").get("next"), "no next step"
                # When Redis comes back from that snapshot without the step's message (nothing would run it again)…
                server.stop(kill=True)
                server.start()
                kombu = KombuKeys(settings.key_prefix)
                client.delete(kombu.unacked, kombu.unacked_index, settings.queue)
                assert not client.hexists(keys.turn_answers(JOB), step0)
                # Then the worker finalizes the step again from its row, runs its tool under that run's claim, and the
                # conversation goes on to its end: the job finishes with every step stored.
                report = lambda: stuck_report(client, settings, JOB, [worker])  # noqa: E731
                wait_until(
                    lambda: client.hexists(keys.turn_answers(JOB), step0), 120, what="finalized again", explain=report
                )
                again = json.loads(client.hget(keys.turn_answers(JOB), step0) or b"{}")
                assert again.get("next") and again.get("tool_results"), again

                def finished() -> bool:
                    p = job_progress_or_down(client, keys, JOB)
                    return p["done"] >= 2 and p["done"] + p["dead"] == p["submitted"]

                wait_until(finished, 180, what="the conversation at its end", explain=report)
            finally:
                worker.terminate()
        assert f"finalized {JOB}/{step0} again" in worker.tail(400)
        status = json.loads(producer_cli(settings, "status", JOB, "--json", in_process=True).stdout)
        verify = producer_cli(settings, "verify", JOB, in_process=True)
        rows = read_committed(settings.output_uri, JOB, columns=["prompt_id"])["prompt_id"].to_pylist()
        dups = raw_duplicates(settings.output_uri, JOB)
        agrees = bool(status["finished"]) and (status["done"], status["dead"]) == (len(rows), 0)
        problems = [] if verify.returncode == 0 else [f"producer verify failed: {verify.stdout[-3000:]}"]
        outcome = Outcome(len(rows), len(rows), 0, [], dups["prompt_id"].to_pylist(), [], verify.returncode == 0,
                          agrees, problems)  # fmt: skip
        record_result(
            "Redis rollback under an agentic executor job: a step finalized again from its row",
            outcome,
            "BGSAVE while the first step generates; the step stored, its tool run, its next step enqueued; Redis back "
            "from the snapshot without the step's message",
            [],
            time.monotonic() - started,
            workers=1,
            notes=f"{len(rows)} steps stored; the replayed step's executor record fenced by the stored run's claim",
        )
        outcome.assert_clean()
        assert agrees, status
    finally:
        server.stop()
