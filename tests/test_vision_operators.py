"""Image prompts through the operator commands that rebuild a message from a stored row (issue 44 part 2).

``producer retry --truncated`` and the chain replay of a re-submit (after ``producer purge --force``) rebuild a
prompt's message from its row: the message must carry the row's images again (their sha256s, store references,
token counts and placeholder positions), or its content hash cannot match and the server gets placeholders with no
``image_data``. Given real workers and the simulator (which counts each request's placeholders against its images
and expands them: a row's ``prompt_tokens`` and ``expanded_input_ids`` say the images were received), every
re-run ends as a row at its new revision — never as a ``content_hash_mismatch`` dead letter — and verify passes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from storage.reader import read_committed
from storage.schema import EXPANDED_INPUT_IDS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.images import png_data_uri as uri
from testing.images import random_png as png
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.vision import ImageRef, expand_ids

MEDIA_PAD = 163605  # the Kimi test tokenizer's <|media_pad|>
PROMPTS = 12
CONVERSATIONS, TURNS = 4, 3
SIM_ARGS = ("--time-scale", "400", "--sglang-version", "0.5.23")


@pytest.fixture(scope="module")
def tok() -> Path:
    return Path(build_test_tokenizer(default_test_tokenizer_dir()))


def _image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": uri(data)}}


def _image_prompts(path: Path) -> tuple[Path, dict[str, list[bytes]]]:
    """12 image + text prompts over 3 images (one or two each, shared across prompts)."""
    pool = [png(64, 48, 1), png(120, 80, 2), png(40, 40, 3)]
    images = {f"p{i}": [pool[i % 3]] if i % 2 else [pool[i % 3], pool[(i + 1) % 3]] for i in range(PROMPTS)}
    rows = [
        {"id": k, "messages": [{"role": "user", "content": [*map(_image_part, v), {"type": "text", "text": f"Q{k}?"}]}]}
        for k, v in images.items()
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, images


def _image_conversations(path: Path) -> Path:
    """Three user turns each, images in turns 0 and 1."""
    a, b, c = png(64, 48, 11), png(96, 64, 12), png(40, 40, 13)
    rows = []
    for i in range(CONVERSATIONS):
        first, second = ([a], [b]) if i % 2 else ([a, c], [])
        rows.append({"id": f"c{i}", "messages": [
            {"role": "user", "content": [*map(_image_part, first), {"type": "text", "text": f"Describe {i}."}]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [*map(_image_part, second), {"type": "text", "text": "And now?"}]},
            {"role": "assistant", "content": "Another."},
            {"role": "user", "content": f"Which one, {i}?"},
        ]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _submit_args(data: Path, job: str, tok: Path, *extra: str) -> tuple[str, ...]:
    return (
        "submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1", "--no-progress",
        "--context-length", "131072", *extra,
    )  # fmt: skip


def _assert_images_received(row: dict[str, Any]) -> None:
    """The server expanded each placeholder of the row into its image's tokens: it received every image."""
    ids = row["input_ids"]
    positions = [i for i, t in enumerate(ids) if t == MEDIA_PAD]
    assert row[IMAGE_POSITIONS] == positions and positions, row["prompt_id"]
    assert row["prompt_tokens"] == len(ids) - len(positions) + sum(row[IMAGE_TOKENS]), row["prompt_id"]
    refs = [ImageRef(s, "x", "image/png", 1, 1, n, p) for s, n, p in
            zip(row[IMAGE_SHA256], row[IMAGE_TOKENS], positions, strict=True)]  # fmt: skip
    assert row[EXPANDED_INPUT_IDS] == expand_ids(ids, refs), row["prompt_id"]


def _wait(settings: Any, job: str) -> None:
    waited = producer_cli(settings, "wait", job, "--timeout", "150", "--interval", "0.5", "--json", timeout_s=170)
    assert waited.returncode == 0, f"wait exited {waited.returncode}: {waited.stdout[-2000:]} {waited.stderr}"


def _verify(settings: Any, job: str) -> None:
    verified = producer_cli(settings, "verify", job, "--json")
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr


@pytest.mark.timeout(300)
def test_retry_truncated_image_prompts_resends_their_images(redis_url: str, tmp_path: Path, tok: Path) -> None:
    # Given 12 image prompts whose answers were all cut by an 8-token budget
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    data, images = _image_prompts(tmp_path / "vision.jsonl")
    submitted = producer_cli(settings, *_submit_args(data, "vretry", tok, "--max-new-tokens", "8"))
    assert submitted.returncode == 0, submitted.stderr
    with simulator(tmp_path / "logs", *SIM_ARGS, "--tokenizer", str(tok)) as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
        try:
            _wait(settings, "vretry")
            first = read_committed(settings.output_uri, "vretry").to_pylist()
            assert len(first) == PROMPTS and {r["finish_reason"] for r in first} == {"length"}
            # When they are re-run with a larger budget
            retried = producer_cli(settings, "retry", "vretry", "--truncated", "--max-new-tokens", "300", "--json")
            assert retried.returncode == 0, retried.stdout + retried.stderr
            assert json.loads(retried.stdout)["requeued"] == PROMPTS
            _wait(settings, "vretry")
        finally:
            worker.terminate()
    # Then every prompt is stored at revision 1, none dead-lettered, its images sent again, and verify passes
    assert dead_letters(client, settings.keys, "vretry") == {}
    rows = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vretry").to_pylist()}
    assert sorted(rows) == sorted(f"vision/{k}" for k in images)
    for key, imgs in images.items():
        row = rows[f"vision/{key}"]
        assert row["revision"] == 1, key
        assert row[IMAGE_SHA256] == [hashlib.sha256(d).hexdigest() for d in imgs]
        _assert_images_received(row)
    assert job_progress(client, settings.keys, "vretry")["done"] == PROMPTS
    _verify(settings, "vretry")


@pytest.mark.timeout(400)
def test_purge_and_the_same_submit_resume_image_conversations(redis_url: str, tmp_path: Path, tok: Path) -> None:
    # Given image conversations (--turns all) run by a worker, then purged (--force) with every turn stored
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    data = _image_conversations(tmp_path / "chat.jsonl")
    args = _submit_args(data, "vconv", tok, "--max-new-tokens", "120", "--turns", "all")
    total = CONVERSATIONS * TURNS
    with simulator(tmp_path / "logs", *SIM_ARGS, "--tokenizer", str(tok)) as sim:
        env = fast_env(settings, sim, max_inflight=4)
        first = WorkerProcess("w1", env, tmp_path / "logs").start()
        try:
            submitted = producer_cli(settings, *args)
            assert submitted.returncode == 0, submitted.stderr
            _wait(settings, "vconv")
        finally:
            first.terminate()
        before = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vconv").to_pylist()}
        assert len(before) == total
        purged = producer_cli(settings, "purge", "vconv", "--force")
        assert purged.returncode == 0, purged.stdout + purged.stderr
        # When the same submit runs again (each conversation's head replayed from its stored row)
        second = WorkerProcess("w2", env, tmp_path / "logs").start()
        try:
            again = producer_cli(settings, *args, "--json")
            assert again.returncode == 0, again.stdout + again.stderr
            assert json.loads(again.stdout)["resumed"] == CONVERSATIONS
            wait_until(
                lambda: job_progress(client, settings.keys, "vconv")["done"] == total,
                180,
                what=f"{total} turns done again",
                explain=lambda: second.tail() + str(dead_letters(client, settings.keys, "vconv")),
            )
            _wait(settings, "vconv")
        finally:
            second.terminate()
    # Then every turn is stored once as before, none dead, and verify passes
    assert dead_letters(client, settings.keys, "vconv") == {}
    after = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vconv").to_pylist()}
    assert sorted(after) == sorted(before)
    for pid, row in after.items():
        assert row[IMAGE_SHA256] == before[pid][IMAGE_SHA256], pid
        if row[IMAGE_SHA256]:
            _assert_images_received(row)
    _verify(settings, "vconv")


def test_retry_of_a_dead_letter_stripped_of_its_images_is_refused_at_the_producer(
    redis_url: str, tmp_path: Path
) -> None:
    import asyncio
    import time

    import redis.asyncio as aioredis

    from thinkfleet.message import PromptTask, content_hash, pack_ids
    from thinkfleet.state.job import JobRecord
    from thinkfleet.state.ledger import Ledger

    # Given a dead letter whose message lost its images (an older retry --truncated rebuilt it without them): its
    # content hash covers the image, its message carries none
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    keys, job = settings.keys, "vdead"
    client = redis.Redis.from_url(redis_url)
    record = JobRecord(name=job, created_at=time.time())
    record.datasets, record.prompts = {"vision": 1}, 1
    record.save(client, keys)
    ids = [5, 163605, 6]
    stripped = PromptTask(job, "vision", "vision/p0", 0, content_hash(ids, ["ab" * 32]), pack_ids(ids))

    async def dead_letter() -> None:
        r = aioredis.from_url(redis_url)
        await r.set(keys.heartbeat("w1"), "1")
        ledger = Ledger(r, keys, "w1")
        await ledger.claim(job, stripped.prompt_id)
        assert await ledger.dead_letter(stripped, "content_hash_mismatch", "the ids hash to …", attempts=0)
        await r.aclose()

    asyncio.run(dead_letter())
    # When it is retried
    retried = producer_cli(settings, "retry", job, "--json")
    # Then it is refused at the producer, named with the fix, and stays a dead letter: nothing is queued
    assert retried.returncode == 1, retried.stdout + retried.stderr
    assert json.loads(retried.stdout)["requeued"] == 0
    assert "vision/p0" in retried.stderr and "content_hash_mismatch" in retried.stderr and "re-submit" in retried.stderr
    assert list(dead_letters(client, keys, job)) == ["vision/p0"]
    assert client.llen(settings.queue) == 0


@pytest.mark.timeout(400)
def test_redis_lost_and_the_same_submit_resume_image_conversations(tmp_path: Path, tok: Path) -> None:
    from testing.services import RedisServer

    # Given image conversations (--turns all) run to the end, then Redis lost entirely (an empty one in its place)
    (tmp_path / "logs").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    try:
        settings = isolated_settings(server.url(), str(tmp_path / "out"), alarm_min_rows=2)
        client = redis.Redis.from_url(server.url())
        data = _image_conversations(tmp_path / "chat.jsonl")
        args = _submit_args(data, "vlost", tok, "--max-new-tokens", "120", "--turns", "all")
        total = CONVERSATIONS * TURNS
        with simulator(tmp_path / "logs", *SIM_ARGS, "--tokenizer", str(tok)) as sim:
            worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
            try:
                submitted = producer_cli(settings, *args)
                assert submitted.returncode == 0, submitted.stderr
                _wait(settings, "vlost")
                before = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vlost").to_pylist()}
                assert len(before) == total
                server.stop(kill=True)
                server.start()
                worker.wait_ready(client, settings.keys)
                # When the same submit runs again (each conversation's head replayed from its stored row)
                again = producer_cli(settings, *args, "--json")
                assert again.returncode == 0, again.stdout + again.stderr
                assert json.loads(again.stdout)["resumed"] == CONVERSATIONS
                _wait(settings, "vlost")
            finally:
                worker.terminate()
        # Then every turn is stored once as before, none dead, and verify passes
        assert dead_letters(client, settings.keys, "vlost") == {}
        after = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vlost").to_pylist()}
        assert sorted(after) == sorted(before)
        for pid, row in after.items():
            assert row[IMAGE_SHA256] == before[pid][IMAGE_SHA256], pid
            if row[IMAGE_SHA256]:
                _assert_images_received(row)
        assert job_progress(client, settings.keys, "vlost")["done"] == total
        _verify(settings, "vlost")
    finally:
        server.stop()
