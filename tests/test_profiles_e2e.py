"""Each model family end to end: the real ``producer submit`` (its own test tokenizer, the family detected),
a real worker, ``sglang-sim --model-family …``, Parquet rows whose spans cover exactly the reasoning and
the tool calls the simulator emitted — checked here by reading the ids, not with ``storage.spans``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from sglang_sim.content import ContentConfig, expected_generation
from storage.reader import read_committed
from storage.verify import verify_job
from testing.datasets import chat_rows, write_jsonl
from testing.fleet import dead_letters, job_progress, stuck_report, wait_until
from testing.harness import isolated_settings, producer_cli
from testing.module_fleet import FleetPool
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.profiles import PROFILES
from thinkfleet.state.job import JobRecord

ROWS = 14
TOOL_SHARE = "0.5"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
_DS = PROFILES["deepseek"]
#: DeepSeek's marker ids by role, from its profile (what its test tokenizer and the simulator hold).
DS = {role: _DS.reference_ids[name] for role, name in _DS.markers.items() if name is not None}
DS_EOS = _DS.reference_ids[_DS.stop_tokens[0]]
# Qwen3's and gpt-oss's real ids (thinkfleet.profiles), as the test tokenizers and the simulator hold them.
THINK, END_THINK, CALL, END_CALL, IM_END = 151667, 151668, 151657, 151658, 151645
CHANNEL, MESSAGE, END, START, RETURN, CALL_H, ANALYSIS, FINAL = (
    200005,
    200008,
    200007,
    200006,
    200002,
    200012,
    35644,
    17196,
)


def _dataset(path: Path) -> Path:
    rows = chat_rows(ROWS, words=12)
    for i, row in enumerate(rows):
        if i % 2:
            row["tools"] = TOOLS  # half the prompts declare a tool: the templates' tool blocks render too
    return write_jsonl(path, rows)


@pytest.fixture(scope="module")
def fleets(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetPool]:
    """One simulator per model family (and one that never closes reasoning), each with one worker, shared by the
    jobs of the tests that use it (each submits its own); one runs at a time, so the tests below are grouped by the
    simulator they need (the Qwen3 ones first)."""
    pool = FleetPool(redis_server.url(0), tmp_path_factory.mktemp("profiles"))
    yield pool
    pool.close()


def _run(
    tmp_path: Path,
    fleets: FleetPool,
    family: str,
    sim_family: str,
    job: str,
    *flags: str,
    sim_flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Submit with the real CLI to a worker of ``sglang-sim --model-family sim_family``, and return
    {rows, record, client, settings, submit, report, verify}; verify must pass unless ``sim_flags`` are given."""
    sim_args = ("--time-scale", "1000", "--model-family", sim_family, "--tool-call-share", TOOL_SHARE, *sim_flags)
    fleet = fleets.get(
        "-".join((sim_family, *sim_flags)),
        sim_args,
        settings={"alarm_min_rows": 5},  # as the worker's
        max_inflight=8,
        alarm_min_rows=5,
    )
    settings, client = fleet.settings, fleet.client
    tok = build_test_tokenizer(default_test_tokenizer_dir(family=family), family=family)
    data = _dataset(tmp_path / "alpha.jsonl")
    args = ("submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1", "--no-progress")
    args += ("--max-new-tokens", "6000", "--seed", "5", "--context-length", "131072", "--json", *flags)
    submitted = producer_cli(settings, *args, in_process=True)  # the tokenizer loads once per process
    assert submitted.returncode == 0, submitted.stderr
    wait_until(
        lambda: job_progress(client, settings.keys, job)["done"] == ROWS,
        180,
        what=f"{ROWS} rows",
        explain=lambda: stuck_report(client, settings, job, fleet.workers),
    )
    assert dead_letters(client, settings.keys, job) == {}
    record = JobRecord.load(client, settings.keys, job)
    assert record is not None
    rows = read_committed(settings.output_uri, job).to_pylist()
    assert len(rows) == ROWS
    think_end = "--no-think-end" not in sim_flags
    config = ContentConfig(model_family=sim_family, tool_call_share=float(TOOL_SHARE), think_end=think_end)
    for row in rows:  # byte-exact: what the simulator of this family said, for this prompt and seed
        want = expected_generation(row["input_ids"], json.loads(row["sampling_params"]), config)
        assert row["output_ids"] == want.output_ids, row["prompt_id"]
    # recomputes every span with the job's profile
    verify = producer_cli(settings, "verify", job, "--json", in_process=True)
    if not sim_flags:
        assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout[-3000:]
    report = producer_cli(settings, "report", job, "--json", in_process=True)
    assert report.returncode == 0, report.stderr
    return {
        "rows": rows,
        "record": record,
        "client": client,
        "settings": settings,
        "submit": json.loads(submitted.stdout),
        "report": json.loads(report.stdout),
        "verify": json.loads(verify.stdout),
    }


def _calls(row: dict[str, Any]) -> list[tuple[int, int]]:
    return [(c["start"], c["end"]) for c in row["tool_call_spans"]]


@pytest.mark.timeout(400)
def test_a_qwen3_job_runs_end_to_end_with_its_own_markers(tmp_path: Path, fleets: FleetPool) -> None:
    got = _run(tmp_path, fleets, "qwen3", "qwen3", "qwen")
    record = got["record"]
    assert record.model_family == "qwen3" and record.reasoning_spans
    assert record.chat_template_kwargs == {"enable_thinking": True}
    assert (record.think_start_id, record.think_end_id) == (THINK, END_THINK)
    assert (record.tool_call_begin_id, record.tool_call_end_id, record.tool_section_begin_id) == (CALL, END_CALL, None)
    assert record.sampling_params["stop_token_ids"] == [IM_END, 151643]
    assert not record.prompt_ends_with_think_start  # Qwen3's model opens <think> itself
    tool_rows = 0
    for row in got["rows"]:
        out = row["output_ids"]
        assert row["input_ids"][-1] != THINK and out[0] == THINK
        body_end = len(out) - (out[-1] == IM_END)  # a row cut at max_new_tokens has no <|im_end|>
        closed = END_THINK in out
        end = out.index(END_THINK) if closed else body_end
        # The reasoning span is exactly the ids between <think> and </think>.
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (1, end, closed)
        assert THINK not in out[1:end] and END_THINK not in out[1:end]
        begins = [i for i, t in enumerate(out) if t == CALL]
        calls = []
        for k, b in enumerate(begins):  # each <tool_call> to its </tool_call>, or to where it was cut off
            limit = begins[k + 1] if k + 1 < len(begins) else body_end
            close = next((i for i in range(b, limit) if out[i] == END_CALL), None)
            calls.append((b, close + 1 if close is not None else limit))
        assert _calls(row) == calls
        answer = (end + 1, begins[0] if begins else body_end) if closed else (body_end, body_end)
        assert (row["answer_start"], row["answer_end"]) == answer
        assert row["stop_token"] == (IM_END if body_end < len(out) else None)
        tool_rows += bool(begins)
    assert 0 < tool_rows < ROWS, "the simulator emitted tool calls in some rows, and they were spanned"
    assert not got["client"].exists(got["settings"].keys.alarm("qwen")), "the rows closed their reasoning"
    assert got["report"]["model_family"] == "qwen3" and got["report"]["think_end_rate"] > 0.8


@pytest.mark.timeout(400)
def test_a_qwen3_thinking_2507_job_whose_prompt_opens_reasoning_spans_it_from_the_first_output_id(
    tmp_path: Path, fleets: FleetPool
) -> None:
    """The template ends the prompt with ``<think>\\n``: the model (the simulator) starts inside reasoning and
    emits no ``<think>``; the row's reasoning is output_ids[0:</think>], and the alarm counts these rows."""
    got = _run(tmp_path, fleets, "qwen3-thinking", "qwen3", "qwenthink")
    record = got["record"]
    assert record.model_family == "qwen3" and record.reasoning_spans
    newline = record.markers["\n"]  # submit read the whitespace id from the tokenizer
    assert record.span_tokens().prompt_trailing_ids == (newline,)
    for row in got["rows"]:
        prompt, out = row["input_ids"], row["output_ids"]
        assert prompt[-2:] == [THINK, newline] and THINK not in out
        body_end = len(out) - (out[-1] == IM_END)
        closed = END_THINK in out
        end = out.index(END_THINK) if closed else body_end
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (0, end, closed)
    assert not got["client"].exists(got["settings"].keys.alarm("qwenthink"))
    assert got["report"]["think_end_rate"] > 0.8


@pytest.mark.timeout(400)
def test_a_qwen3_job_with_thinking_off_has_no_reasoning_and_no_alarm(tmp_path: Path, fleets: FleetPool) -> None:
    kwargs = json.dumps({"enable_thinking": False})
    got = _run(tmp_path, fleets, "qwen3", "qwen3", "qwennothink", "--chat-template-kwargs", kwargs)
    assert got["record"].chat_template_kwargs == {"enable_thinking": False}
    for row in got["rows"]:  # the prompt closed an empty reasoning block: the model answers at once
        assert END_THINK in row["input_ids"][-3:]
        assert THINK not in row["output_ids"] and END_THINK not in row["output_ids"]
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (0, 0, False)
    verify = verify_job(got["settings"], "qwennothink")
    assert verify.ok and not verify.reasoning_alarm and verify.thinking_rows == 0
    # … and the workers' own alarm agrees: no row was expected to reason, none is counted missing.
    client, keys = got["client"], got["settings"].keys
    assert not client.exists(keys.alarm("qwennothink")), "a thinking-off job must not raise the workers' alarm"
    counters = client.hgetall(keys.counters("qwennothink"))
    assert int(counters.get(b"expected_think_end", 0)) == 0 and int(counters.get(b"missing_think_end", 0)) == 0


@pytest.mark.timeout(400)
def test_a_tokenizer_without_reasoning_markers_is_refused_then_runs_without_reasoning_spans(
    tmp_path: Path, redis_url: str, fleets: FleetPool
) -> None:
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    tok = build_test_tokenizer(default_test_tokenizer_dir(family="plain"), family="plain")
    data = _dataset(tmp_path / "alpha.jsonl")
    refused = producer_cli(
        settings, "submit", str(data), "--job", "plain", "--tokenizer", str(tok), "--no-progress", in_process=True
    )
    assert refused.returncode == 1
    assert "'<think>'" in refused.stderr and "--no-reasoning-spans" in refused.stderr
    assert redis.Redis.from_url(redis_url).llen(settings.queue) == 0

    # The model (Qwen-shaped ids) does think; the job asked for no reasoning spans: none, and no alarm.
    got = _run(tmp_path, fleets, "plain", "qwen3", "plain", "--no-reasoning-spans")
    record = got["record"]
    assert record.model_family == "qwen3" and record.reasoning_spans is False
    assert record.think_start_id is None and record.think_end_id is None
    assert any("reasoning spans are off" in w for w in got["submit"]["warnings"])
    for row in got["rows"]:  # null: not recorded (0:0 would say "no reasoning")
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (None, None, None)
        assert (row["answer_start"], row["answer_end"]) == (None, None)
        out = row["output_ids"]
        begins = [i for i, t in enumerate(out) if t == CALL]
        assert [s for s, _ in _calls(row)] == begins  # tool calls are still spanned
    counters = got["client"].hgetall(got["settings"].keys.counters("plain"))
    # Spans are off: no row is expected to reason, none counts as missing </think>, and no alarm.
    assert int(counters[b"missing_think_end"]) == 0 and int(counters.get(b"expected_think_end", 0)) == 0
    assert not got["client"].exists(got["settings"].keys.alarm("plain")), "no alarm: spans are off"
    assert got["report"]["reasoning_spans"] is False and got["report"]["think_end_rate"] is None


@pytest.mark.timeout(400)
def test_a_qwen3_thinking_job_whose_outputs_never_close_reasoning_fails_verify_with_the_alarm(
    tmp_path: Path, fleets: FleetPool
) -> None:
    """Qwen3's prompt does not open reasoning (the model opens ``<think>`` itself), so the prompt cannot tell the
    alarm these rows should reason; the job's ``enable_thinking`` does."""
    got = _run(tmp_path, fleets, "qwen3", "qwen3", "qwenlost", sim_flags=("--no-think-end",))
    assert all(END_THINK not in row["output_ids"] for row in got["rows"])
    verify = verify_job(got["settings"], "qwenlost")  # in process: the settings' alarm_min_rows (5) apply
    assert verify.reasoning_alarm and not verify.ok
    assert (verify.thinking_rows, verify.think_end_rows) == (ROWS, 0)
    assert not verify.malformed and not verify.missing
    # … and the workers' own alarm (finalize.lua) agrees: it fired, counting every row as expected to reason.
    client, keys = got["client"], got["settings"].keys
    assert client.exists(keys.alarm("qwenlost")), "the workers' alarm must fire too"
    assert int(client.hget(keys.counters("qwenlost"), "expected_think_end")) == ROWS


@pytest.mark.timeout(400)
def test_a_deepseek_r1_job_spans_reasoning_from_the_first_output_id_and_its_tool_call_section(
    tmp_path: Path, fleets: FleetPool
) -> None:
    """R1-0528's template ends the prompt with ``<think>\\n``: the output starts inside reasoning, closes it with
    ``</think>``, then answers or calls tools in ``<｜tool▁calls▁begin｜>`` sections, and ends with EOS."""
    got = _run(tmp_path, fleets, "deepseek", "deepseek", "dsr1")
    record = got["record"]
    assert record.model_family == "deepseek" and record.reasoning_spans
    assert {role: getattr(record, role) for role in DS} == DS
    assert record.prompt_ends_with_think_start
    think, end_think = DS["think_start_id"], DS["think_end_id"]
    section, section_end = DS["tool_section_begin_id"], DS["tool_section_end_id"]
    call, call_end = DS["tool_call_begin_id"], DS["tool_call_end_id"]
    tool_rows = 0
    for row in got["rows"]:
        prompt, out = row["input_ids"], row["output_ids"]
        assert prompt[-2] == think and think not in out
        body_end = len(out) - (out[-1] == DS_EOS)
        assert row["stop_token"] == (DS_EOS if body_end < len(out) else None)
        closed = end_think in out
        end = out.index(end_think) if closed else body_end
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (0, end, closed)
        begins = [i for i, t in enumerate(out) if t == call]
        calls = []
        for b in begins:  # each call to its end marker, or to the next call / section end / cut
            stops = [i for i in range(b + 1, body_end) if out[i] in (call, section_end)]
            limit = stops[0] if stops else body_end
            close = next((i for i in range(b, limit) if out[i] == call_end), None)
            calls.append((b, close + 1 if close is not None else limit))
        assert _calls(row) == calls
        answer_end = out.index(section) if section in out else body_end
        answer = (end + 1, answer_end) if closed else (body_end, body_end)
        assert (row["answer_start"], row["answer_end"]) == answer
        tool_rows += bool(begins)
    assert 0 < tool_rows < ROWS
    assert not got["client"].exists(got["settings"].keys.alarm("dsr1"))
    assert got["report"]["model_family"] == "deepseek" and got["report"]["think_end_rate"] > 0.8


@pytest.mark.timeout(400)
def test_a_harmony_job_runs_end_to_end_with_channel_spans(tmp_path: Path, fleets: FleetPool) -> None:
    got = _run(tmp_path, fleets, "harmony", "harmony", "gptoss")
    record = got["record"]
    assert record.model_family == "harmony" and record.reasoning_spans
    assert record.chat_template_kwargs == {"reasoning_effort": "medium"}
    assert record.span_tokens().scheme == "harmony"
    assert record.sampling_params["stop_token_ids"] == [RETURN, 199999, CALL_H]
    tool_rows = 0
    for row in got["rows"]:
        prompt, out = row["input_ids"], row["output_ids"]
        assert prompt[-2:] == [START, 173781]  # <|start|>assistant
        assert out[:3] == [CHANNEL, ANALYSIS, MESSAGE]
        body_end = len(out) - (out[-1] in (RETURN, CALL_H))
        assert row["stop_token"] == (out[-1] if body_end < len(out) else None)
        if END not in out:  # cut off inside the reasoning
            assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (3, body_end, False)
            assert _calls(row) == [] and row["answer_start"] == row["answer_end"] == body_end
            continue
        end = out.index(END)
        # Reasoning: the analysis message's content, exactly.
        assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (3, end, True)
        assert not {CHANNEL, MESSAGE, END, START, RETURN, CALL_H} & set(out[3:end])
        header = out.index(CHANNEL, end)  # the second message's <|channel|>
        if out[-1] == CALL_H:  # a commentary message to functions.…: the tool call, channel to <|call|>
            tool_rows += 1
            assert out[header + 1] != FINAL
            assert _calls(row) == [(header, len(out))]
            assert row["answer_start"] == row["answer_end"] == body_end
        elif out[header + 1] == FINAL:  # the final message is the answer, <|return|> excluded
            assert out[header + 2] == MESSAGE
            assert _calls(row) == [] and (row["answer_start"], row["answer_end"]) == (header + 3, body_end)
        else:  # a call cut off before its <|call|>: spanned to the end, like a cut-off Kimi/Qwen3 call
            assert row["finish_reason"] == "length" and out[-1] != CALL_H
            assert _calls(row) == ([(header, body_end)] if header + 1 < body_end else [])
            assert row["answer_start"] == row["answer_end"] == body_end
    assert 0 < tool_rows < ROWS
    assert not got["client"].exists(got["settings"].keys.alarm("gptoss"))
    assert got["report"]["model_family"] == "harmony"
