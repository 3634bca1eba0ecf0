"""An error ends only what caused it (issue 43, fault 3): a poison row ends itself, never its worker's commits.

- A ``--turns all`` job whose chat template allows a system message only first, one conversation of which has a
  system message after its first answer: its turn 1 cannot be rendered. That chain ends ``render_error: …``,
  every other turn is stored, the worker keeps consuming, ``wait`` 0 and ``verify`` OK (before: the commit group
  was retried forever and six prompts stayed "running").
- The same for an agentic job whose executor returns a value JSON cannot hold for one conversation: that chain ends
  ``tool_error`` with the reason, the executor is called once for it.
- The committer itself (unit level): an unknown error in one row's hook gets :data:`UNKNOWN_ERROR_ATTEMPTS` tries,
  then that row alone is dead-lettered with the error's last line while its group's others commit; a data error
  ends its row at once; an I/O error is retried behind the storage gate and ends nothing.
- A stall is seen: a worker whose storage refuses every commit while it holds prompts is shown **stalled** with its
  reason by ``producer status --json``, and not once its commits succeed again.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest
import redis

from storage.reader import raw_duplicates, read_committed
from storage.writer import PartWriter
from testing.datasets import conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, exchange_paths, job_progress, wait_until
from testing.harness import STEADY_LEASE, fast_env, isolated_settings, make_prompts, producer_cli, simulator, submit_ids
from testing.record import Outcome, check_job, record_result
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.state.ledger import Finalized
from workers.commit_faults import UNKNOWN_ERROR_ATTEMPTS
from workers.committer import GroupCommitter, RowFailed
from workers.hooks import CommitGroup, FinalizeWrites, PostCommitHook, PostCommitHooks
from workers.rows import JobFinalRow


@pytest.fixture(scope="module")
def plain_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One simulator for the scenarios that need no special one (its answers depend only on the prompt; each
    scenario has its own Redis DB, worker and output; none stops the server)."""
    with simulator(tmp_path_factory.mktemp("sim"), "--time-scale", "400") as url:
        yield url


def cli(settings: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``producer`` command in this process (click's runner): none of these scenarios is about the producer's
    process, and a new interpreter costs ≈ 1.5-4 CPU-s on the 2-core CI box, and the stall scenario polls status."""
    return producer_cli(settings, *args, in_process=True)


#: A chat template rule many real templates have: a system message only at the start.
SYSTEM_FIRST = (
    "{%- for m in messages -%}{%- if m['role'] == 'system' and not loop.first -%}"
    "{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}{%- endfor -%}"
)


# -- the committer, unit level ---------------------------------------------------------------------------------
class _Ledger:
    """The claim ledger's answers for rows nobody else holds (the fence and the Lua scripts are not under test)."""

    def fence(self, job: str, prompt_id: str) -> None:
        return None

    async def mark_part(self, *args: Any) -> dict[str, str]:
        return {}

    async def finalize(self, job: str, dataset: str, rows: list[Any], *args: Any, **kwargs: Any) -> Finalized:
        return Finalized(len(rows), False, 0, 0, {})


class _PoisonHook(PostCommitHook):
    """Raises ``error`` for any group holding ``poison`` (``times`` times at most; None: always)."""

    name = "poison"

    def __init__(self, poison: str, error: Exception, times: int | None = None) -> None:
        self.poison, self.error, self.times = poison, error, times
        self.raised = 0

    async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
        if any(r["prompt_id"] == self.poison for r in group.rows) and (self.times is None or self.raised < self.times):
            self.raised += 1
            raise self.error
        return None


def _commit_four(tmp_path: Path, hook: _PoisonHook) -> tuple[dict[str, Any], list[bool], list[str]]:
    """Four rows of one group through a real committer and PartWriter: prompt id → its part or its exception; the
    storage verdicts the committer gave; the prompt ids stored in the parts."""
    verdicts: list[bool] = []
    writer = PartWriter(str(tmp_path / "out"), "w1")

    async def run() -> dict[str, Any]:
        committer = GroupCommitter(
            writer, _Ledger(), 64, 0.05, 1000, 1.0, lambda *a: None,  # type: ignore[arg-type]
            on_storage=lambda ok, exc: verdicts.append(ok), retry_max_s=0.2, hooks=PostCommitHooks([hook]),
        )  # fmt: skip
        committer.start()
        pids = [f"p-{i}" for i in range(4)]
        rows = [make_row(pid, job="job", dataset="ds", seed=i) for i, pid in enumerate(pids)]
        commits = [committer.commit("job", "ds", row, JobFinalRow(row["prompt_id"], 30, True, False)) for row in rows]
        results = await asyncio.wait_for(asyncio.gather(*commits, return_exceptions=True), 60)
        assert committer.progress().waiting == 0, "nothing is left waiting in the committer"
        return dict(zip(pids, results, strict=True))

    outcome = asyncio.run(run())
    stored = pads.dataset(str(tmp_path / "out"), format="parquet").to_table(columns=["prompt_id"])
    return outcome, verdicts, sorted(stored.column("prompt_id").to_pylist())


def test_an_unknown_hook_error_gets_bounded_tries_then_only_its_row_is_dead_lettered(tmp_path: Path) -> None:
    # Given a hook that always raises an error of no known kind for one row of a group of four.
    hook = _PoisonHook("p-2", RuntimeError("the feature store answered nonsense\nlast line: shard 7 refused"))
    # When the group is committed.
    outcome, verdicts, stored = _commit_four(tmp_path, hook)
    # Then that row alone ends, with the error's last line, after a bounded number of tries; the others are stored.
    failed = outcome["p-2"]
    assert isinstance(failed, RowFailed) and failed.error_class == "commit_hook", outcome
    assert failed.reason == "RuntimeError: last line: shard 7 refused"
    assert hook.raised == UNKNOWN_ERROR_ATTEMPTS + 1, "the group's tries, then the row's own one"
    assert stored == ["p-0", "p-1", "p-3"]
    assert all(isinstance(outcome[p], str) for p in ("p-0", "p-1", "p-3")), outcome
    # And the storage gate never closed for it: a row's error is not storage's.
    assert False not in verdicts


def test_a_data_error_in_a_hook_ends_its_row_at_once(tmp_path: Path) -> None:
    hook = _PoisonHook("p-1", TypeError("Object of type set is not JSON serializable"))
    outcome, verdicts, stored = _commit_four(tmp_path, hook)
    assert isinstance(outcome["p-1"], RowFailed) and "TypeError" in outcome["p-1"].reason
    assert hook.raised == 2, "the group's one try, then the row's own one: a data error is not retried"
    assert stored == ["p-0", "p-2", "p-3"] and False not in verdicts


def test_an_io_error_in_a_hook_is_retried_behind_the_storage_gate_and_ends_nothing(tmp_path: Path) -> None:
    hook = _PoisonHook("p-3", ConnectionError("Redis went away"), times=2)
    outcome, verdicts, stored = _commit_four(tmp_path, hook)
    assert stored == ["p-0", "p-1", "p-2", "p-3"] and all(isinstance(v, str) for v in outcome.values()), outcome
    assert verdicts.count(False) == 2 and verdicts[-1] is True, "the gate closed at each failure, opened again"


# -- a --turns all job with one conversation its template refuses ----------------------------------------------
def _strict_tokenizer() -> Path:
    """The Kimi test tokenizer with :data:`SYSTEM_FIRST` in front of its chat template, beside it (inside the test
    workers' tokenizer roots); built once per content, atomically (other tests may build it at the same moment)."""
    base = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    target = base.parent / f"{base.name}-system-first"
    if (target / "chat_template.jinja").exists():
        return target
    staging = base.parent / f".{target.name}-{uuid.uuid4().hex[:8]}"
    shutil.copytree(base, staging)
    template = staging / "chat_template.jinja"
    template.write_text(SYSTEM_FIRST + template.read_text())
    try:
        staging.rename(target)
    except OSError:  # another test built it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _poison_conversation() -> dict[str, Any]:
    """User, assistant, **system**, user, assistant: turn 0 renders, turn 1's history has a system message second."""
    return {
        "id": "late-system",
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "system", "content": "From now on answer in German."},
            {"role": "user", "content": "And of Germany?"},
            {"role": "assistant", "content": "Berlin."},
        ],
    }


def _wait_verify_status(settings: Any, job: str) -> tuple[Any, Any, dict[str, Any]]:
    waited = cli(settings, "wait", job, "--timeout", "180", "--json")
    verified = cli(settings, "verify", job, "--json")
    status = cli(settings, "status", job, "--json")
    assert status.returncode == 0, status.stderr
    return waited, verified, json.loads(status.stdout)


def test_a_conversation_the_template_refuses_ends_its_chain_and_the_worker_keeps_consuming(
    redis_url: str, tmp_path: Path, plain_sim: str
) -> None:
    # Given 30 ordinary two-turn conversations and one with a system message after its first answer, submitted
    # with --turns all and a template that allows a system message only first.
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job, conversations, turns = "late-system", 30, 2
    tok = _strict_tokenizer()
    rows = [*conversation_rows(conversations, turns, 10, "You are a careful assistant.", reasoning="x")]
    rows.insert(7, _poison_conversation())  # among the others: its turn shares commit groups with theirs
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    started = time.monotonic()
    worker = WorkerProcess(
        "w1", fast_env(settings, plain_sim, max_inflight=8, **STEADY_LEASE), tmp_path / "logs"
    ).start()
    try:
        worker.wait_ready(client, settings.keys)
        submitted = cli(
            settings, "submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1",
            "--no-progress", "--max-new-tokens", "200", "--seed", "3", "--context-length", "131072",
            "--turns", "all", "--json",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        # When the job runs: then it finishes, and verify passes.
        waited, verified, st = _wait_verify_status(settings, job)
        # And the worker still consumes: a job submitted after it is stored too.
        after = cli(
            settings, "submit", str(write_jsonl(tmp_path / "after.jsonl", rows[:3])), "--job", "after",
            "--tokenizer", str(tok), "--processes", "1", "--no-progress", "--max-new-tokens", "50",
            "--context-length", "131072", "--json",
        )  # fmt: skip
        assert after.returncode == 0, after.stderr
        wait_until(lambda: job_progress(client, settings.keys, "after")["done"] == 3, 120, what="a later job")
        assert worker.alive()
    finally:
        worker.terminate()
    log = worker.log_path.read_text()
    stored = {r["prompt_id"]: r for r in read_committed(settings.output_uri, job).to_pylist()}
    answers = {k.decode(): json.loads(v) for k, v in client.hgetall(settings.keys.turn_answers(job)).items()}
    # Every turn 0, and every turn 1 whose turn 0 goes on (the simulator's answer may call a tool: that chain ends
    # there, ``tool_call``, as any plain --turns all chain does).
    ended = {c for c in range(conversations) if answers.get(f"chat/c{c}/t0", {}).get("chain_end")}
    want = {f"chat/c{c}/t0" for c in range(conversations)} | {"chat/late-system/t0"}
    want |= {f"chat/c{c}/t1" for c in range(conversations) if c not in ended}
    duplicated = raw_duplicates(settings.output_uri, job).column("prompt_id").to_pylist()
    problems = []
    if "stopped consuming" in log:
        problems.append("the worker stopped consuming (a commit failed)")
    end = str(answers.get("chat/late-system/t0", {}).get("chain_end") or "")
    if not (end.startswith("render_error: ") and "System message must be at the beginning" in end):
        problems.append(f"the refused conversation's chain end is {end!r}")
    outcome = Outcome(
        len(want), len(set(stored) & want), 0, sorted(want - set(stored)), duplicated, [],
        verified.returncode == 0, waited.returncode == 0, problems,
    )  # fmt: skip
    record_result(
        "a --turns all conversation the chat template refuses (system message after the first answer)",
        outcome,
        "31 conversations; one's turn 1 raises TemplateError in the worker's commit group",
        [],
        time.monotonic() - started,
        notes="its chain ends `render_error: …`; every other turn stored; the worker keeps consuming",
    )
    # Then that chain ends with its reason, in the row and in Redis; every other turn is stored once.
    assert (waited.returncode, verified.returncode) == (0, 0), (waited.stdout, verified.stdout)
    outcome.assert_clean()
    assert stored["chat/late-system/t0"]["chain_end"] == end
    others = {answers[f"chat/c{c}/t0"]["chain_end"] for c in ended}
    assert others <= {"tool_call"}, others
    want_ends = {"render_error": 1, **({"tool_call": len(ended)} if ended else {})}
    assert st["conversations"]["ends"] == want_ends and st["conversations"]["complete"] == conversations - len(ended)
    assert dead_letters(client, settings.keys, job) == {}
    assert "chat/late-system/t1" not in stored


# -- a stall is seen ---------------------------------------------------------------------------------------------
def _status(settings: Any, job: str) -> dict[str, Any]:
    shown = cli(settings, "status", job, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_a_worker_whose_commits_fail_while_it_holds_work_is_shown_stalled_with_its_reason(
    redis_url: str, tmp_path: Path, plain_sim: str
) -> None:
    # Given a worker running a job, whose output stops accepting writes (a file where the dataset directory was).
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    started = time.monotonic()
    env = fast_env(settings, plain_sim, max_inflight=4, storage_retry_max_s=1, **STEADY_LEASE)
    worker = WorkerProcess("w1", env, tmp_path).start()
    try:
        worker.wait_ready(client, keys)
        job = submit_ids(settings, "stall", make_prompts(60))
        wait_until(lambda: job_progress(client, keys, "stall")["done"] >= 5, 120, what="5 rows stored")
        dataset_dir = Path(settings.output_uri) / "stall" / "dataset=synthetic"
        aside = tmp_path / "aside"
        aside.write_text("blocked")
        exchange_paths(aside, dataset_dir)
        # When it holds rows it cannot commit: then status shows it stalled, naming the storage error.
        stalled: list[dict[str, Any]] = []

        def shown_stalled() -> bool:
            stalled[:] = _status(settings, "stall").get("stalled_workers") or []
            return bool(stalled)

        wait_until(shown_stalled, 120, what="the worker shown stalled")
        text = cli(settings, "status", "stall")
        # And once storage takes writes again, the stall is gone and the job finishes clean.
        exchange_paths(aside, dataset_dir)
        aside.unlink()
        wait_until(lambda: not _status(settings, "stall").get("stalled_workers"), 120, what="the stall cleared")
        waited = cli(settings, "wait", "stall", "--timeout", "180", "--json")
        assert worker.alive()
    finally:
        worker.terminate()
    outcome = check_job(settings, "stall", job.prompts, job.sampling_params)
    record_result(
        "a worker whose commits fail while it holds work is shown stalled by `producer status`",
        outcome,
        "the output's dataset directory replaced by a file until status shows the stall",
        [],
        time.monotonic() - started,
        notes="`status --json` stalled_workers names the storage error; cleared once commits succeed",
    )
    (w,) = stalled
    assert w["worker"] == "w1" and w["reason"].startswith("commit failing at storage"), w
    assert (w["held"] or 0) > 0 and (w["commit_waiting"] or 0) > 0, w
    assert w["gate"]["storage"].startswith("failing: "), w
    shown = " ".join(text.stdout.split())  # rich wraps the text view at the terminal's width
    assert "w1 (host" in shown and "STALLED: commit failing at storage" in shown, text.stdout
    assert waited.returncode == 0, waited.stdout
    outcome.assert_clean()


# -- an executor result JSON cannot hold ---------------------------------------------------------------------------
#: An executor that answers every call with text, except those of the first conversation it is called for (which one
#: depends on the simulator's sampling): a set, which JSON cannot hold. It notes each call beside itself.
POISON_EXECUTOR = """
import json
import os
from pathlib import Path

HERE = Path(__file__)


def execute(request):
    conv = request["conversation"]
    with HERE.with_suffix(".calls").open("a") as f:
        f.write(json.dumps([conv, request["turn"], request["step"]]) + "\\n")
    try:  # the first conversation to get here is the poisoned one (calls run in threads: one atomic create)
        fd = os.open(HERE.with_suffix(".poisoned"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, conv.encode())
        os.close(fd)
    except FileExistsError:
        pass
    if HERE.with_suffix(".poisoned").read_text() == conv:
        return [{"content": {"not", "json"}} for _ in request["calls"]]
    return [f"result {i}" for i, _ in enumerate(request["calls"])]
"""


def _tool_rows(n: int) -> list[dict[str, Any]]:
    """Two user turns; turn 0 recorded with one calculator call (what the simulator's answers call from)."""
    call = {"id": "functions.calculator:0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "240 / 80"})}}  # fmt: skip
    return [
        {
            "id": f"c{c}",
            "messages": [
                {"role": "system", "content": "You are a careful assistant with tools."},
                {"role": "user", "content": f"How long is trip {c}?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "functions.calculator:0", "content": f"recorded 3 ({c})"},
                {"role": "assistant", "content": "Three hours."},
                {"role": "user", "content": f"And back, for chat {c}?"},
                {"role": "assistant", "content": "Three again."},
            ],
        }
        for c in range(n)
    ]


def test_an_executor_result_that_is_not_json_ends_its_chain_and_the_worker_keeps_consuming(
    redis_url: str, tmp_path: Path
) -> None:
    from producer.render import load_tokenizer
    from sglang_sim.tools import write_catalogue
    from workers.tool_exec import TRUSTED_ENV

    # Given an agentic job (live executor) whose executor returns a set for one conversation's calls, and a
    # simulator whose answers always call a tool.
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    job, conversations = "not-json", 8
    tok = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp_path / "tools.json", load_tokenizer(str(tok)), "kimi")
    executor_file = tmp_path / "poison_tools.py"
    executor_file.write_text(POISON_EXECUTOR)
    executor = f"{executor_file}:execute"
    data = write_jsonl(tmp_path / "chat.jsonl", _tool_rows(conversations))
    started = time.monotonic()
    sim_args = ["--tool-catalogue", str(catalogue), "--time-scale", "400", "--tool-call-share", "1.0"]
    with simulator(tmp_path / "logs", *sim_args) as sim:
        env = {**fast_env(settings, sim, max_inflight=8, **STEADY_LEASE), TRUSTED_ENV: executor}
        worker = WorkerProcess("w1", env, tmp_path / "logs").start()
        try:
            worker.wait_ready(client, settings.keys)
            submitted = cli(
                settings, "submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1",
                "--no-progress", "--max-new-tokens", "400", "--seed", "5", "--context-length", "131072",
                "--turns", "all", "--tool-results", "executor", "--tool-executor", executor, "--max-tool-steps", "2",
                "--json",
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            # When the job runs: then it finishes and verify passes.
            waited, verified, st = _wait_verify_status(settings, job)
            assert worker.alive()
        finally:
            worker.terminate()
    log = worker.log_path.read_text()
    answers = {k.decode(): json.loads(v) for k, v in client.hgetall(settings.keys.turn_answers(job)).items()}
    calls = [tuple(json.loads(line)) for line in executor_file.with_suffix(".calls").read_text().splitlines()]
    poisoned = executor_file.with_suffix(".poisoned").read_text()
    ended = {p: a for p, a in answers.items() if p.startswith(f"{poisoned}/") and a.get("chain_end")}
    problems = []
    if "stopped consuming" in log:
        problems.append("the worker stopped consuming (a commit failed)")
    if [a.get("chain_end") for a in ended.values()] != ["tool_error"]:
        problems.append(f"{poisoned}'s chain ends {ended}")
    stored = read_committed(settings.output_uri, job).column("prompt_id").to_pylist()
    duplicated = raw_duplicates(settings.output_uri, job).column("prompt_id").to_pylist()
    done = {p.decode() for p in client.smembers(settings.keys.done(job))}
    outcome = Outcome(
        len(done), len(set(stored)), 0, sorted(done - set(stored)), duplicated, [],
        verified.returncode == 0, waited.returncode == 0, problems,
    )  # fmt: skip
    record_result(
        "an agentic executor returning a value JSON cannot hold for one conversation",
        outcome,
        f"{conversations} conversations, --tool-results executor; one conversation's results are a Python set",
        [],
        time.monotonic() - started,
        notes="its chain ends `tool_error` (the executor called once for it); every other chain goes on",
    )
    # Then that chain ends tool_error with the reason, its executor called once; the others went on.
    assert (waited.returncode, verified.returncode) == (0, 0), (waited.stdout, verified.stdout)
    outcome.assert_clean()
    (record,) = ended.values()
    assert "not JSON" in record["tool_error"] and "set" in record["tool_error"], record
    assert sum(1 for c in calls if c[0] == poisoned) == 1, calls
    assert st["conversations"]["ends"].get("tool_error") == 1, st["conversations"]
    assert any(a.get("tool_results") for p, a in answers.items() if not p.startswith(f"{poisoned}/")), "others went on"
    assert dead_letters(client, settings.keys, job) == {}


def test_a_commit_attempt_that_never_returns_is_shown_stalled_and_ends_the_worker_for_its_supervisor(
    tmp_path: Path,
) -> None:
    from workers.stall import COMMIT_STUCK_EXIT, StallWatch

    class _Hang(PostCommitHook):
        async def before_write(self, group: CommitGroup) -> FinalizeWrites | None:
            await asyncio.Event().wait()  # a storage call that never returns
            return None

    exits: list[int] = []
    info: dict[str, Any] = {}

    async def run() -> None:
        committer = GroupCommitter(
            PartWriter(str(tmp_path / "out"), "w1"), _Ledger(), 64, 0.01, 1000, 1.0, lambda *a: None,  # type: ignore[arg-type]
            hooks=PostCommitHooks([_Hang()]),
        )  # fmt: skip
        committer.start()
        row = make_row("p-0", job="job", dataset="ds")
        commit = asyncio.ensure_future(committer.commit("job", "ds", row, JobFinalRow("p-0", 30, True, False)))
        watch = StallWatch(committer, None, lambda: 1, info, None, 0.01, 1, stuck_exit_s=1.0, exit=exits.append)
        watch.start()
        # Until the watch names the hung attempt: at the stall bound (10 s) the row has waited a moment longer than
        # the attempt has run, and one publish may say "1 rows waiting 10 s" first (a loaded box widens that moment)
        async with asyncio.timeout(60):
            while not (exits and str(info.get("stalled") or "").startswith("commit attempt running for")):
                await asyncio.sleep(0.1)
        await watch.stop()
        commit.cancel()

    asyncio.run(run())
    assert exits[0] == COMMIT_STUCK_EXIT
    assert info["stalled"].startswith("commit attempt running for"), info
    assert info["held"] == 1 and info["commit_waiting"] == 1 and info["gate"]["storage"] == "ok", info


def test_only_a_hung_or_non_io_commit_is_stuck_never_an_io_outage_or_a_first_row_after_idling() -> None:
    from workers.commit_faults import CommitProgress
    from workers.stall import stuck

    bound = 100.0
    # A row arriving after a long idle, its attempt just started: not stuck.
    assert not stuck(CommitProgress(1, 0.5, 5000.0, None, False, 0.1), bound)
    # An attempt that has not returned for longer than the bound: stuck.
    assert stuck(CommitProgress(3, 150.0, 150.0, None, False, 120.0), bound)
    # An I/O outage retried behind the storage gate for longer (in its backoff, or a quick attempt): not stuck.
    assert not stuck(CommitProgress(3, 500.0, 500.0, "OSError: disk full", True, None), bound)
    assert not stuck(CommitProgress(3, 500.0, 500.0, "OSError: disk full", True, 0.2), bound)
    # Failing for longer with an error that is not I/O: stuck; a bound of 0: never.
    assert stuck(CommitProgress(3, 500.0, 500.0, "RuntimeError: lua bug", False, None), bound)
    assert not stuck(CommitProgress(3, 500.0, 500.0, "RuntimeError: lua bug", False, None), 0)


def test_errors_are_split_by_kind_io_data_and_unknown() -> None:
    from jinja2.exceptions import TemplateError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ReadOnlyError, ResponseError

    from workers.commit_faults import data_fault, io_fault

    # I/O: storage and Redis, a failover's READONLY included — retried behind the storage gate.
    for exc in (OSError("disk full"), FileNotFoundError("gone"), RedisConnectionError("reset"), ReadOnlyError("RO")):
        assert io_fault(exc) and not data_fault(exc), exc
    # A Lua script's own error is not I/O; a row's data errors (a template's refusal among them) are data faults.
    assert not io_fault(ResponseError("ERR user_script:12: attempt to index a nil value"))
    for exc in (TemplateError("System message must be at the beginning."), TypeError("set"), ValueError("NaN")):
        assert data_fault(exc) and not io_fault(exc), exc
    # Anything else is unknown: bounded tries before its row is found.
    assert not io_fault(RuntimeError("?")) and not data_fault(RuntimeError("?"))


def test_the_stall_reason_names_what_holds_the_worker() -> None:
    from types import SimpleNamespace

    from workers.commit_faults import CommitProgress
    from workers.stall import stall_reason

    after = 10.0
    open_gate = SimpleNamespace(healthy=True, state="ready", detail="")
    closed = SimpleNamespace(healthy=False, state="unhealthy", detail="/health_generate: 503")
    io = CommitProgress(4, 30.0, 30.0, "OSError: [Errno 28] No space left on device", True, None)
    assert stall_reason(io, 4, open_gate, 30.0, after) == (
        "commit failing at storage for 30 s: OSError: [Errno 28] No space left on device"
    )
    lua = CommitProgress(4, 30.0, 30.0, "ResponseError: ERR user_script:1: boom", False, None)
    assert stall_reason(lua, 4, open_gate, 30.0, after).startswith("commit failing with an error that is not I/O")
    idle = CommitProgress(0, None, 500.0, None, False, None)
    # Holding prompts while the server gate is closed, for longer than the bound: stalled, naming the gate.
    assert stall_reason(idle, 3, closed, 30.0, after) == "server unhealthy for 30 s: /health_generate: 503"
    # Not stalled: nothing held, progress within the bound, or a long generation with the server healthy.
    assert stall_reason(idle, 0, closed, 30.0, after) is None
    assert stall_reason(idle, 3, closed, 5.0, after) is None
    assert stall_reason(idle, 3, open_gate, 500.0, after) is None
