"""The demo's agentic sample (``python -m demo --agentic``, docs/conversations.md).

Given a Redis that answers (this session's private redis-server, the demo's own key prefix and queue made unique),
when the demo runs its agentic sample exactly as the README's command does — its own simulator with the tool
catalogue, two real workers trusting the example executor (docs/examples/agentic/tools.py), the real CLI for
submit, wait, status, verify, export and report — then it exits 0 (its verify passed), steps after tool results
are stored (``…/t{i}s{j}``, ``step_index`` ≥ 1), every fed result is the example executor's answer to the model's
own calls (marked ``executed``), a second ``producer verify`` re-renders every step and passes, and the
``messages`` export it wrote carries the executed tool messages.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from storage.reader import read_committed
from testing.harness import producer_cli
from thinkfleet.settings import Settings
from thinkfleet.turns import answer_message

if TYPE_CHECKING:
    from testing.services import RedisServer

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "docs/examples/agentic/tools.py"


def _example_tools() -> Any:
    spec = importlib.util.spec_from_file_location("example_tools", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(900)  # the whole demo in one test (about a minute here; a loaded CI box takes longer)
def test_the_demos_agentic_sample_runs_the_example_executor_end_to_end(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(
        redis_url=redis_server.url(0), output_uri=str(tmp_path / "out"), key_prefix=f"tfdemo{tag}", queue=f"qd{tag}"
    )
    env = {
        **os.environ,
        "THINKFLEET_REDIS_URL": settings.redis_url,
        "THINKFLEET_OUTPUT_URI": settings.output_uri,
        "THINKFLEET_KEY_PREFIX": settings.key_prefix,
        "THINKFLEET_QUEUE": settings.queue,
        "THINKFLEET_DEMO_DIR": str(tmp_path / "demo"),
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("THINKFLEET_BROKER_URL", "THINKFLEET_TOOL_EXECUTORS", "THINKFLEET_TOKENIZER_ROOTS"):
        env.pop(name, None)  # the demo sets what its workers need itself
    # When: the README's command runs (scripts/demo.sh --agentic execs exactly this in the checkout's venv)
    demo = subprocess.run(
        [sys.executable, "-m", "demo", "--agentic"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=840,
    )
    assert demo.returncode == 0, demo.stdout[-4000:]
    match = re.search(r"^Parquet:\s+\S+/(demo-agentic-[\d-]+)/dataset=", demo.stdout, re.M)
    assert match, demo.stdout[-2000:]
    job = match.group(1)
    steps = re.search(r"(\d+) steps stored; (\d+) tool results from the example executor", demo.stdout)
    assert steps and int(steps.group(2)) >= 1, demo.stdout[-2000:]

    # Then: steps after executed results are stored, each result the example executor's answer to the model's calls
    rows = read_committed(settings.output_uri, job).to_pylist()
    assert len(rows) == int(steps.group(1))
    assert any(r["step_index"] >= 1 for r in rows), "rows …/t{i}s{j} of steps after tool results"
    client = redis.Redis.from_url(settings.redis_url)
    try:
        answers = {k.decode(): json.loads(v) for k, v in client.hgetall(settings.keys.turn_answers(job)).items()}
    finally:
        client.close()
    assert set(answers) == {r["prompt_id"] for r in rows}
    tools = _example_tools()
    fed = [a for a in answers.values() if a.get("tool_results")]
    assert fed, "some step went on with the executor's results"
    for answer in fed:
        calls = answer_message(answer)["tool_calls"]
        want = tools.execute({"calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                        for c in calls]})  # fmt: skip
        assert [m["content"] for m in answer["tool_results"]] == want
        assert {m["source"] for m in answer["tool_results"]} == {"executed"}
        assert answer.get("next"), "a step fed results goes on to the next step"
    assert not [a for a in answers.values() if a.get("chain_end")], "no chain ended early"

    # And: verify passes again from outside the demo, every step re-rendered from its history
    verified = producer_cli(settings, "verify", job, "--json", in_process=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["step_prompt_mismatch"] == []
    # And: the messages export the demo wrote carries the executed tool messages
    exported = [json.loads(line) for line in (tmp_path / "demo" / f"{job}-messages.jsonl").read_text().splitlines()]
    assert {r["id"] for r in exported} == set(answers)
    assert any(m.get("source") == "executed" for r in exported for m in r["messages"] if m["role"] == "tool")
