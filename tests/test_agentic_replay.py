"""Agentic ``--turns all`` jobs with ``--tool-results replay``: regenerated through tool calls, step by step.

The rules (thinkfleet/tool_steps.py): the dataset's recorded results of a step are matched to the model's calls by
position and function name; a mismatch ends the chain or, with ``keep_recorded``, feeds them anyway; arguments
that differ are recorded.

End to end: Kimi-template conversations of two user turns, each turn calling tools twice in the dataset (one call,
then two in parallel) before its answer, submitted with the real CLI; two real workers against the simulator,
whose calls decode to real names (its tool catalogue), one worker SIGKILLed between a part write and its
finalize. Then every step of every conversation is stored once, byte-exact, each step's prompt the chat
template's rendering of the conversation up to it (the model's answers, the results fed back after its calls),
the fed results are the dataset's, rows say their ``step_index`` and whether arguments differed, ``producer
verify`` passes and the ``messages`` export carries the ``tool`` messages fed back, marked ``recorded``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import ContentConfig, expected_generation
from sglang_sim.tools import write_catalogue
from storage.reader import raw_duplicates, read_committed
from testing.datasets import write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.tool_steps import for_render, plan_agentic, replay_results, step_messages
from thinkfleet.turns import answer_message, split_step_id, turn_id

if TYPE_CHECKING:
    from testing.services import RedisServer

CONVERSATIONS = 6
TURNS = 2


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"functions.{name}:{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _agentic_rows() -> list[dict[str, Any]]:
    """Each user turn: a calculator call → its result → a lookup and a calculator call → two results → answer."""
    rows = []
    for c in range(CONVERSATIONS):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant with tools."}]
        for t in range(TURNS):
            msgs += [
                {"role": "user", "content": f"Question {t} of chat {c}: how long is the trip, and the bridge?"},
                {"role": "assistant", "content": "", "tool_calls": [_call(0, "calculator", {"expression": "240/80"})]},
                {"role": "tool", "tool_call_id": "functions.calculator:0", "content": f"recorded 3 ({c}.{t})"},
                {"role": "assistant", "content": "", "tool_calls": [
                    _call(1, "lookup", {"key": "bridge"}), _call(2, "calculator", {"expression": "100 * 101 / 2"})]},
                {"role": "tool", "tool_call_id": "functions.lookup:1", "content": f"recorded 1887 ({c}.{t})"},
                {"role": "tool", "tool_call_id": "functions.calculator:2", "content": f"recorded 5050 ({c}.{t})"},
                {"role": "assistant", "content": f"the dataset's answer {t}"},
            ]  # fmt: skip
        rows.append({"id": f"c{c}", "messages": msgs})
    return rows


# -- the rules -------------------------------------------------------------------------------------------
def test_replay_matches_by_position_and_name_and_records_differing_arguments() -> None:
    conv = plan_agentic(_agentic_rows()[0]["messages"])
    assert conv is not None and conv["turn_count"] == TURNS and len(conv["steps"][0]) == 2
    same = [_call(0, "calculator", {"expression": "240/80"})]
    other_args = [_call(0, "calculator", {"expression": "1 + 1"})]
    r = replay_results(conv, 0, 0, same)
    assert r.results is not None and [m["content"] for m in r.results] == ["recorded 3 (0.0)"]
    assert r.results[0]["tool_call_id"] == "functions.calculator:0" and r.results[0]["source"] == "recorded"
    assert (r.mismatch, r.args_differ, r.ends_chain) == ("", False, False)
    assert replay_results(conv, 0, 0, other_args).args_differ is True
    # Another function: the chain ends (default) or the recorded result is fed anyway (keep_recorded).
    wrong = [_call(0, "lookup", {"key": "x"})]
    assert replay_results(conv, 0, 0, wrong).ends_chain
    kept = replay_results(conv, 0, 0, wrong, "keep_recorded")
    assert kept.results is not None and kept.mismatch and not kept.ends_chain
    # Two calls where one result is recorded: nothing to feed the second, even with keep_recorded.
    assert replay_results(conv, 0, 0, [*same, *same], "keep_recorded").ends_chain
    # A call where the dataset answers (step 2 has no recorded call): ends the chain under either policy.
    assert replay_results(conv, 0, 2, same, "keep_recorded").ends_chain
    # No call where the dataset calls: a mismatch; keep_recorded ends the turn there instead of the chain.
    assert replay_results(conv, 0, 0, []).ends_chain
    kept = replay_results(conv, 0, 0, [], "keep_recorded")
    assert kept.results is None and kept.mismatch and not kept.ends_chain
    # No call where the dataset answers: the turn ends, no mismatch.
    assert replay_results(conv, 0, 2, []) == replay_results(conv, 0, 2, [])
    assert not replay_results(conv, 0, 2, []).mismatch


def test_job_file_keys_set_the_tool_flags(tmp_path: Path) -> None:
    from producer.jobfile import load, submit_flags

    data = write_jsonl(tmp_path / "chat.jsonl", _agentic_rows())
    path = tmp_path / "job.yaml"
    path.write_text(
        f"job: agentic\ntokenizer: {tmp_path}\nturns: all\ntool_results: replay\ntool_mismatch: keep_recorded\n"
        f"max_tool_steps: 3\ndatasets:\n  - path: {data}\n"
    )
    flags, _ = submit_flags(load(path), {"turns", "tool_results", "tool_mismatch", "max_tool_steps"}, path)
    assert flags["tool_results"] == "replay" and flags["tool_mismatch"] == "keep_recorded"
    assert flags["max_tool_steps"] == 3


# -- end to end ------------------------------------------------------------------------------------------
@dataclass
class AgenticJob:
    settings: Settings
    client: redis.Redis
    job: str
    data: Path
    tok_dir: Path
    content: ContentConfig
    fp_dir: Path


SIM_CONTENT = {"tool_call_share": 0.6, "length_median_tokens": 60.0, "max_tool_calls": 2}


@pytest.fixture(scope="module")
def agentic_job(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgenticJob]:
    tmp_path = tmp_path_factory.mktemp("agentic")
    (tmp_path / "logs").mkdir()
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    redis_url = redis_server.url(0)
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    tok_dir = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok_dir)), "kimi")
    content = ContentConfig(tool_catalogue=str(catalogue), **SIM_CONTENT)  # type: ignore[arg-type]
    data = write_jsonl(tmp_path / "chat.jsonl", _agentic_rows())
    job = "agentic"
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "400"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    with simulator(tmp_path / "logs", *sim_args) as sim:
        env = fast_env(settings, sim, max_inflight=4, lease_s=3, reaper_interval_s=0.5)
        doomed_env = {**env, failpoints.ENV: "after_part_write=kill", failpoints.DIR_ENV: str(fp_dir)}
        doomed_env.pop(failpoints.TIMES_ENV, None)
        w1 = WorkerProcess("w1", doomed_env, tmp_path / "logs").start()
        w2 = WorkerProcess("w2", env, tmp_path / "logs").start()
        try:
            w1.wait_ready(client, settings.keys)
            w2.wait_ready(client, settings.keys)
            submitted = producer_cli(
                settings, "submit", str(data), "--job", job, "--tokenizer", str(tok_dir), "--processes", "1",
                "--no-progress", "--max-new-tokens", "400", "--seed", "3", "--context-length", "131072",
                "--turns", "all", "--tool-results", "replay", "--tool-mismatch", "keep_recorded",
                "--max-tool-steps", "3", "--json",
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr

            def settled() -> bool:
                p = job_progress(client, settings.keys, job)
                return p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]

            wait_until(settled, 180, what="every step of the agentic job")
        finally:
            for w in (w1, w2):
                w.terminate()
    yield AgenticJob(settings, client, job, data, tok_dir, content, fp_dir)
    client.close()


def _records(run: AgenticJob) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.turn_answers(run.job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def test_every_step_is_stored_once_byte_exact_with_the_datasets_results(agentic_job: AgenticJob) -> None:
    run = agentic_job
    assert (run.fp_dir / "failpoint-after_part_write-0").exists(), "a worker was killed between write and finalize"
    assert dead_letters(run.client, run.settings.keys, run.job) == {}
    assert raw_duplicates(run.settings.output_uri, run.job).num_rows == 0, "no step stored twice"
    record = JobRecord.load(run.client, run.settings.keys, run.job)
    assert record is not None
    tok = load_tokenizer(str(run.tok_dir))
    rows = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, run.job).to_pylist()}
    answers = _records(run)
    source = [json.loads(line) for line in run.data.read_text().splitlines()]
    walked: set[str] = set()
    steps_after_results = args_differ = 0
    for c, conv_row in enumerate(source):
        conv_id = f"chat/c{c}"
        conv = plan_agentic(conv_row["messages"])
        assert conv is not None
        history: list[dict[str, Any]] = []
        pid = turn_id(conv_id, 0)
        while pid:
            walked.add(pid)
            row, answer = rows[pid], answers[pid]
            _, turn, step = split_step_id(pid) or ("", -1, -1)
            assert (row["conversation_id"], row["turn_index"], row["step_index"]) == (conv_id, turn, step)
            # The prompt: the template's rendering of the conversation up to this step.
            want = render_ids(tok, for_render(step_messages(conv, history)), None, record.chat_template_kwargs)
            assert row["input_ids"] == want, f"{pid}'s prompt is not the template's rendering"
            assert (
                row["output_ids"]
                == expected_generation(row["input_ids"], record.sampling_params, run.content).output_ids
            )
            calls = answer_message(answer).get("tool_calls") or []
            if answer.get("tool_results"):
                # The dataset's results of this step, by position, answering the model's own call ids.
                recorded = conv["steps"][turn][step]["results"]
                fed = answer["tool_results"]
                assert [m["content"] for m in fed] == [m["content"] for m in recorded[: len(calls)]]
                assert [m["tool_call_id"] for m in fed] == [call["id"] for call in calls]
                assert all(m["source"] == "recorded" for m in fed)
                assert row["tool_args_differ"] == answer["args_differ"]
                args_differ += bool(answer["args_differ"])
                steps_after_results += 1
            history.append(answer)
            pid = answer.get("next", "")
    assert walked == set(rows), "every stored row is a step of some chain, and every step of a chain is stored"
    assert steps_after_results >= 2, "some turns went on through their tool results"
    assert args_differ >= 1, "the simulator's own arguments differ from the dataset's somewhere"
    assert any(r["step_index"] >= 1 for r in rows.values()), "rows …/t{i}s{j} of steps after results"


def test_verify_passes_and_the_messages_export_carries_the_fed_tool_messages(
    agentic_job: AgenticJob, tmp_path: Path
) -> None:
    from storage.exports import export_job

    run = agentic_job
    verified = producer_cli(run.settings, "verify", run.job, "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    out = tmp_path / "m.jsonl"
    export_job(run.settings, run.job, "messages", str(out), tokenizer=str(run.tok_dir))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    answers = _records(run)
    assert set(records) == set(answers)
    for answer in answers.values():
        if not answer.get("next"):
            continue
        following = records[answer["next"]]["messages"]
        # The record of the step after this one: its history ends with this answer and what was fed back.
        fed = answer.get("tool_results") or []
        if fed:
            assert following[-1 - len(fed) : -1] == fed
            assert following[-2 - len(fed)]["tool_calls"] == answer["tool_calls"]


def test_merge_turns_gives_one_sample_per_conversation_over_model_emitted_ids_only(
    agentic_job: AgenticJob, tmp_path: Path
) -> None:
    from storage.exports import export_job

    run = agentic_job
    rows = read_committed(run.settings.output_uri, run.job).to_pylist()
    per_step = tmp_path / "steps.jsonl"
    export_job(run.settings, run.job, "specforge", str(per_step))
    assert sum(1 for _ in per_step.read_text().splitlines()) == len(rows), "one sample per step"
    merged_out = tmp_path / "merged.jsonl"
    export_job(run.settings, run.job, "specforge", str(merged_out), merge_turns=True)
    merged = {r["id"]: r for r in map(json.loads, merged_out.read_text().splitlines())}
    assert set(merged) == {r["conversation_id"] for r in rows}
    outputs: dict[str, list[list[int]]] = {}
    for r in rows:
        outputs.setdefault(r["conversation_id"], []).append(r["output_ids"])
    for conv_id, rec in merged.items():
        last = max(
            (r for r in rows if r["conversation_id"] == conv_id), key=lambda r: (r["turn_index"], r["step_index"])
        )
        assert rec["input_ids"] == last["input_ids"] + last["output_ids"], "the conversation's last step"
        # Loss over the last step's output and the earlier steps' ids found verbatim in the prompt: never more ids
        # than the model's steps emitted in all (the fed results and the dataset's text are no step's output).
        trained = sum(rec["loss_mask"])
        assert len(last["output_ids"]) <= trained <= sum(len(o) for o in outputs[conv_id])
