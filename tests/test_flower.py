"""Flower shows the work as it is (issue 36): a task is STARTED while its request is at the SGLang server — not while
it waits for a request slot —, a finished one carries its generation time as RUNTIME, and the tasks page shows both.

One scenario on loopback, as a head node and one inference node run it: redis-server, ``sglang-sim`` on a slow clock
(requests last about a second), a real ``worker``, real ``celery -A workers.app flower`` behind basic auth, a small
job from the real ``producer submit`` with the test tokenizer, and every Celery task event recorded from Redis.
Halfway through, the simulator stalls (it answers nothing, its generations freeze): the requests at the server stay
there while the worker holds more prompts waiting for a slot, so what Flower shows can be compared with what is
generating — by Flower's API, its Started filter and its page in headless Chromium — without racing the job. Then
the stall ends and every task finishes. Unit tests of workers/events.py (no services) come last.

Chromium (Debian's ``chromium``) is needed only by the page tests: missing, they skip locally and fail under CI.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from storage.reader import read_committed
from testing.datasets import chat_rows, write_jsonl
from testing.fleet import WorkerProcess, free_port, job_progress, wait_for_port, wait_until
from testing.harness import cli_env, fast_env, isolated_settings, post_json, producer_cli, sim_stats, simulator
from testing.services import RedisServer, service_missing
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from workers import events as task_events
from workers.tasks import QuietRequest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")
JOB = "flower-job"
#: Enough that, however far the job got before the stall, the worker still holds prompts beyond its bound.
PROMPTS = 24
INFLIGHT = 3
#: The simulator's clock (simulated seconds per wall second) and its fastest decode per request (tokens per
#: simulated second, its default, given explicitly): a request of n tokens lasts at least (n - 1) / (40 * 5) wall
#: seconds at the server, however loaded the box (a slow box only slows the simulated clock).
TIME_SCALE = 5
PER_REQUEST_TOK_S = 40
MAX_NEW_TOKENS = 300
AUTH = "operator:flower-test"
#: Generous: the scenario takes ~30 s on an idle box; a loaded 2-core CI box may take several times that.
DEADLINE_S = 180.0


@dataclass
class Flower:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> Any:
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": "Basic " + base64.b64encode(AUTH.encode()).decode()}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if path.startswith("/api/") else body.decode()

    def tasks(self, state: str | None = None) -> dict[str, dict[str, Any]]:
        """Flower's tasks of the job (``/api/tasks``, or its ``state`` filter): uuid → task."""
        found = self.get("/api/tasks?limit=100000" + (f"&state={state}" if state else ""))
        return {uuid: task for uuid, task in found.items() if uuid.startswith(JOB + "/")}

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@dataclass
class EventLog:
    """Every Celery task event the worker publishes (decoded from Redis pub/sub) and the PUBLISHes that carried them."""

    url: str
    events: list[dict[str, Any]] = field(default_factory=list)
    publishes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)

    def start(self) -> EventLog:
        threading.Thread(target=self._listen, name="celery-events", daemon=True).start()
        assert self._ready.wait(10), "could not subscribe to the Celery events"
        return self

    def stop(self) -> None:
        self._stop.set()

    def _listen(self) -> None:
        client = redis.Redis.from_url(self.url)
        pubsub = client.pubsub()
        pubsub.psubscribe("*celeryev/task*")  # kombu's fanout topic of the celeryev exchange, task group
        self._ready.set()
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=0.2)
            if not message or message["type"] != "pmessage":
                continue
            envelope = json.loads(message["data"])
            body = envelope["body"]
            if envelope.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            batch = json.loads(body)
            self.publishes += 1
            self.events.extend(batch if isinstance(batch, list) else [batch])
        pubsub.close()
        client.close()

    def of_job(self) -> list[dict[str, Any]]:
        return [e for e in self.events if str(e.get("uuid", "")).startswith(JOB + "/")]


@dataclass
class Scenario:
    """What the scenario saw: while the simulator stalled, and once every task finished."""

    flower: Flower
    sim_url: str
    stalled_tasks: dict[str, dict[str, Any]]
    stalled_started_filter: dict[str, dict[str, Any]]
    stalled_rids: set[str]
    final_tasks: dict[str, dict[str, Any]]
    rows: dict[str, dict[str, Any]]
    events: EventLog
    pages: dict[str, str] = field(default_factory=dict)


def _states(tasks: dict[str, dict[str, Any]]) -> Counter[str]:
    return Counter(t["state"] for t in tasks.values())


def _prompt_id(task: dict[str, Any]) -> str:
    return str(ast.literal_eval(task["args"])[2])  # args: (job, dataset, prompt id)


def _page(flower: Flower, path: str, workdir: Path) -> str:
    """The page as headless Chromium renders it (its table is filled by a request the page makes after loading)."""
    assert CHROMIUM is not None
    host = flower.url.removeprefix("http://")
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={workdir}",
         "--virtual-time-budget=10000", "--dump-dom", f"http://{AUTH}@{host}{path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return out.stdout


#: A row of Flower's tasks table: its uuid link, its state badge and, for the runtime column, its text.
ROW = re.compile(r"<tr\b.*?</tr>", re.S)
UUID = re.compile(r'class="task-uuid-full">([^<]+)<')
BADGE = re.compile(r'<span class="badge [^"]*">([A-Z]+)</span>')
DURATION = re.compile(r">(\d+(?:\.\d+)?) (ms|s)<")


def page_rows(dom: str) -> dict[str, tuple[str, float | None]]:
    """uuid → (state, runtime in seconds or None) for every row of the tasks table in ``dom``."""
    rows: dict[str, tuple[str, float | None]] = {}
    for row in ROW.findall(dom):
        uuid, badge = UUID.search(row), BADGE.search(row)
        if uuid and badge:
            duration = DURATION.search(row)
            runtime = float(duration.group(1)) / (1000 if duration.group(2) == "ms" else 1) if duration else None
            rows[uuid.group(1)] = (badge.group(1), runtime)
    return rows


def _rendered(flower: Flower, path: str, workdir: Path, want: Any) -> str:
    """Render ``path`` until ``want(rows)`` holds (a render may come before the table's request answered)."""
    dom = ""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        dom = _page(flower, path, workdir)
        if want(page_rows(dom)):
            return dom
    raise AssertionError(f"{path} never showed what was expected; last rows: {page_rows(dom)}\n{dom[-3000:]}")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("flower")
    logs = tmp / "logs"
    logs.mkdir()
    server = RedisServer(tmp / "redis").start()
    url = server.url(0)
    client = redis.Redis.from_url(url)
    settings = isolated_settings(url, str(tmp / "out"))
    sim_args = ("--time-scale", str(TIME_SCALE), "--per-request-tok-s", str(PER_REQUEST_TOK_S))
    events = EventLog(url).start()
    procs: list[subprocess.Popen[bytes]] = []
    workers: list[WorkerProcess] = []
    try:
        with simulator(logs, *sim_args) as sim_url:
            # A request waits as long as the stall lasts (never given up and retried), and so does a health probe.
            env = fast_env(
                settings, sim_url, max_inflight=INFLIGHT, request_timeout_floor_s=600, health_probe_timeout_s=600,
                lease_s=60,
            )  # fmt: skip
            worker = WorkerProcess("gpu-node-01", env, logs).start()
            workers.append(worker)
            worker.wait_ready(client, settings.keys)
            port = free_port()
            log = logs / "flower.log"
            flower_env = {**cli_env(settings), "FLOWER_BASIC_AUTH": AUTH}
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "workers.app", "flower", f"--port={port}",
                     "--address=127.0.0.1", "--persistent=False",
                     "--tasks_columns=name,uuid,state,args,received,runtime,worker"],
                    cwd=ROOT, env=flower_env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            procs.append(proc)
            wait_for_port(port, 60)
            flower = Flower(f"http://127.0.0.1:{port}", proc, log)
            # Flower follows the worker's events (its heartbeats) before the job starts: it sees every task's.
            online = re.compile(r'^flower_worker_online\{worker="gpu-node-01@[^"]*"\} 1\.0$', re.M)
            wait_until(
                lambda: online.search(flower.get("/metrics")), DEADLINE_S, 0.5, "Flower sees the worker", flower.tail
            )

            tokenizer = build_test_tokenizer(default_test_tokenizer_dir())
            data = write_jsonl(tmp / "alpha.jsonl", chat_rows(PROMPTS, words=12))
            submitted = producer_cli(
                settings, "submit", str(data), "--job", JOB, "--tokenizer", str(tokenizer), "--processes", "1",
                "--no-progress", "--max-new-tokens", str(MAX_NEW_TOKENS),
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr[-3000:]

            # Some tasks finished; then the server stalls with requests at it and more prompts held for a slot.
            wait_until(lambda: _states(flower.tasks())["SUCCESS"] >= 3, DEADLINE_S, 0.2, "3 tasks SUCCESS", worker.tail)
            post_json(f"{sim_url}/control/stall", {"seconds": 600})
            seen: list[dict[str, str]] = [{}]

            def settled() -> bool:
                # What the stall froze has reached Flower and stays: the bound's worth STARTED, more prompts held.
                now = {uuid: task["state"] for uuid, task in flower.tasks().items()}
                steady, seen[0] = now == seen[0], now
                states = Counter(now.values())
                return steady and states["STARTED"] == INFLIGHT and states["RECEIVED"] >= 1

            wait_until(settled, DEADLINE_S, 1.0, f"{INFLIGHT} tasks STARTED, some RECEIVED", lambda: str(seen[0]))
            stalled = flower.tasks()
            started_filter = flower.tasks("STARTED")
            rids = set(sim_stats(sim_url, rids=True)["rids"])
            scene = Scenario(flower, sim_url, stalled, started_filter, rids, {}, {}, events)
            if CHROMIUM is not None:
                chromium = tmp / "chromium"
                scene.pages["/tasks"] = _rendered(
                    flower, "/tasks", chromium, lambda rows: {"STARTED", "SUCCESS"} <= {s for s, _ in rows.values()}
                )
                scene.pages["/tasks?state=STARTED"] = _rendered(flower, "/tasks?state=STARTED", chromium, bool)

            post_json(f"{sim_url}/control/stall", {"seconds": 0})
            wait_until(
                lambda: job_progress(client, settings.keys, JOB)["done"] == PROMPTS, DEADLINE_S, 0.5, "job done",
                worker.tail,
            )  # fmt: skip
            wait_until(
                lambda: _states(flower.tasks())["SUCCESS"] == PROMPTS, DEADLINE_S, 0.5,
                "Flower shows every task SUCCESS", lambda: str(_states(flower.tasks())),
            )  # fmt: skip
            scene.final_tasks = flower.tasks()
            scene.rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, JOB).to_pylist()}
            worker.terminate()
            yield scene
    finally:
        events.stop()
        for worker in workers:
            worker.kill()
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        client.close()
        server.stop()


# -- what Flower's API shows --------------------------------------------------------------------------------------


def test_a_task_is_started_while_its_request_is_at_the_server(scenario: Scenario) -> None:
    # Given the server stalled with requests at it, and the worker holding more prompts than its in-flight bound
    tasks = scenario.stalled_tasks
    started = {u for u, t in tasks.items() if t["state"] == "STARTED"}
    waiting = {u for u, t in tasks.items() if t["state"] == "RECEIVED"}
    at_server = {rid.rsplit("/", 1)[0] for rid in scenario.stalled_rids if rid.startswith(JOB + "/")}  # TASK/aN-…
    finished = {u for u, t in tasks.items() if t["state"] == "SUCCESS"}
    # Then exactly the bound's worth of tasks is STARTED: those whose request reached the server and has no answer
    assert len(started) == INFLIGHT, _states(tasks)
    assert started <= at_server, f"STARTED without a request at the server: {started - at_server}"
    assert started == at_server - finished, "a request at the server whose task is not STARTED"
    # And the prompts held for a request slot are only RECEIVED: their requests never went out
    assert waiting and not (waiting & at_server), (waiting, at_server)


def test_the_started_filter_lists_what_is_generating(scenario: Scenario) -> None:
    started = {u for u, t in scenario.stalled_tasks.items() if t["state"] == "STARTED"}
    assert set(scenario.stalled_started_filter) == started
    assert all(t["state"] == "STARTED" for t in scenario.stalled_started_filter.values())


def test_a_finished_task_carries_its_generation_time(scenario: Scenario) -> None:
    tasks = scenario.final_tasks
    assert len(tasks) == PROMPTS and _states(tasks) == {"SUCCESS": PROMPTS}
    for uuid, task in tasks.items():
        row = scenario.rows[_prompt_id(task)]
        # The server cannot have answered faster than its fastest decode on its own clock (a loaded box only slows
        # that clock): the runtime, from the request going out to the row stored, spans the whole generation.
        at_server_s = (row["completion_tokens"] - 1) / (PER_REQUEST_TOK_S * TIME_SCALE)
        assert task["runtime"] >= max(at_server_s, 0.01), (uuid, task["runtime"], row["completion_tokens"])
        # and it started (once its request went out) after it was received
        assert task["received"] <= task["started"] <= task["succeeded"], task


def test_each_task_is_started_once_and_ends_once(scenario: Scenario) -> None:
    events = scenario.events.of_job()
    per_task: dict[str, Counter[str]] = defaultdict(Counter)
    for event in events:
        per_task[event["uuid"]][event["type"]] += 1
    assert len(per_task) == PROMPTS
    expected = Counter({"task-received": 1, "task-started": 1, "task-succeeded": 1})
    assert all(kinds == expected for kinds in per_task.values()), dict(per_task)
    # The cost: three events a prompt, batched into far fewer PUBLISHes (printed for the record, never timed)
    print(f"{len(events) / PROMPTS:.2f} task events and {scenario.events.publishes / PROMPTS:.2f} PUBLISHes a prompt")


# -- what Flower's page shows (headless Chromium) -----------------------------------------------------------------


def _needs_chromium() -> None:
    if CHROMIUM is None:
        service_missing("chromium is not installed (apt-get install chromium)")


def test_the_tasks_page_shows_started_and_finished_tasks_with_their_runtime(scenario: Scenario) -> None:
    _needs_chromium()
    rows = page_rows(scenario.pages["/tasks"])
    states = {state for state, _ in rows.values()}
    assert {"STARTED", "SUCCESS"} <= states, rows
    for uuid, (state, runtime) in rows.items():
        if state == "SUCCESS":
            # a generation's time, not the ~0.1 ms Celery's trace measured around a task body that had nothing left
            assert runtime is not None and runtime >= 0.01, (uuid, runtime)
            assert scenario.stalled_tasks[uuid]["state"] == "SUCCESS"
        if state == "STARTED":
            assert scenario.stalled_tasks[uuid]["state"] == "STARTED"


def test_the_pages_started_filter_shows_what_is_generating(scenario: Scenario) -> None:
    _needs_chromium()
    rows = page_rows(scenario.pages["/tasks?state=STARTED"])
    assert {state for state, _ in rows.values()} == {"STARTED"}
    assert set(rows) == {u for u, t in scenario.stalled_tasks.items() if t["state"] == "STARTED"}


# -- workers/events.py, without services --------------------------------------------------------------------------


@pytest.fixture
def outbox(monkeypatch: pytest.MonkeyPatch) -> task_events.EventOutbox:
    box = task_events.EventOutbox()
    monkeypatch.setattr(task_events, "outbox", box)
    return box


def _drained(box: task_events.EventOutbox) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    box.drain(lambda type, **fields: out.append((type, fields)))
    return out


def test_a_retried_request_does_not_start_its_task_again(outbox: task_events.EventOutbox) -> None:
    clock = task_events.TaskClock("job/p1/r0")
    context = task_events.context_for(clock)
    context.run(task_events.request_sent)
    context.run(task_events.request_sent)  # the retry
    task_events.request_sent()  # outside any delivery: nothing
    sent = _drained(outbox)
    assert [(t, f["uuid"]) for t, f in sent] == [("task-started", "job/p1/r0")]
    assert clock.sent is not None and abs(sent[0][1]["timestamp"] - time.time()) < 60


def test_runtime_counts_from_the_request_else_from_the_pool_taking_it() -> None:
    clock = task_events.TaskClock("t", taken=100.0, done=107.0)
    assert clock.runtime_s() == 7.0
    clock.sent = 101.5
    assert clock.runtime_s() == 5.5


def _request(clock: task_events.TaskClock | None) -> Any:
    """What QuietRequest.send_event reads of a Celery request."""
    return SimpleNamespace(
        id="job/p1/r0", clock=clock, _eventer=SimpleNamespace(enabled=True), task=SimpleNamespace(send_events=True)
    )


def test_ending_events_carry_the_runtime_and_a_dead_letter_is_a_failure(outbox: task_events.EventOutbox) -> None:
    clock = task_events.TaskClock("job/p1/r0", taken=10.0, sent=11.0, done=14.0)
    request = _request(clock)
    QuietRequest.send_event(request, "task-started")  # Celery's, when the pool accepted it: dropped
    QuietRequest.send_event(request, "task-succeeded", result="'stored'", runtime=0.0001)
    QuietRequest.send_event(request, "task-succeeded", result="'dead'", runtime=0.0001)
    QuietRequest.send_event(request, "task-rejected", requeue=True)  # a hand-back stays one
    sent = [(t, {k: v for k, v in f.items() if k != "timestamp"}) for t, f in _drained(outbox)]
    assert sent == [
        ("task-succeeded", {"uuid": "job/p1/r0", "result": "'stored'", "runtime": 3.0}),
        ("task-failed", {"uuid": "job/p1/r0", "exception": task_events.FAILED_OUTCOMES["dead"], "runtime": 3.0}),
        ("task-rejected", {"uuid": "job/p1/r0", "requeue": True, "runtime": 3.0}),
    ]


def test_the_outbox_keeps_the_order_and_is_bounded() -> None:
    box = task_events.EventOutbox(limit=3)
    for i in range(5):
        box.put("task-received", uuid=str(i))
    assert [f["uuid"] for _, f in _drained(box)] == ["2", "3", "4"] and len(box) == 0


def test_a_dead_letters_failure_row_names_its_reason(outbox: task_events.EventOutbox) -> None:
    clock = task_events.TaskClock("job/p1/r0", taken=10.0, sent=11.0, done=14.0)
    task_events.context_for(clock).run(task_events.note_refusal, "bad_output: finish_reason abort")
    task_events.note_refusal("outside any delivery: nothing")
    QuietRequest.send_event(_request(clock), "task-succeeded", result="'dead'", runtime=0.0001)
    [(kind, fields)] = _drained(outbox)
    assert kind == "task-failed" and "bad_output: finish_reason abort" in fields["exception"]
