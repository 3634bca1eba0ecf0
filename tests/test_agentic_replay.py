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
verify`` passes and the ``messages`` export carries the ``tool`` messages fed back, marked ``recorded``. After
``producer retry --truncated`` re-derives later steps, the old chains' steps the new ones do not reach are stale:
verify lists them as superseded and the exports leave them out (storage/verify_steps.py).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from producer.render import load_tokenizer, render_ids
from sglang_sim.content import ContentConfig, expected_generation
from sglang_sim.tools import write_catalogue
from storage.reader import raw_duplicates, read_committed
from storage.verify_steps import chains, stale_steps
from testing.datasets import agentic_rows, tool_call, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.settings import Settings
from thinkfleet.state.job import JobRecord
from thinkfleet.tool_steps import for_render, plan_agentic, replay_results, step_messages
from thinkfleet.turns import answer_message, beyond_chain_ends, split_step_id, turn_id
from workers.tool_exec import TRUSTED_ENV

if TYPE_CHECKING:
    from testing.services import RedisServer

CONVERSATIONS = 4
TURNS = 2


def _call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return tool_call(i, name, args)


def _agentic_rows() -> list[dict[str, Any]]:
    return agentic_rows(CONVERSATIONS, TURNS)


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


def test_a_stale_step_is_one_no_chain_reaches_from_t0_along_next() -> None:
    # Given: a turn that went t0 → t0s1 → t0s2 → t1, then t0s1 re-run (revision 1) answered without a call, so its
    # chain went on to t1 (re-derived); t1's old chain had gone on to t1s1, its new answer ends the conversation.
    convs = {"chat/c0": {}, "chat/c1": {}}
    answers: dict[str, dict[str, Any]] = {
        "chat/c0/t0": {"next": "chat/c0/t0s1"},
        "chat/c0/t0s1": {"next": "chat/c0/t1", "revision": 1},
        "chat/c0/t0s2": {"next": "chat/c0/t1"},
        "chat/c0/t1": {"revision": 1},
        "chat/c0/t1s1": {},
        "chat/c1/t0": {"next": "chat/c1/t0s1"},  # c1: its next step enqueued, not yet answered
    }
    stored = [*answers, "chat/c1/t0s1", "other/p1"]
    # Then: the steps the walk from t0 does not reach are stale — none of them past a chain end (there is none), so
    # beyond_chain_ends alone would call them current; an enqueued step, and a prompt of no conversation, are not.
    assert stale_steps(convs, answers, stored) == {"chat/c0/t0s2", "chat/c0/t1s1"}
    assert beyond_chain_ends(stored, []) == set()
    assert chains(convs, answers) == {
        "chat/c0": ["chat/c0/t0", "chat/c0/t0s1", "chat/c0/t1"],
        "chat/c1": ["chat/c1/t0", "chat/c1/t0s1"],
    }


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
EXAMPLE = Path(__file__).parents[1] / "docs/examples/agentic/tools.py"
#: The example executor, logging every call id it is called with (the test counts calls per step revision).
LOGGING_EXECUTOR = f"""
import importlib.util, json
_spec = importlib.util.spec_from_file_location("example_tools", {str(EXAMPLE)!r})
_tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tools)

def execute(request):
    with open(__file__ + ".calls", "a") as f:
        f.write("".join(call["id"] + "\\n" for call in request["calls"]))
    return _tools.execute(request)
"""


@dataclass
class AgenticJob:
    settings: Settings
    client: redis.Redis
    job: str
    data: Path
    tok_dir: Path
    content: ContentConfig
    fp_dir: Path
    executor_job: str
    executor_log: Path


SHORT_JOB = "agentic-short"
SIM_CONTENT = {"tool_call_share": 0.6, "length_median_tokens": 60.0, "max_tool_calls": 2}


@pytest.fixture(scope="module")
def agentic_job(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgenticJob]:
    """Two agentic jobs on one fleet: ``agentic`` (replay, keep_recorded) and ``agentic-exec`` (the logging example
    executor). Three workers are SIGKILLed: between a part write and its finalize, after an executor's results are
    recorded and before the step's part is written, after an executor answered and before its results are recorded;
    w2, started once they died, finishes."""
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
    executor = tmp_path / "logging_tools.py"
    executor.write_text(LOGGING_EXECUTOR)
    spec = f"{executor}:execute"
    job, exec_job = "agentic", "agentic-exec"
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "400"]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    with simulator(tmp_path / "logs", *sim_args) as sim:
        env = {**fast_env(settings, sim, max_inflight=4, lease_s=3, reaper_interval_s=0.5), TRUSTED_ENV: spec}
        env.pop(failpoints.TIMES_ENV, None)

        def armed(point: str) -> dict[str, str]:
            return {**env, failpoints.ENV: f"{point}=kill", failpoints.DIR_ENV: str(fp_dir)}

        points = ("after_part_write", "after_tool_record", "after_tool_call")
        workers = [WorkerProcess(f"w-{point}", armed(point), tmp_path / "logs").start() for point in points]
        try:
            common = [
                "--tokenizer", str(tok_dir), "--processes", "1", "--no-progress", "--max-new-tokens", "400",
                "--seed", "3", "--context-length", "131072", "--turns", "all", "--max-tool-steps", "3", "--json",
            ]  # fmt: skip
            submits = (
                (job, ["--tool-results", "replay", "--tool-mismatch", "keep_recorded"]),
                (exec_job, ["--tool-results", "executor", "--tool-executor", spec]),
                # A budget this small truncates most steps (the retry test re-runs them).
                (SHORT_JOB, ["--tool-results", "replay", "--tool-mismatch", "keep_recorded", "--max-new-tokens", "40"]),
            )
            # The three submits run at once, while the workers start (each job's prompts wait in Redis for them):
            # one after the other they were most of this fixture's time.
            with ThreadPoolExecutor(len(submits)) as pool:
                running = [
                    pool.submit(producer_cli, settings, "submit", str(data), "--job", name, *common, *tools)
                    for name, tools in submits
                ]
                for w in workers:
                    w.wait_ready(client, settings.keys)
                for submitted in (r.result() for r in running):
                    assert submitted.returncode == 0, submitted.stderr

            def settled() -> bool:
                for name in (job, exec_job, SHORT_JOB):
                    p = job_progress(client, settings.keys, name)
                    if not (p["done"] > 0 and p["done"] + p["dead"] == p["submitted"]):
                        return False
                return True

            # The armed workers alone until each has died at its point (or the jobs are done): which worker a step
            # reaches then decides nothing. Then the survivor finishes.
            def fired() -> bool:
                return all((fp_dir / f"failpoint-{point}-0").exists() for point in points) or settled()

            wait_until(fired, 240, what="the armed workers' failpoints")
            workers.append(WorkerProcess("w2", env, tmp_path / "logs").start())
            wait_until(settled, 240, what="every step of the agentic jobs")
            # The survivor and the simulator stay up for the module's tests (the retry test runs steps again).
            yield AgenticJob(settings, client, job, data, tok_dir, content, fp_dir, exec_job, Path(f"{executor}.calls"))
        finally:
            for w in workers:
                w.terminate()
    client.close()


def _conversations(run: AgenticJob, job: str) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.conversations(job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _records(run: AgenticJob, job: str | None = None) -> dict[str, dict[str, Any]]:
    raw = run.client.hgetall(run.settings.keys.turn_answers(job or run.job))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _check_chains(
    run: AgenticJob, job: str, superseded: Sequence[str] = ()
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, dict[str, Any], Any]]]:
    """Every stored row of ``job`` is one step of a conversation's chain (the walk from t0 along ``next``), stored
    once, byte-exact, its prompt the template's rendering of the conversation up to it; returns the rows and, per
    step that fed results back, (its prompt id, its answer record, its conversation plan)."""
    assert dead_letters(run.client, run.settings.keys, job) == {}
    assert raw_duplicates(run.settings.output_uri, job).num_rows == 0, "no step stored twice"
    record = JobRecord.load(run.client, run.settings.keys, job)
    assert record is not None
    tok = load_tokenizer(str(run.tok_dir))
    rows = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, job).to_pylist()}
    answers = _records(run, job)
    source = [json.loads(line) for line in run.data.read_text().splitlines()]
    walked: set[str] = set()
    fed_steps = []
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
            want = render_ids(tok, for_render(step_messages(conv, history)), None, record.chat_template_kwargs)
            assert row["input_ids"] == want, f"{pid}'s prompt is not the template's rendering"
            expected = expected_generation(row["input_ids"], json.loads(row["sampling_params"]), run.content)
            assert row["output_ids"] == expected.output_ids
            if answer.get("tool_results"):
                calls = answer_message(answer)["tool_calls"]
                assert [m["tool_call_id"] for m in answer["tool_results"]] == [call["id"] for call in calls]
                fed_steps.append((pid, answer, conv))
            history.append(answer)
            pid = answer.get("next", "")
    # Every step of a chain is stored, and every stored row is a step of some chain — or superseded: past where a
    # re-run ended the chain (producer verify lists them).
    assert walked <= set(rows)
    assert set(rows) - walked <= set(superseded), "a stored row on no chain is superseded (no longer current)"
    return rows, fed_steps


def test_every_step_is_stored_once_byte_exact_with_the_datasets_results(agentic_job: AgenticJob) -> None:
    run = agentic_job
    assert (run.fp_dir / "failpoint-after_part_write-0").exists(), "a worker was killed between write and finalize"
    rows, fed_steps = _check_chains(run, run.job)
    assert any(r["step_index"] >= 1 for r in rows.values()), "rows …/t{i}s{j} of steps after results"
    args_differ = 0
    for pid, answer, conv in fed_steps:
        _, turn, step = split_step_id(pid) or ("", -1, -1)
        fed = answer["tool_results"]
        recorded = conv["steps"][turn][step]["results"]
        assert [m["content"] for m in fed] == [m["content"] for m in recorded[: len(fed)]]
        assert all(m["source"] == "recorded" for m in fed)
        args_differ += bool(answer["args_differ"])
    assert len(fed_steps) >= 2, "some turns went on through their tool results"
    assert args_differ >= 1, "the simulator's own arguments differ from the dataset's somewhere"
    assert all(
        r["tool_args_differ"] is not None for r in rows.values() if _records(run)[r["prompt_id"]].get("tool_results")
    )


def test_executor_results_feed_the_next_step_and_it_runs_at_most_once_per_step_revision(
    agentic_job: AgenticJob,
) -> None:
    run = agentic_job
    assert (run.fp_dir / "failpoint-after_tool_record-0").exists(), "a worker was killed after recording results"
    _, fed_steps = _check_chains(run, run.executor_job)
    assert fed_steps, "some steps went on with the executor's results"
    spec = importlib.util.spec_from_file_location("example_tools", EXAMPLE)
    assert spec is not None and spec.loader is not None
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    for _pid, answer, _conv in fed_steps:
        calls = answer_message(answer)["tool_calls"]
        want = tools.execute({"calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                        for c in calls]})  # fmt: skip
        assert [m["content"] for m in answer["tool_results"]] == want
        assert all(m["source"] == "executed" for m in answer["tool_results"])
    # At most once per (conversation, step, revision): no stable call id twice, though a worker died after one.
    ids = run.executor_log.read_text().split()
    assert len(ids) == len(set(ids)) and ids
    ended = [a for a in _records(run, run.executor_job).values() if a.get("chain_end") == "tool_error"]
    # The worker killed between the call and its record left a pending mark: that step is not called again, its
    # chain ends with tool_error (at most once, rather than maybe twice).
    assert (run.fp_dir / "failpoint-after_tool_call-0").exists()
    assert any("no recorded outcome" in a.get("tool_error", "") for a in ended)
    counters = run.client.hgetall(run.settings.keys.counters(run.executor_job))
    assert int(counters.get(b"chains_ended:tool_error", 0)) == len(ended)
    # producer status shows them, and every conversation is settled: complete, or ended with its reason.
    status = producer_cli(run.settings, "status", run.executor_job, "--deep", "--json", in_process=True)
    assert status.returncode == 0, status.stderr
    convs = json.loads(status.stdout)["conversations"]
    assert convs["tool_errors"] == len(ended)
    assert convs["complete"] + convs["chain_ended"] == convs["total"] == CONVERSATIONS and convs["in_progress"] == 0


def test_verify_passes_and_the_messages_export_carries_the_fed_tool_messages(
    agentic_job: AgenticJob, tmp_path: Path
) -> None:
    from storage.exports import export_job
    from storage.verify import verify_job

    run = agentic_job
    verified = producer_cli(run.settings, "verify", run.job, "--json", in_process=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert json.loads(verified.stdout)["step_prompt_mismatch"] == []
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
    # A step rendered from another history (here: a fed result changed since) is named by verify.
    key = run.settings.keys.turn_answers(run.job)
    pid, answer = next((p, a) for p, a in answers.items() if a.get("tool_results") and a.get("next"))
    changed = {**answer, "tool_results": [{**m, "content": "changed"} for m in answer["tool_results"]]}
    run.client.hset(key, pid, json.dumps(changed))
    try:  # in this process (the CLI's path and exit code are proven above): the same verify_job
        report = verify_job(run.settings, run.job)
        assert not report.ok and answer["next"] in report.step_prompt_mismatch
    finally:
        run.client.hset(key, pid, json.dumps(answer))


def test_a_step_no_chain_reaches_is_superseded_by_verify_and_left_out_of_every_export(
    agentic_job: AgenticJob, tmp_path: Path
) -> None:
    from producer.retry import _chain_heads
    from storage.exports import export_job
    from storage.verify import verify_job

    run = agentic_job
    answers = _records(run)
    rows = {r["prompt_id"] for r in read_committed(run.settings.output_uri, run.job).to_pylist()}
    # Given: a conversation whose last turn went on through a tool call to its final step X — and then the answer
    # record of the step before X as a re-run of it (producer retry) could leave it: no call, the conversation
    # complete there. X's row stays stored, on no chain; past no chain end (nothing ended the chain early).
    last_steps = [
        chain[-2:]
        for chain in chains(_conversations(run, run.job), answers).values()
        if len(chain) >= 2 and (split_step_id(chain[-1]) or ("", 0, 0))[2] >= 1
    ]
    assert last_steps, "some conversation's last turn ends in a step after tool results"
    before, last = last_steps[0]
    assert split_step_id(before)[1] == split_step_id(last)[1]  # type: ignore[index]
    key, done = run.settings.keys.turn_answers(run.job), run.settings.keys.done(run.job)
    record = answers[before]
    rerun = {k: v for k, v in record.items() if k not in ("next", "tool_calls", "tool_results", "args_differ")}
    run.client.hset(key, before, json.dumps(rerun))
    run.client.srem(done, last)  # as the re-run's finalize takes the steps it no longer derives out of done
    try:
        assert beyond_chain_ends(rows, [p for p, a in _records(run).items() if a.get("chain_end")]) == set()
        # Then: verify lists X as superseded and passes; every export gives the current chains' steps only.
        report = verify_job(run.settings, run.job)
        assert report.ok and last in report.superseded, report.superseded
        for fmt in ("specforge", "messages"):
            out = tmp_path / f"{fmt}.jsonl"
            export_job(run.settings, run.job, fmt, str(out), tokenizer=str(run.tok_dir))
            assert {r["id"] for r in map(json.loads, out.read_text().splitlines())} == rows - {last}, fmt
        # And: a later `producer retry --truncated` takes no stale row as a chain's head, and a conversation whose
        # only prompt out of done is stale is settled (not "still running").
        first = turn_id(split_step_id(last)[0], 0)  # type: ignore[index]
        chosen, skipped = _chain_heads(run.client, run.settings, run.job, [{"prompt_id": last}, {"prompt_id": first}])
        assert [r["prompt_id"] for r in chosen] == [first] and skipped == {}
    finally:
        run.client.hset(key, before, json.dumps(record))
        run.client.sadd(done, last)


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


def test_retry_truncated_of_a_step_rederives_the_steps_after_it(agentic_job: AgenticJob, tmp_path: Path) -> None:
    from storage.exports import export_job

    run = agentic_job
    before = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, SHORT_JOB).to_pylist()}
    assert any(r["finish_reason"] == "length" for r in before.values()), "a budget of 40 truncates"
    # When the truncated steps are re-run with a large budget (the earliest of each conversation).
    retry = producer_cli(run.settings, "retry", SHORT_JOB, "--truncated", "--max-new-tokens", "4000", "--json")
    assert retry.returncode == 0, retry.stderr
    rerun = json.loads(retry.stdout)["prompt_ids"]
    assert rerun and len({split_step_id(p)[0] for p in rerun}) == len(rerun)  # type: ignore[index]

    done_key = run.settings.keys.done(SHORT_JOB)

    def settled() -> bool:
        # Every conversation's current chain (the walk from t0 along next) is done to its end, the re-runs stored.
        answers = _records(run, SHORT_JOB)
        for c in range(CONVERSATIONS):
            at = turn_id(f"chat/c{c}", 0)
            while at:
                if not run.client.sismember(done_key, at) or at not in answers:
                    return False
                at = answers[at].get("next", "")
        rows = {r["prompt_id"]: r for r in read_committed(run.settings.output_uri, SHORT_JOB).to_pylist()}
        return all(rows[pid]["revision"] >= 1 for pid in rerun)

    wait_until(settled, 180, what="the re-run steps and the steps re-derived after them")
    verified = producer_cli(run.settings, "verify", SHORT_JOB, "--json", in_process=True)
    report = json.loads(verified.stdout)
    assert verified.returncode == 0 and report["step_prompt_mismatch"] == [], verified.stdout
    # Then each conversation is one chain again, re-derived from the new answers: every step after a re-run one is
    # a revision above its old row (or new), byte-exact with the re-run's budget carried along.
    # Steps the old chains took and the new ones do not are out of done (their rows are no longer current).
    off_chain = [p.decode() for p in run.client.hkeys(run.settings.keys.prompts(SHORT_JOB))]
    off_chain = [p for p in off_chain if not run.client.sismember(done_key, p)]
    rows, _ = _check_chains(run, SHORT_JOB, [*report["superseded"], *off_chain])
    answers = _records(run, SHORT_JOB)
    # The old chains' steps the new ones do not reach are stale: verify lists them as superseded (and passes), and
    # the exports leave their rows out — every format gives exactly the current chains' steps.
    current = {p for chain in chains(_conversations(run, SHORT_JOB), answers).values() for p in chain}
    stale = set(rows) - current
    assert stale, "the re-derived chains left steps of the old ones behind"
    assert stale <= set(report["superseded"])
    for fmt in ("specforge", "messages"):
        out = tmp_path / f"{fmt}.jsonl"
        export_job(run.settings, SHORT_JOB, fmt, str(out), tokenizer=str(run.tok_dir))
        assert {r["id"] for r in map(json.loads, out.read_text().splitlines())} == set(rows) - stale, fmt
    for pid in rerun:
        assert json.loads(rows[pid]["sampling_params"])["max_new_tokens"] == 4000
        at = answers[pid].get("next", "")
        while at:
            if at in before:
                assert rows[at]["revision"] > before[at]["revision"], f"{at} was not re-derived"
            assert json.loads(rows[at]["sampling_params"])["max_new_tokens"] == 4000
            at = answers[at].get("next", "")
