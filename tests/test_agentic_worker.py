"""Agentic jobs of the Qwen3 and gpt-oss (harmony) families through a real worker, its executor flags its CLI flags.

Given a real ``worker`` started with ``--tool-executors A,B --tool-timeout-s 1 --tool-retries 1`` (no
``THINKFLEET_TOOL_EXECUTORS`` in its environment) and ``sglang-sim --model-family F`` with F's tool catalogue (Qwen3:
``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``; harmony: ``<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>ARGS<|call|>``, in the family's test tokenizer's ids):

- an ``--tool-results executor`` job with the example executor (A) is regenerated through its tool calls: steps
  after the executor's results are stored byte-exact (the simulator's output for each step's prompt), each prompt
  the family template's rendering of the conversation up to it (the results as Qwen3's ``<tool_response>`` blocks,
  as harmony's ``functions.NAME to=assistant`` messages), every fed result the example executor's answer to the
  model's own decoded call, and ``producer verify`` passes;
- a (Qwen3) job whose executor (B) never answers has each step with calls tried exactly 1 + ``--tool-retries``
  times, each try cut by ``--tool-timeout-s`` (the defaults, 30 s and 2 retries, would make three 30 s tries), and
  its chain ends ``tool_error`` naming the timeout;
- the flags reach the worker's settings (``--tool-concurrency`` too) and an executor the flags do not list is
  refused.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
import redis
from click.testing import CliRunner

import workers.app
from sglang_sim.content import ContentConfig, expected_generation
from sglang_sim.tools import write_catalogue
from storage.reader import read_committed
from storage.verify_steps import chains
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.template import load_tokenizer, render_ids
from thinkfleet.tool_steps import for_render, plan_agentic, step_messages
from thinkfleet.turns import answer_message
from workers import cli
from workers.tool_exec import TRUSTED_ENV, ToolExecError, ToolExecutor

if TYPE_CHECKING:
    from testing.services import RedisServer

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "docs/examples/agentic"
SIM_CONTENT = {"tool_call_share": 0.7, "length_median_tokens": 60.0, "max_tool_calls": 2}
#: An executor that never answers in time, logging each call id it is tried with.
SLOW_EXECUTOR = """
import asyncio

async def execute(request):
    with open(__file__ + ".calls", "a") as f:
        f.write("".join(call["id"] + "\\n" for call in request["calls"]))
    await asyncio.sleep(60)
"""
TIMEOUT_S, RETRIES = 1.0, 1


@dataclass
class AgenticRun:
    family: str
    settings: Settings
    client: redis.Redis
    tok_dir: Path
    content: ContentConfig
    job: str
    slow_job: str
    slow_log: Path


@contextlib.contextmanager
def _agentic_fleet(redis_url: str, tmp_path: Path, family: str, slow_job: str = "") -> Iterator[AgenticRun]:
    """``sglang-sim --model-family FAMILY`` with its tool catalogue, one worker with the executor flags, and the
    example conversations submitted as an executor job (and as ``slow_job`` with the slow executor), all settled."""
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(settings.redis_url)
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir(family=family), family=family))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok_dir)), family)
    content = ContentConfig(model_family=family, tool_catalogue=str(catalogue), **SIM_CONTENT)  # type: ignore[arg-type]
    slow = tmp_path / "slow_tools.py"
    slow.write_text(SLOW_EXECUTOR)
    example_spec, slow_spec = f"{EXAMPLE / 'tools.py'}:execute", f"{slow}:execute"
    sim_args = ["--model-family", family, "--tool-catalogue", str(catalogue), "--time-scale", "400"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    job = f"{family}-agentic"
    jobs = [(job, example_spec)] + ([(slow_job, slow_spec)] if slow_job else [])
    with simulator(tmp_path / "logs", *sim_args) as sim:
        env = fast_env(settings, sim, max_inflight=4)
        env.pop(TRUSTED_ENV, None)  # the flags alone say what this worker runs
        flags = ("--tool-executors", f"{example_spec},{slow_spec}", "--tool-timeout-s", str(TIMEOUT_S))
        flags += ("--tool-retries", str(RETRIES), "--tool-concurrency", "2")
        worker = WorkerProcess(f"w-{family}", env, tmp_path / "logs", extra_args=flags).start()
        try:
            common = ["--tokenizer", str(tok_dir), "--processes", "1", "--no-progress", "--max-new-tokens", "400",
                      "--seed", "7", "--context-length", "131072", "--turns", "all", "--tool-results", "executor",
                      "--max-tool-steps", "4", "--json"]  # fmt: skip
            data = str(EXAMPLE / "chat.jsonl")
            with ThreadPoolExecutor(len(jobs)) as pool:  # the submits while the worker starts
                running = [
                    pool.submit(producer_cli, settings, "submit", data, "--job", name, *common, "--tool-executor", spec)
                    for name, spec in jobs
                ]
                worker.wait_ready(client, settings.keys)
                for submitted in (r.result() for r in running):
                    assert submitted.returncode == 0, submitted.stderr

            def settled() -> bool:
                for name, _ in jobs:
                    p = job_progress(client, settings.keys, name)
                    if not (p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]):
                        return False
                return True

            wait_until(settled, 240, what=f"every step of the {family} agentic jobs")
            yield AgenticRun(family, settings, client, tok_dir, content, job, slow_job, Path(f"{slow}.calls"))
        finally:
            worker.terminate()
            client.close()


@pytest.fixture(scope="module")
def qwen3_run(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgenticRun]:
    with _agentic_fleet(redis_server.url(0), tmp_path_factory.mktemp("agentic-qwen3"), "qwen3", "slow-tools") as run:
        yield run


@pytest.fixture(scope="module")
def harmony_run(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgenticRun]:
    with _agentic_fleet(redis_server.url(0), tmp_path_factory.mktemp("agentic-harmony"), "harmony") as run:
        yield run


def _answers(run: AgenticRun, job: str) -> dict[str, dict[str, Any]]:
    return {k.decode(): json.loads(v) for k, v in run.client.hgetall(run.settings.keys.turn_answers(job)).items()}


def _example_tools() -> Any:
    spec = importlib.util.spec_from_file_location("example_tools", EXAMPLE / "tools.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: How each family's template renders a fed tool result (Qwen3: a user turn of <tool_response> blocks; harmony: a
#: message from the function to the assistant).
RESULT_RENDERING = {"qwen3": "<tool_response>", "harmony": " to=assistant<|channel|>commentary<|message|>"}


@pytest.mark.parametrize("family", ["qwen3", "harmony"])
def test_an_agentic_job_runs_through_its_tool_calls_byte_exact(family: str, request: pytest.FixtureRequest) -> None:
    run: AgenticRun = request.getfixturevalue(f"{family}_run")
    assert dead_letters(run.client, run.settings.keys, run.job) == {}
    record = JobRecord.load(run.client, run.settings.keys, run.job)
    assert record is not None and record.model_family == family
    tok = load_tokenizer(str(run.tok_dir))
    rows = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, run.job).to_pylist()}
    answers = _answers(run, run.job)
    convs = {k.decode(): json.loads(v) for k, v in run.client.hgetall(run.settings.keys.conversations(run.job)).items()}
    source = {json.loads(line)["id"]: json.loads(line) for line in (EXAMPLE / "chat.jsonl").read_text().splitlines()}
    tools = _example_tools()
    fed = 0
    walked: set[str] = set()
    for conv_id, chain in chains(convs, answers).items():
        conv = plan_agentic(source[conv_id.rsplit("/", 1)[1]]["messages"])
        assert conv is not None
        history: list[dict[str, Any]] = []
        for pid in chain:
            walked.add(pid)
            row, answer = rows[pid], answers[pid]
            want = render_ids(tok, for_render(step_messages(conv, history)), None, record.chat_template_kwargs)
            assert row["input_ids"] == want, f"{pid}'s prompt is not the {family} template's rendering"
            expected = expected_generation(row["input_ids"], json.loads(row["sampling_params"]), run.content)
            assert row["output_ids"] == expected.output_ids, pid
            if answer.get("tool_results"):
                calls = [c["function"] for c in answer_message(answer)["tool_calls"]]
                results = tools.execute({"calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]})
                assert [m["content"] for m in answer["tool_results"]] == results
                assert {m["source"] for m in answer["tool_results"]} == {"executed"}
                fed += 1
            history.append(answer)
    assert walked == set(rows), "every stored row is a step of a chain"
    assert fed >= 1 and any(r["step_index"] >= 1 for r in rows.values()), "some turn went on through its results"
    # A step after results holds them as the family renders tool results.
    after = next(r for r in rows.values() if r["step_index"] >= 1)
    assert RESULT_RENDERING[family] in tok.decode(after["input_ids"])
    verified = producer_cli(run.settings, "verify", run.job, "--json", in_process=True)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr
    assert json.loads(verified.stdout)["step_prompt_mismatch"] == []


def test_the_workers_timeout_and_retry_flags_bound_each_executor_call(qwen3_run: AgenticRun) -> None:
    run = qwen3_run
    answers = _answers(run, run.slow_job)
    ended = {p: a for p, a in answers.items() if a.get("chain_end") == "tool_error"}
    assert ended, "some step called a tool"
    assert all(a.get("tool_calls") for a in ended.values())
    assert all("TimeoutError" in a["tool_error"] for a in ended.values()), ended
    # Each call id (stable per step revision) was tried 1 + --tool-retries times, no more.
    tries = Counter(run.slow_log.read_text().split())
    assert tries and set(tries.values()) == {1 + RETRIES}, tries
    assert {i.split("@")[0] for i in tries} == set(ended)
    counters = run.client.hgetall(run.settings.keys.counters(run.slow_job))
    assert int(counters.get(b"chains_ended:tool_error", 0)) == len(ended)


def test_the_executor_flags_reach_the_workers_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def use_settings(settings: Settings) -> Any:
        seen["settings"] = settings
        return SimpleNamespace(conf=SimpleNamespace(worker_concurrency=1), worker_main=lambda argv: 0)

    monkeypatch.setattr(workers.app, "use_settings", use_settings)
    monkeypatch.delenv(TRUSTED_ENV, raising=False)
    spec = f"{EXAMPLE / 'tools.py'}:execute"
    flags = ["--tool-executors", spec, "--tool-timeout-s", "2.5", "--tool-retries", "0", "--tool-concurrency", "3"]
    result = CliRunner().invoke(cli.main, flags)
    assert result.exit_code == 0, result.output
    settings = seen["settings"]
    assert (settings.tool_executors, settings.tool_timeout_s, settings.tool_retries, settings.tool_concurrency) == (
        spec,
        2.5,
        0,
        3,
    )
    executor = ToolExecutor.for_worker(spec, settings)
    assert (executor.timeout_s, executor.retries, executor._sem._value) == (2.5, 0, 3)
    # An executor the flag does not list never loads (its module never runs).
    other = tmp_path / "other.py"
    other.write_text("raise SystemExit('ran')\n")
    with pytest.raises(ToolExecError, match="--tool-executors"):
        ToolExecutor.for_worker(f"{other}:execute", settings)
