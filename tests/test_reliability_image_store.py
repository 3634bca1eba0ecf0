"""Reliability of the image store (issue 43, faults 4 and 5): an image that cannot be read ends its own prompt only
after a bound, with a reason an operator can act on (and ``producer retry`` of it works once fixed); a host that
cannot read the store at all closes a gate that ``producer status`` names, hands its image prompts back without
dead-lettering any, and goes on with its text prompts while another host does the image work; and a worker's image
bytes in flight are charged to its budget before any image is read.

Real redis-server, real ``celery worker`` processes, real HTTP to sglang-sim (one for the module: its answers depend
only on the prompt), the CLI's commands for submit, wait, status, verify and retry, in this process (click's runner:
none of these scenarios is about the producer's process) (workers/images.py, workers/image_store.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.images import png_data_uri, random_png
from testing.record import Outcome, record_result
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.settings import Settings
from thinkfleet.vision import ImageRef
from workers.image_store import ImageBudget
from workers.images import IMAGE_UNREADABLE, ImageSender

TEXT_ROWS = 4
IMAGE_ROWS = 4
#: Image hand-backs allowed before image_unreadable, and the backoff cap, for these scenarios (small: fast tests).
HANDBACK_MAX = 3
BACKOFF_MAX_S = 0.5


def image_dataset(path: Path) -> dict[str, bytes]:
    """Text rows and image rows of one distinct image each; returns each image row's image."""
    images = {f"i{k}": random_png(48 + 8 * k, 40, 10 + k) for k in range(IMAGE_ROWS)}
    rows: list[dict[str, Any]] = [
        {"id": f"t{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}]}
        for i in range(TEXT_ROWS)
    ]
    for rid, data in images.items():
        part = {"type": "image_url", "image_url": {"url": png_data_uri(data)}}
        rows.append({"id": rid, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return images


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """A ``producer`` command in this process (a new interpreter costs ≈ 1.5-4 CPU-s on the 2-core CI box)."""
    return producer_cli(settings, *args, in_process=True)


@pytest.fixture(scope="module")
def tok() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="module")
def image_sim(tmp_path_factory: pytest.TempPathFactory, tok: Path) -> Iterator[str]:
    """One simulator for the module's scenarios (each has its own Redis DB and workers; none stops the server)."""
    with simulator(tmp_path_factory.mktemp("image-sim"), "--time-scale", "400", "--tokenizer", str(tok)) as url:
        yield url


def submit(settings: Settings, data: Path, tok: Path, job: str) -> None:
    args = ("submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1", "--no-progress")
    done = cli(settings, *args, "--max-new-tokens", "64", "--context-length", "131072")
    assert done.returncode == 0, done.stderr


def store_file(out: Path, data: bytes) -> Path:
    return next(out.rglob(f"{hashlib.sha256(data).hexdigest()}.png"))


def image_env(settings: Settings, sim: str, **extra: object) -> dict[str, str]:
    values: dict[str, object] = {"image_handback_max": HANDBACK_MAX, "image_backoff_max_s": BACKOFF_MAX_S, **extra}
    return fast_env(settings, sim, max_inflight=4, **values)


def outcome_of(settings: Settings, job: str, total: int, expected_dead: int) -> Outcome:
    """What verify and status say after the job (the rows' ids are the simulator's: checked by the vision tests)."""
    client = redis.Redis.from_url(settings.redis_url)
    verify = cli(settings, "verify", job, "--json")
    try:
        verify_ok = verify.returncode == 0 and bool(json.loads(verify.stdout).get("ok"))
    except ValueError:
        verify_ok = False
    st = json.loads(cli(settings, "status", job, "--json").stdout or "{}")
    progress = job_progress(client, settings.keys, job)
    want = {"total": total, "done": total - expected_dead, "dead": expected_dead, "finished": True}
    status_agrees = {k: st.get(k) for k in want} == want
    problems = [] if verify_ok else [f"producer verify failed: {verify.stdout[-2000:]} {verify.stderr[-1000:]}"]
    if not status_agrees:
        problems.append(f"producer status {json.dumps({k: st.get(k) for k in want})} != {want}")
    return Outcome(
        submitted=total,
        stored=progress["done"],
        dead=progress["dead"],
        lost=[],
        duplicated=[],
        altered=[],
        verify_ok=verify_ok,
        status_agrees=status_agrees,
        problems=problems,
    )


@pytest.mark.timeout(300)
def test_an_unreadable_image_is_dead_lettered_only_after_its_bound_and_retried_once_fixed(
    redis_url: str, tmp_path: Path, tok: Path, image_sim: str
) -> None:
    # Given an image job one of whose store files was replaced by a directory after submit (root cannot be refused
    # a read by chmod: a directory in a file's place is unreadable to every user)
    started = time.monotonic()
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    images = image_dataset(tmp_path / "data.jsonl")
    submit(settings, tmp_path / "data.jsonl", tok, "unr")
    broken = store_file(tmp_path / "out", images["i0"])
    broken.unlink()
    broken.mkdir()
    total = TEXT_ROWS + IMAGE_ROWS
    worker = WorkerProcess("w1", image_env(settings, image_sim), tmp_path / "logs").start()
    try:
        # When a worker runs the job
        wait = cli(settings, "wait", "unr", "--timeout", "180", "--interval", "0.5")
        dead = dead_letters(client, settings.keys, "unr")
        logs = worker.log_path.read_text()
        # one warning a counted hand-back (workers/images.py)
        tries = sum("data/i0: image" in line and "handed back in" in line for line in logs.splitlines())
        # Then the job finishes with that one prompt dead-lettered image_unreadable after exactly the bound's
        # hand-backs, its reason naming the file and what to do; every other prompt is stored
        assert wait.returncode == 0, wait.stdout + wait.stderr + logs
        assert list(dead) == ["data/i0"], dead
        text = json.dumps(dead["data/i0"])
        assert IMAGE_UNREADABLE in text and str(broken) in text
        assert "producer retry" in text and "IsADirectoryError" in text
        assert f"{HANDBACK_MAX} tries" in text and tries == HANDBACK_MAX - 1, logs[-3000:]
        # and status and verify agree: 7 stored, 1 dead, verify failing on that one image and nothing else
        first = outcome_of(settings, "unr", total, 1)
        assert first.status_agrees, first.problems
        report = json.loads(cli(settings, "verify", "unr", "--json").stdout)
        assert [p.split(" (prompt ")[0] for p in report["image_problems"]] == [str(broken)], report
        assert report["permanent_failures"] == ["data/i0"] and report["stored_rows"] == total - 1
        # When the operator puts the image back and retries the dead letters
        broken.rmdir()
        broken.write_bytes(images["i0"])
        retried = cli(settings, "retry", "unr")
        assert retried.returncode == 0, retried.stderr
        wait = cli(settings, "wait", "unr", "--timeout", "120", "--interval", "0.5")
    finally:
        worker.terminate()
    # Then it is stored, and the job is whole
    assert wait.returncode == 0, wait.stdout + wait.stderr + worker.tail()
    assert dead_letters(client, settings.keys, "unr") == {}
    outcome = outcome_of(settings, "unr", total, 0)
    record_result(
        "an image file unreadable while its store is readable",
        outcome,
        f"one of {IMAGE_ROWS} store images replaced by a directory; image_handback_max {HANDBACK_MAX}",
        [],
        time.monotonic() - started,
        notes=f"dead-lettered image_unreadable at try {HANDBACK_MAX} ({tries} counted hand-backs before it); "
        "stored by producer retry once the file was put back",
    )
    outcome.assert_clean()


@pytest.mark.timeout(360)
def test_a_host_without_the_store_closes_its_gate_and_the_other_host_does_the_image_work(
    redis_url: str, tmp_path: Path, tok: Path, image_sim: str
) -> None:
    # Given an image job, and a worker "blind" that mounts no image store (THINKFLEET_IMAGE_STORE_MAP points the
    # recorded store path at a directory this host lacks, as a host without the mount sees it)
    started = time.monotonic()
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    images = image_dataset(tmp_path / "data.jsonl")
    submit(settings, tmp_path / "data.jsonl", tok, "gate")
    total = TEXT_ROWS + IMAGE_ROWS
    remap = {"image_store_map": f"{tmp_path / 'out'}={tmp_path / 'not-mounted'}"}
    blind = WorkerProcess("blind", image_env(settings, image_sim, **remap), tmp_path / "logs").start()
    seeing = WorkerProcess("seeing", image_env(settings, image_sim), tmp_path / "logs")
    try:
        # When the blind worker runs alone first: it stores the text prompts, and hands every image prompt back
        wait_until(
            lambda: job_progress(client, keys, "gate")["done"] == TEXT_ROWS,
            120,
            what="the blind worker stored the text prompts",
            explain=blind.tail,
        )
        # and producer status names its closed gate (the worker publishes it with its heartbeat: a moment after)
        gates: list[dict[str, Any]] = []

        def gate_shown() -> bool:
            gates[:] = json.loads(cli(settings, "status", "gate", "--json").stdout)["image_store_gates"]
            return bool(gates)

        wait_until(gate_shown, 120, what="producer status naming the blind worker's gate", explain=blind.tail)
        text_view = cli(settings, "status", "gate").stdout
        handed_back = blind.log_path.read_text().count("closed here")
        assert dead_letters(client, keys, "gate") == {}, "no dead letter while the store's gate is closed"
        # and a worker that reads the store joins
        seeing.start()
        wait = cli(settings, "wait", "gate", "--timeout", "180", "--interval", "0.5")
        gates_after = json.loads(cli(settings, "status", "gate", "--json").stdout)["image_store_gates"]
    finally:
        for w in (blind, seeing):
            if w.starts:
                w.terminate()
    outcome = outcome_of(settings, "gate", total, 0)
    record_result(
        "a host without the image store (one of two workers)",
        outcome,
        "one worker's store path not mounted (THINKFLEET_IMAGE_STORE_MAP to a missing directory)",
        [],
        time.monotonic() - started,
        workers=2,
        notes=f"its gate closed and named by producer status; {handed_back} image hand-backs there, 0 dead letters",
    )
    # Then the seeing worker did the image work: every prompt stored once, nothing dead-lettered
    assert wait.returncode == 0, wait.stdout + wait.stderr + blind.tail() + seeing.tail()
    assert dead_letters(client, keys, "gate") == {}
    outcome.assert_clean()
    # and producer status named the blind worker's closed gate (JSON and text) while it lived, with its reason
    store = str(store_file(tmp_path / "out", images["i0"]).parent.parent)
    assert [(g["worker"], g["store"]) for g in gates] == [("blind", store)], gates
    assert "no such directory on this host" in gates[0]["reason"] and "THINKFLEET_IMAGE_STORE_MAP" in gates[0]["reason"]
    assert "cannot read the image store" in text_view and "blind" in text_view
    assert [g["worker"] for g in gates_after] == ["blind"]
    assert handed_back >= 1, "the blind worker was offered image prompts and handed them back"


def _sender_and_prompt(tmp_path: Path, budget: int, n_images: int) -> tuple[ImageSender, Any, Any, list[int], Path]:
    """An ImageSender over a store of ``n_images`` PNGs, and one prompt (task, job, ids) per image, duck-typed."""
    root = tmp_path / "store"
    refs = []
    for k in range(n_images):
        data = random_png(64, 64, 100 + k)
        sha = hashlib.sha256(data).hexdigest()
        (root / sha[:2]).mkdir(parents=True, exist_ok=True)
        (root / sha[:2] / f"{sha}.png").write_bytes(data)
        refs.append(ImageRef(sha, str(root / sha[:2] / f"{sha}.png"), "image/png", 64, 64, 10, 1))
    record = SimpleNamespace(image_store=str(root), image_placeholder_id=7)
    job = SimpleNamespace(record=record, name="budget", generation="")
    tasks = [SimpleNamespace(job="budget", prompt_id=f"p{k}", media=(ref,)) for k, ref in enumerate(refs)]
    sender = ImageSender(Settings(image_inflight_bytes=budget, image_cache_bytes=0))
    return sender, tasks, job, [1, 7, 2], root


def test_image_bytes_in_flight_are_taken_before_the_images_are_read_and_given_back_when_the_request_ends(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        # Given a worker's image budget that holds one image's encoded bytes, and two prompts of one image each
        sender, tasks, job, ids, _ = _sender_and_prompt(tmp_path, 1, 2)
        one = await sender.prepare(tasks[0], job, ids, None)
        assert one.held_bytes == len(one.image_data[0]) and sender.inflight.held == one.held_bytes
        assert sender.reads == 1
        # When the second prompt asks while the first request holds the budget: it waits, and reads nothing
        second = asyncio.ensure_future(sender.prepare(tasks[1], job, ids, None))
        await asyncio.sleep(0.2)
        assert not second.done() and sender.reads == 1, "the second prompt's image is not read before it fits"
        # Then the first request's end lets it in (alone: it is larger than the whole budget, and never deadlocks)
        sender.release(one)
        two = await asyncio.wait_for(second, 30)
        assert sender.reads == 2 and sender.inflight.held == two.held_bytes
        sender.release(two)
        assert sender.inflight.held == 0 and sender.inflight.peak == max(one.held_bytes, two.held_bytes)

    asyncio.run(scenario())


def test_image_budget_grants_in_order_and_survives_a_cancelled_waiter() -> None:
    async def scenario() -> None:
        budget = ImageBudget(100)
        a = await budget.take(60)
        waiting_big = asyncio.ensure_future(budget.take(80))  # first in line
        waiting_small = asyncio.ensure_future(budget.take(10))  # fits, but waits its turn (no starvation of big ones)
        await asyncio.sleep(0.05)
        assert not waiting_big.done() and not waiting_small.done()
        waiting_big.cancel()
        await asyncio.sleep(0.05)
        assert waiting_small.done() and budget.held == 70  # the cancelled waiter left the line
        budget.give(a)
        budget.give(await waiting_small)
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_store_the_worker_cannot_read_closes_its_gate_without_a_dead_letter(tmp_path: Path) -> None:
    async def scenario() -> None:
        # Given a store whose root is gone on this host (the mount missing)
        sender, tasks, job, ids, root = _sender_and_prompt(tmp_path, 1 << 20, 1)
        shutil.rmtree(root)
        changes: list[dict[str, Any]] = []
        sender.gates.on_change = lambda: changes.append(sender.gates.closed())
        sender.settings = Settings(image_backoff_max_s=0.05)
        sender.gates.settings = sender.settings
        # When a prompt of it is prepared: it is handed back (HandBack), never dead-lettered, and the gate names why
        from workers.attempts import HandBack

        with pytest.raises(HandBack):
            await sender.prepare(tasks[0], job, ids, None)
        assert list(sender.gates.closed()) == [str(root)]
        assert "no such directory on this host" in sender.gates.closed()[str(root)]["reason"]
        assert sender.reads == 0 and sender.inflight.held == 0
        # Then once the store is back the gate opens by itself at its next check
        root.mkdir()
        await asyncio.sleep(0.06)
        assert await sender.gates.check(str(root)) is None
        assert sender.gates.closed() == {} and changes[-1] == {}

    asyncio.run(scenario())


def test_image_hand_backs_are_counted_per_prompt_and_per_worker_in_redis(redis_url: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        import redis.asyncio as aioredis

        from workers.image_store import HandBacks

        # Given two workers' hand-back counters over one job's state
        settings = isolated_settings(redis_url, str(tmp_path / "out"))
        client = aioredis.Redis.from_url(redis_url)
        one, two = HandBacks(client, settings, "w1"), HandBacks(client, settings, "w2")
        try:
            # When w1 finds a prompt's image missing twice and w2 once: the tries add up, the workers count once each
            assert await one.count("j", "d/p0", "missing", "") == (1, 1)
            assert await one.count("j", "d/p0", "missing", "") == (2, 1)
            assert await two.count("j", "d/p0", "missing", "") == (3, 2)
            # and an unreadable image is counted apart, on the same deliveries record as the prompt's crashes
            assert await two.count("j", "d/p0", "unreadable", "") == (1, 1)
            record = json.loads(await client.hget(settings.keys.deliveries("j"), "d/p0"))
            assert (record["x"], record["im"], record["imw"], record["iu"]) == (0, 3, ["w1", "w2"], 1)
            # Then a prompt already stored counts nothing (its next delivery finds it done), nor does another
            # generation's run of the job
            await client.sadd(settings.keys.done("j"), "d/p1")
            assert await one.count("j", "d/p1", "missing", "") == (0, 0)
            await client.hset(settings.keys.job("j"), "generation", json.dumps("g2"))
            assert await one.count("j", "d/p0", "missing", "g1") == (0, 0)
        finally:
            await client.aclose()

    asyncio.run(scenario())


@pytest.mark.timeout(360)
def test_an_image_missing_on_one_host_is_read_on_another_and_missing_on_every_host_is_dead_lettered(
    redis_url: str, tmp_path: Path, tok: Path, image_sim: str
) -> None:
    # Given an image job, a worker "partial" whose copy of the store (THINKFLEET_IMAGE_STORE_MAP) lacks images i0 and
    # i1, and the store itself lacking i1: i0 can be read on one host only, i1 on none
    started = time.monotonic()
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    keys = settings.keys
    images = image_dataset(tmp_path / "data.jsonl")
    submit(settings, tmp_path / "data.jsonl", tok, "miss")
    root = store_file(tmp_path / "out", images["i0"]).parent.parent
    copy = tmp_path / "copy" / "_images"
    shutil.copytree(root, copy)
    for key in ("i0", "i1"):
        store_file(tmp_path / "copy", images[key]).unlink()
    store_file(tmp_path / "out", images["i1"]).unlink()
    total = TEXT_ROWS + IMAGE_ROWS
    # (many tries allowed: here the bound that ends i1 is the distinct workers, THINKFLEET_IMAGE_MISSING_WORKERS=2)
    env = {"image_handback_max": 1000, "image_missing_workers": 2}
    partial = WorkerProcess(
        "partial", image_env(settings, image_sim, image_store_map=f"{root}={copy}", **env), tmp_path / "logs"
    ).start()
    seeing = WorkerProcess("seeing", image_env(settings, image_sim, **env), tmp_path / "logs")
    try:
        # When the partial worker runs alone first, and finds both images missing
        def missed(key: str) -> bool:
            return f"data/{key}: image" in partial.log_path.read_text()

        wait_until(
            lambda: missed("i0") and missed("i1"), 120, what="i0 and i1 missing on partial", explain=partial.tail
        )
        assert dead_letters(client, keys, "miss") == {}, "one worker's miss dead-letters nothing"
        # and a worker whose store has i0 (not i1) joins
        seeing.start()
        wait = cli(settings, "wait", "miss", "--timeout", "180", "--interval", "0.5")
        dead = dead_letters(client, keys, "miss")
    finally:
        for w in (partial, seeing):
            if w.starts:
                w.terminate()
    outcome = outcome_of(settings, "miss", total, 1)
    outcome.verify_ok = True  # verify fails on i1's missing file, checked below: the dead letter's own cause
    outcome.problems = [p for p in outcome.problems if not p.startswith("producer verify failed")]
    record_result(
        "an image missing on one of two hosts, and one missing on both",
        outcome,
        "one worker's store copy lacks 2 images; the store itself lacks 1 of them",
        [],
        time.monotonic() - started,
        workers=2,
        notes="the other host read the first; the second dead-lettered image_missing once 2 workers found it missing",
    )
    # Then i0 was stored by the seeing worker, and i1 dead-lettered image_missing once both workers found it missing
    assert wait.returncode == 0, wait.stdout + wait.stderr + partial.tail() + seeing.tail()
    assert list(dead) == ["data/i1"], dead
    text = json.dumps(dead["data/i1"])
    assert "image_missing" in text and "by 2 worker(s)" in text and "producer retry" in text
    assert job_progress(client, keys, "miss")["done"] == total - 1
    report = json.loads(cli(settings, "verify", "miss", "--json").stdout)
    assert [p.split(" (prompt ")[0] for p in report["image_problems"]] == [str(store_file_path(root, images["i1"]))]
    outcome.assert_clean()


def store_file_path(root: Path, data: bytes) -> Path:
    sha = hashlib.sha256(data).hexdigest()
    return root / sha[:2] / f"{sha}.png"
