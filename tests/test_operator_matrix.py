"""Every job kind meets every operator command: one generated matrix (issue 44 part 1).

A new job kind or operator command adds its row or column here: a :class:`Kind` in :data:`KINDS` (its dataset and
submit flags) or a command function in :data:`COMMANDS` (what the operator runs, ending with the job's ``wait``).
``pytest.mark.parametrize`` runs their product, ids ``KIND-COMMAND`` (``images-retry_truncated``).

Every cell checks one invariant (:func:`assert_invariant`): ``wait`` exits 0 only when ``verify`` passes; every prompt
and turn is stored once at its latest revision (or dead-lettered with a reason an operator can act on — each command
here ends with a clean re-run, so none is left); a re-run's inputs equal the original's (its ids, its images re-sent
— the simulator counts placeholders against images and expands them — and its sampling params but the changed
budget); the exports hold the committed view.

The cells share one redis-server, one simulator (Kimi test tokenizer with a preprocessor config for images, the tool
catalogue for agentic jobs) and one worker; each cell is its own job. Producer commands run in-process.
``THINKFLEET_OPERATOR_MATRIX=PATH`` writes the cells' results as a table into PATH (RELIABILITY.md's
operator-matrix block; see :mod:`testing.operator_matrix`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
import requests

from producer.render import load_tokenizer
from sglang_sim.tools import write_catalogue
from storage.reader import read_committed
from storage.schema import EXPANDED_INPUT_IDS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS, OUTPUT_LOGPROBS
from testing.datasets import agentic_rows, chat_rows, conversation_rows, write_jsonl
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import STEADY_LEASE, fast_env, isolated_settings, producer_cli, simulator
from testing.images import png_data_uri, random_png
from testing.operator_matrix import MatrixResults
from testing.services import RedisServer
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.vision import ImageRef, expand_ids
from workers.tool_exec import TRUSTED_ENV

MEDIA_PAD = 163605  # the Kimi test tokenizer's <|media_pad|>
BUDGET, CUT, RAISED = 120, 8, 200
EXECUTOR = f"{Path(__file__).parents[1] / 'docs/examples/agentic/tools.py'}:execute"
SIM_CONTENT = {"tool_call_share": 0.4, "length_median_tokens": 60.0, "max_tool_calls": 2}
#: Dead-letter classes an operator can act on (a retry of it can succeed once the cause is gone).
ACTIONABLE = {"bad_output", "cancelled", "retries_exhausted", "image_missing", "context_overflow"}


# -- the shared fleet ------------------------------------------------------------------------------------------
@dataclass
class Fleet:
    settings: Settings
    client: redis.Redis
    sim: str
    tok: Path
    tmp: Path
    worker: WorkerProcess


RESULTS = MatrixResults()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("matrix")
    (tmp / "logs").mkdir()
    server = RedisServer(tmp / "redis").start()
    tok = Path(build_test_tokenizer(default_test_tokenizer_dir()))
    catalogue = write_catalogue(tmp / "tools.json", load_tokenizer(str(tok)), "kimi")
    settings = isolated_settings(server.url(), str(tmp / "out"), alarm_min_rows=10_000)
    sim_args = ["--time-scale", "400", "--sglang-version", "0.5.23", "--tokenizer", str(tok)]
    sim_args += ["--tool-catalogue", str(catalogue)]
    for key, value in SIM_CONTENT.items():
        sim_args += [f"--{key.replace('_', '-')}", str(value)]
    try:
        with simulator(tmp / "logs", *sim_args) as sim:
            env = {
                **fast_env(settings, sim, max_inflight=8, retry_max_attempts=2, **STEADY_LEASE),
                TRUSTED_ENV: EXECUTOR,
            }
            worker = WorkerProcess("w1", env, tmp / "logs").start()
            client = redis.Redis.from_url(server.url())
            try:
                worker.wait_ready(client, settings.keys)
                yield Fleet(settings, client, sim, tok, tmp, worker)
            finally:
                worker.cont()
                worker.terminate()
    finally:
        server.stop()
        RESULTS.write(os.environ.get("THINKFLEET_OPERATOR_MATRIX"))


# -- rows: job kinds -------------------------------------------------------------------------------------------
def _image(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_uri(data)}}


def _image_prompts() -> list[dict[str, Any]]:
    pool = [random_png(64, 48, 1), random_png(96, 64, 2), random_png(40, 40, 3)]
    return [
        {"id": f"p{i}", "messages": [{"role": "user", "content": [
            *map(_image, pool[i % 3 : i % 3 + 1 + i % 2]), {"type": "text", "text": f"What is in picture {i}?"},
        ]}]}
        for i in range(4)
    ]  # fmt: skip


def _image_conversations() -> list[dict[str, Any]]:
    a, b = random_png(64, 48, 11), random_png(96, 64, 12)
    return [
        {"id": f"c{i}", "messages": [
            {"role": "user", "content": [_image(a if i % 2 else b), {"type": "text", "text": f"Describe {i}."}]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [_image(b), {"type": "text", "text": "And this one?"}]},
            {"role": "assistant", "content": "Another."},
        ]}
        for i in range(3)
    ]  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """A job kind: its dataset rows and submit flags. ``turns``: its prompt ids are turns (``…/tN``)."""

    name: str
    rows: Callable[[], list[dict[str, Any]]]
    flags: tuple[str, ...] = ()
    turns: bool = False
    #: What every stored row of the kind carries, re-runs included (their messages rebuilt from storage).
    row_check: Callable[[dict[str, Any]], None] | None = None


def _has_logprobs(row: dict[str, Any]) -> None:
    logprobs = row[OUTPUT_LOGPROBS]
    assert logprobs is not None and len(logprobs) == len(row["output_ids"]), f"{row['prompt_id']}: no logprobs"


AGENTIC = ("--turns", "all", "--max-tool-steps", "3")
KINDS = [
    Kind("single", lambda: chat_rows(4, words=20)),
    Kind("samples", lambda: chat_rows(3, words=20), ("--samples", "2")),
    Kind("logprobs", lambda: chat_rows(4, words=20), ("--logprobs", "3"), row_check=_has_logprobs),
    Kind("turns", lambda: conversation_rows(3, 2, 20, "You are terse."), ("--turns", "all"), turns=True),
    Kind(
        "agentic_replay",
        lambda: agentic_rows(2, 2),
        (*AGENTIC, "--tool-results", "replay", "--tool-mismatch", "keep_recorded"),
        turns=True,
    ),
    Kind(
        "agentic_executor",
        lambda: agentic_rows(2, 2),
        (*AGENTIC, "--tool-results", "executor", "--tool-executor", EXECUTOR),
        turns=True,
    ),
    Kind("images", _image_prompts),
    Kind("image_turns", _image_conversations, ("--turns", "all"), turns=True),
]


# -- one cell: a job of one kind -------------------------------------------------------------------------------
@dataclass
class Cell:
    fleet: Fleet
    kind: Kind
    job: str
    data: Path
    #: Rows committed before the command re-ran anything (prompt id → row), for the inputs check.
    before: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Prompt ids a command re-ran (their budget may have changed): each must now be at a later revision.
    rerun: set[str] = field(default_factory=set)
    #: The budget a re-run may carry instead of the original's (``retry --truncated --max-new-tokens``).
    new_budget: int | None = None

    @property
    def settings(self) -> Settings:
        return self.fleet.settings

    def cli(self, *args: str) -> Any:
        return producer_cli(self.settings, *args, in_process=True)

    def submit(self, budget: int = BUDGET) -> Any:
        out = self.cli(
            "submit", str(self.data), "--job", self.job, "--tokenizer", str(self.fleet.tok), "--processes", "1",
            "--no-progress", "--context-length", "131072", "--max-new-tokens", str(budget), "--seed", "3",
            "--json", *self.kind.flags,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out

    def progress(self) -> dict[str, int]:
        return job_progress(self.fleet.client, self.settings.keys, self.job)

    def settled(self, timeout_s: float = 150) -> None:
        """Every submitted prompt (turn) is done or dead."""

        def ok() -> bool:
            p = self.progress()
            return p["submitted"] > 0 and p["done"] + p["dead"] >= p["submitted"]

        wait_until(ok, timeout_s, 0.2, what=f"{self.job} settled", explain=lambda: f"{self.progress()} {self.tail()}")

    def wait(self) -> int:
        return self.cli("wait", self.job, "--timeout", "120", "--interval", "0.3").returncode

    def rows(self) -> dict[str, dict[str, Any]]:
        return {r["prompt_id"]: r for r in read_committed(self.settings.output_uri, self.job).to_pylist()}

    def dead(self) -> dict[str, dict[str, Any]]:
        return dead_letters(self.fleet.client, self.settings.keys, self.job)

    def tail(self) -> str:
        return self.fleet.worker.tail(15)

    def run_clean(self, budget: int = BUDGET) -> None:
        self.submit(budget)
        assert self.wait() == 0, self.tail()
        self.before = self.rows()
        assert self.before, "the first run stored nothing"


# -- columns: operator commands --------------------------------------------------------------------------------
def _faults(fleet: Fleet, **values: object) -> None:
    requests.post(f"{fleet.sim}/control/faults", json=values, timeout=5).raise_for_status()


def retry_dead(cell: Cell) -> None:
    """Every head answered with a bad id on every attempt → dead-lettered ``bad_output``; the fault gone, ``retry``."""
    _faults(cell.fleet, bad_output_rate=1.0, bad_output_per_attempt=False)
    try:
        cell.submit()
        cell.settled()
    finally:
        _faults(cell.fleet, bad_output_rate=0.0)
    dead = cell.dead()
    assert dead and {d["error_class"] for d in dead.values()} <= ACTIONABLE, dead
    out = cell.cli("retry", cell.job, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["requeued"] == len(dead), out.stdout + out.stderr
    assert cell.wait() == 0, cell.tail()
    _assert_rerun_as_dead_lettered(cell, dead)


def _assert_rerun_as_dead_lettered(cell: Cell, dead: dict[str, dict[str, Any]]) -> None:
    """Each re-run's inputs are its dead letter's: the content hash (ids and images) its message carried."""
    rows = cell.rows()
    for pid, record in dead.items():
        args = msgpack.unpackb(base64.b64decode(record["task"]))  # PromptTask.to_args(): content_hash is 5th
        assert rows[pid]["content_hash"] == args[4], f"{pid}: re-run with other inputs than its dead letter's"


def retry_truncated(cell: Cell) -> None:
    """Answers cut by an 8-token budget, then ``retry --truncated --max-new-tokens 200``."""
    cell.run_clean(budget=CUT)
    cut = {pid for pid, r in cell.before.items() if r["finish_reason"] == "length"}
    assert cut, "an 8-token budget cut no answer"
    out = cell.cli("retry", cell.job, "--truncated", "--max-new-tokens", str(RAISED), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["requeued"] >= 1, out.stdout
    cell.rerun, cell.new_budget = cut, RAISED
    assert cell.wait() == 0, cell.tail()


def retry_missing(cell: Cell) -> None:
    """One part file damaged (zero bytes): ``verify`` quarantines it and fails; ``retry --missing`` re-sends what it
    can rebuild and names the rest (nothing readable left: "re-run producer submit"), which the same submit runs."""
    cell.run_clean()
    parts = sorted(Path(cell.settings.output_uri, cell.job).glob("dataset=*/*.parquet"))
    assert parts, "no part file"
    parts[0].write_bytes(b"")
    failed = cell.cli("verify", cell.job, "--json")
    assert failed.returncode == 1, "verify passed with a damaged part"
    lost = set(cell.before) - set(cell.rows())
    assert lost, "the damaged part held no committed row"
    assert cell.wait() != 0, "wait exited 0 while verify fails (a quarantined part's rows are not stored)"
    out = cell.cli("retry", cell.job, "--missing", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    named = set(result["prompt_ids"]) | set(result["skipped"]) | set(result["refused"])
    assert lost <= named | {p for p in lost if "re-run `producer submit`" in out.stderr}, (lost, out.stdout, out.stderr)
    if "re-run `producer submit`" in out.stderr:
        cell.submit()
    assert cell.wait() == 0, cell.tail()


def purge_resubmit(cell: Cell) -> None:
    """``purge --force`` of a finished job, then the same submit (stored rows and chains resumed from storage)."""
    cell.run_clean()
    out = cell.cli("purge", cell.job, "--force")
    assert out.returncode == 0, out.stdout + out.stderr
    cell.submit()
    assert cell.wait() == 0, cell.tail()


def redis_lost(cell: Cell) -> None:
    """Every Redis key of the job gone (its own keys only: the server is shared), then the same submit."""
    cell.run_clean()
    client, keys = cell.fleet.client, cell.settings.keys
    doomed = [*keys.job_fixed(cell.job), *client.scan_iter(match=keys.job_glob(cell.job))]
    client.delete(*doomed)
    client.srem(keys.jobs, cell.job)
    cell.submit()
    assert cell.wait() == 0, cell.tail()


def cancel_resume(cell: Cell) -> None:
    """Cancelled before the worker took anything: every head dead-lettered ``cancelled``; ``resume`` + ``retry
    --error-class cancelled``."""
    worker = cell.fleet.worker
    os.kill(worker.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        cell.submit()
        out = cell.cli("cancel", cell.job)
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        worker.cont()
    cell.settled()
    dead = cell.dead()
    assert dead and {d["error_class"] for d in dead.values()} == {"cancelled"}, dead
    assert cell.cli("resume", cell.job).returncode == 0
    out = cell.cli("retry", cell.job, "--error-class", "cancelled", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["requeued"] == len(dead), out.stdout + out.stderr
    assert cell.wait() == 0, cell.tail()
    _assert_rerun_as_dead_lettered(cell, dead)


def pause_resume(cell: Cell) -> None:
    """Paused before the worker took anything: nothing is stored while paused; ``resume`` runs it to the end."""
    worker = cell.fleet.worker
    os.kill(worker.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        cell.submit()
        assert cell.cli("pause", cell.job).returncode == 0
    finally:
        worker.cont()
    keys, client = cell.settings.keys, cell.fleet.client
    wait_until(lambda: client.llen(keys.parked(cell.job)) > 0, 60, 0.2, what="messages parked while paused")
    assert cell.progress()["done"] == 0, "a paused job stored a row"
    assert cell.cli("resume", cell.job).returncode == 0
    assert cell.wait() == 0, cell.tail()


EXPORTS = ("eagle3", "specforge", "hf", "messages", "conversations")


def compact_export(cell: Cell) -> None:
    """``compact``, then every export format holds the committed view (one record per committed row)."""
    cell.run_clean()
    out = cell.cli("compact", cell.job)
    assert out.returncode == 0, out.stdout + out.stderr
    after = cell.rows()
    assert {p: r["output_ids"] for p, r in after.items()} == {p: r["output_ids"] for p, r in cell.before.items()}
    cell.before = after
    for fmt in EXPORTS:
        dest = cell.fleet.tmp / f"{cell.job}-{fmt}" if fmt == "hf" else cell.fleet.tmp / f"{cell.job}-{fmt}.jsonl"
        out = cell.cli("export", cell.job, "--format", fmt, "--out", str(dest), "--json")
        assert out.returncode == 0, f"export {fmt}: {out.stdout[-1500:]} {out.stderr[-1500:]}"
        result = json.loads(out.stdout)
        # Each committed row is written or left out with a counted reason (an image prompt SpecForge cannot read).
        assert result["rows"] == _export_count(dest), f"export {fmt}: {result}"
        assert result["rows"] + sum(result["skipped"].values()) == len(after), f"export {fmt}: {result}, {len(after)}"
    assert set(cell.rows()) == set(after), "rows were committed after wait exited 0"
    # The token export is the committed rows byte for byte: prompt + output, keyed by prompt id.
    eagle3 = [json.loads(line) for line in (cell.fleet.tmp / f"{cell.job}-eagle3.jsonl").read_text().splitlines()]
    for record in eagle3:
        row = after[record["id"]]
        assert record["input_ids"] == [*row["input_ids"], *row["output_ids"]], record["id"]
        assert record["prompt_len"] == len(row["input_ids"]), record["id"]


def _export_count(dest: Path) -> int:
    if dest.is_dir():
        from datasets import load_from_disk

        return len(load_from_disk(str(dest)))
    return sum(1 for line in dest.read_text().splitlines() if line.strip())


COMMANDS: list[Callable[[Cell], None]] = [
    retry_dead, retry_truncated, retry_missing, purge_resubmit, redis_lost, cancel_resume, pause_resume, compact_export,
]  # fmt: skip


# -- the invariant ---------------------------------------------------------------------------------------------
def _sampling(row: dict[str, Any], drop_budget: bool) -> dict[str, Any]:
    params = json.loads(row["sampling_params"] or "{}")
    if drop_budget:
        params.pop("max_new_tokens", None)
    return params


def _images_received(row: dict[str, Any]) -> None:
    """The server expanded each placeholder of the row into its image's tokens: it received every image."""
    ids = row["input_ids"]
    positions = [i for i, t in enumerate(ids) if t == MEDIA_PAD]
    assert row[IMAGE_POSITIONS] == positions and positions, row["prompt_id"]
    assert row["prompt_tokens"] == len(ids) - len(positions) + sum(row[IMAGE_TOKENS]), row["prompt_id"]
    refs = [ImageRef(s, "x", "image/png", 1, 1, n, p) for s, n, p in
            zip(row[IMAGE_SHA256], row[IMAGE_TOKENS], positions, strict=True)]  # fmt: skip
    assert row[EXPANDED_INPUT_IDS] == expand_ids(ids, refs), row["prompt_id"]


def assert_invariant(cell: Cell) -> None:
    keys, client = cell.settings.keys, cell.fleet.client
    waited = cell.wait()
    verified = cell.cli("verify", cell.job, "--json")
    assert waited != 0 or verified.returncode == 0, f"wait exited 0, verify failed: {verified.stdout[-3000:]}"
    assert waited == 0 and verified.returncode == 0, f"wait {waited}, verify {verified.returncode}"
    # Every prompt and turn stored once at its latest revision; nothing left dead (each command re-ran its dead).
    dead = cell.dead()
    assert not dead, f"left dead: {dead}"
    rows, progress = cell.rows(), cell.progress()
    # A turn past its chain's end (a re-run earlier turn called a tool) or an agentic step no current chain reaches
    # is superseded: listed by verify, owed by nobody, left out of every export.
    superseded = set(json.loads(verified.stdout).get("superseded") or [])
    live = {pid: row for pid, row in rows.items() if pid not in superseded}
    assert len(live) == progress["done"] == progress["submitted"], (sorted(rows), sorted(superseded), progress)
    revisions = {k.decode(): int(v) for k, v in client.hgetall(keys.revisions(cell.job)).items()}
    for pid, row in live.items():
        latest = revisions.get(pid, 0)
        assert row["revision"] == latest, f"{pid}: stored at revision {row['revision']}, the latest is {latest}"
        if row[IMAGE_SHA256]:
            _images_received(row)
        if cell.kind.row_check is not None:
            cell.kind.row_check(row)
    for pid in cell.rerun & set(live):
        assert rows[pid]["revision"] > cell.before[pid]["revision"], f"{pid} was not re-run"
    # A re-run's inputs are the original's: its ids (a later turn's follow from a re-run earlier answer), its
    # images and its sampling params but the changed budget.
    changed = {p.rsplit("/t", 1)[0] for p in cell.rerun} if cell.kind.turns else set()
    for pid, old in cell.before.items():
        new = rows.get(pid)
        if new is None:
            continue  # a later turn a re-run earlier turn no longer leads to (its chain ended before it)
        later_turn = cell.kind.turns and pid.rsplit("/t", 1)[0] in changed and not pid.endswith("/t0")
        if not later_turn:
            assert new["input_ids"] == old["input_ids"], f"{pid}: re-run with other ids"
        assert new[IMAGE_SHA256] == old[IMAGE_SHA256], f"{pid}: re-run with other images"
        budget_changed = cell.new_budget is not None
        assert _sampling(new, budget_changed) == _sampling(old, budget_changed), f"{pid}: re-run with other sampling"
        if budget_changed and pid in cell.rerun and pid in live:
            assert _sampling(new, False)["max_new_tokens"] == cell.new_budget, pid


# -- the matrix ------------------------------------------------------------------------------------------------
#: Cells that find a bug in code this module does not own: (kind, command) → the reason (strict xfail).
#: (samples × retry_truncated was one: the re-run lost sample k's seed; fixed in producer/retry.py row_overrides.)
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def _cells() -> Iterator[Any]:
    for kind in KINDS:
        for command in COMMANDS:
            marks = []
            bug = KNOWN_BUGS.get((kind.name, command.__name__))
            if bug:
                marks.append(pytest.mark.xfail(strict=True, reason=bug))
            yield pytest.param(kind, command, id=f"{kind.name}-{command.__name__}", marks=marks)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("kind", "command"), list(_cells()))
def test_operator_command_on_job_kind_keeps_the_invariant(
    fleet: Fleet, kind: Kind, command: Callable[[Cell], None]
) -> None:
    job = f"{kind.name}-{command.__name__}".replace("_", "-")
    data = write_jsonl(fleet.tmp / job / "d.jsonl", kind.rows())
    cell = Cell(fleet, kind, job, data)
    with RESULTS.cell(kind.name, command.__name__, KNOWN_BUGS.get((kind.name, command.__name__))):
        command(cell)
        assert_invariant(cell)
