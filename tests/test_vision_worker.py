"""Image prompts through real workers and the simulator: each image read from the job's store, checked and sent as a
``data:`` URI beside its one placeholder; every row keeps its images, their token counts and placeholder positions
(and, from SGLang 0.5.13, the server's expanded ids); each prompt stored exactly once through a SIGKILL; and what
cannot be sent as submitted (an altered store file, a server that counts the images otherwise, a model without
image understanding) ends as a dead letter saying why — never as a row."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from storage.checks import hash_mismatches, image_problems
from storage.reader import read_committed
from storage.schema import (
    EXPANDED_INPUT_IDS,
    IMAGE_PATHS,
    IMAGE_POSITIONS,
    IMAGE_SHA256,
    IMAGE_TOKENS,
    rows_to_table,
)
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, sim_stats, simulator
from testing.images import png_data_uri as uri
from testing.images import random_png as png
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import failpoints
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.vision import ImageRef, expand_ids, load_rule
from workers.images import IMAGE_HASH_MISMATCH, IMAGES_UNSUPPORTED
from workers.rows import image_columns

PLACEHOLDER = {"kimi": 163605, "qwen3": 151655}
TEXT_ROWS = 4


def mixed_dataset(path: Path) -> tuple[Path, dict[str, list[bytes]]]:
    """Text rows and image rows: one image, two images in one turn, and one image shared by two rows (read from a
    relative path by one of them). Returns the file and each image row's images in order."""
    (path.parent / "imgs").mkdir(exist_ok=True)
    shared = png(96, 64, 7)
    (path.parent / "imgs" / "shared.png").write_bytes(shared)
    images = {"i0": [png(64, 48, 1)], "i1": [png(320, 200, 2), png(40, 40, 3)], "i2": [shared], "i3": [shared]}
    rows: list[dict[str, Any]] = [
        {"id": f"t{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}]}
        for i in range(TEXT_ROWS)
    ]
    for rid, imgs in images.items():
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": uri(d)}} for d in imgs]
        if rid == "i3":
            parts = [{"type": "image", "image": "imgs/shared.png"}]
        rows.append({"id": rid, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, images


def submit(settings: Any, data: Path, tok: Path, job: str, *extra: str) -> None:
    args = ("submit", str(data), "--job", job, "--tokenizer", str(tok), "--processes", "1", "--no-progress")
    submitted = producer_cli(settings, *args, "--max-new-tokens", "200", "--context-length", "131072", *extra)
    assert submitted.returncode == 0, submitted.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "version"), [("kimi", "0.5.23"), ("qwen3", "0.5.9")])
def test_image_job_stores_every_prompt_once_with_its_images_through_a_sigkill(
    redis_url: str, tmp_path: Path, family: str, version: str
) -> None:
    # Given a mixed text/image dataset submitted with the family's test tokenizer (its preprocessor_config.json)
    (tmp_path / "logs").mkdir()
    fp_dir = tmp_path / "failpoints"
    fp_dir.mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    tok = build_test_tokenizer(default_test_tokenizer_dir(family=family), family=family)
    data, images = mixed_dataset(tmp_path / "mixed.jsonl")
    submit(settings, data, tok, "vis")
    total = TEXT_ROWS + len(images)
    sim_args = ["--time-scale", "400", "--sglang-version", version, "--tokenizer", str(tok)]
    if family != "kimi":
        sim_args += ["--model-family", family]
    with simulator(tmp_path / "logs", *sim_args) as sim:
        # When a worker is SIGKILLed while an image prompt's request is in flight, and another takes over
        env = fast_env(settings, sim, max_inflight=4, lease_s=3, reaper_interval_s=0.5)
        doomed = {**env, failpoints.ENV: "during_generate=kill@mixed/i1", failpoints.DIR_ENV: str(fp_dir)}
        doomed.pop(failpoints.TIMES_ENV, None)
        w1 = WorkerProcess("w1", doomed, tmp_path / "logs").start()
        w2 = WorkerProcess("w2", env, tmp_path / "logs")
        try:
            wait_until(lambda: w1.proc.poll() is not None, 120, what="w1 killed by its failpoint", explain=w1.tail)
            w2.start()
            wait_until(
                lambda: job_progress(client, settings.keys, "vis")["done"] == total,
                180,
                what=f"{total} prompts stored",
                explain=lambda: w2.tail() + str(dead_letters(client, settings.keys, "vis")),
            )
        finally:
            for w in (w1, w2):
                if w.starts:
                    w.terminate()
    assert list(fp_dir.iterdir()), "the failpoint fired: w1 was killed mid-generate"
    # Then every prompt is stored exactly once, none dead-lettered
    assert dead_letters(client, settings.keys, "vis") == {}
    stored = read_committed(settings.output_uri, "vis").to_pylist()
    keys = [*images, *(f"t{i}" for i in range(TEXT_ROWS))]
    assert sorted(r["prompt_id"] for r in stored) == sorted(f"mixed/{k}" for k in keys)
    rule = load_rule(str(tok))
    pad = PLACEHOLDER[family]
    for row in stored:
        key = row["prompt_id"].split("/")[1]
        ids = row["input_ids"]
        if key.startswith("t"):
            assert row[IMAGE_SHA256] is None and row[EXPANDED_INPUT_IDS] is None
            assert row["prompt_tokens"] == len(ids)
            continue
        want = images[key]
        # one placeholder per image, at the positions the row names, the images' own sha256s and counts
        positions = row[IMAGE_POSITIONS]
        assert [i for i, t in enumerate(ids) if t == pad] == positions and len(positions) == len(want)
        assert row[IMAGE_SHA256] == [hashlib.sha256(d).hexdigest() for d in want]
        sizes = [_size(d) for d in want]
        assert row[IMAGE_TOKENS] == [rule.tokens(w, h) for w, h in sizes]
        # the server's prompt_tokens is the expanded length
        assert row["prompt_tokens"] == len(ids) - len(want) + sum(row[IMAGE_TOKENS])
        for path, d in zip(row[IMAGE_PATHS], want, strict=True):
            assert Path(path).read_bytes() == d  # the store keeps the dataset's bytes
        refs = [ImageRef(s, p, "image/png", 1, 1, n, q) for s, p, n, q in
                zip(row[IMAGE_SHA256], row[IMAGE_PATHS], row[IMAGE_TOKENS], positions, strict=True)]  # fmt: skip
        if version == "0.5.23":  # the server returned the ids it ran: each placeholder expanded, nothing else
            assert row[EXPANDED_INPUT_IDS] == expand_ids(ids, refs)
        else:
            assert row[EXPANDED_INPUT_IDS] is None
    # and producer verify agrees
    verified = producer_cli(settings, "verify", "vis", "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


@pytest.mark.timeout(240)
def test_an_altered_store_image_and_a_miscounting_server_end_as_dead_letters(redis_url: str, tmp_path: Path) -> None:
    # Given an image job whose store file of one image was replaced after submit
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    data, images = mixed_dataset(tmp_path / "mixed.jsonl")
    submit(settings, data, tok, "bad")
    altered = hashlib.sha256(images["i0"][0]).hexdigest()
    store_file = next((tmp_path / "out").rglob(f"{altered}.png"))
    store_file.write_bytes(png(64, 48, 99))
    # When a worker runs it against a server whose image processor counts 2 more tokens an image
    sim_args = ("--time-scale", "400", "--tokenizer", str(tok), "--image-token-skew", "2")
    with simulator(tmp_path / "logs", *sim_args) as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
        try:
            wait_until(
                lambda: (
                    job_progress(client, settings.keys, "bad")["done"] == TEXT_ROWS
                    and len(dead_letters(client, settings.keys, "bad")) == len(images)
                ),
                120,
                what="text rows stored, image rows dead-lettered",
                explain=worker.tail,
            )
            stats = sim_stats(sim)
        finally:
            worker.terminate()
    dead = dead_letters(client, settings.keys, "bad")
    # Then the altered image's prompt was never sent, and says why
    assert IMAGE_HASH_MISMATCH in json.dumps(dead["mixed/i0"]) and altered in json.dumps(dead["mixed/i0"])
    # and every other image prompt is a bad_output dead letter keeping the server's answer, sent once (not retried)
    for key in ("i1", "i2", "i3"):
        text = json.dumps(dead[f"mixed/{key}"])
        assert "bad_output" in text and "prompt_tokens" in text and "image prompt" in text, text[:500]
    assert stats["generate_items"] == TEXT_ROWS + 3, stats
    stored = read_committed(settings.output_uri, "bad")
    assert sorted(stored["prompt_id"].to_pylist()) == [f"mixed/t{i}" for i in range(TEXT_ROWS)]


@pytest.mark.timeout(240)
def test_a_server_without_image_understanding_gets_no_image_prompt(redis_url: str, tmp_path: Path) -> None:
    # Given an image job, and a simulator with no model directory (a text-only model: has_image_understanding false)
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    data, images = mixed_dataset(tmp_path / "mixed.jsonl")
    submit(settings, data, tok, "txt")
    with simulator(tmp_path / "logs", "--time-scale", "400") as sim:
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
        try:
            wait_until(
                lambda: (
                    job_progress(client, settings.keys, "txt")["done"] == TEXT_ROWS
                    and len(dead_letters(client, settings.keys, "txt")) == len(images)
                ),
                120,
                what="text rows stored, image rows dead-lettered",
                explain=worker.tail,
            )
            stats = sim_stats(sim)
        finally:
            worker.terminate()
    # Then each image prompt is dead-lettered images_unsupported, kept whole for producer retry, never sent
    for record in dead_letters(client, settings.keys, "txt").values():
        text = json.dumps(record)
        assert IMAGES_UNSUPPORTED in text and "has_image_understanding false" in text
    assert stats["generate_items"] == TEXT_ROWS, stats


def test_image_columns_round_trip_and_verify_rehashes_ids_with_images() -> None:
    ids = [7, 8, 163605, 9, 163605, 10]
    media = (
        ImageRef("ab" * 32, "/o/vis/_images/ab/" + "ab" * 32 + ".png", "image/png", 64, 48, 12, 2),
        ImageRef("cd" * 32, "s3://b/o/vis/_images/cd/" + "cd" * 32 + ".jpg", "image/jpeg", 320, 240, 108, 4),
    )
    digest = content_hash(ids, [m.sha256 for m in media])
    task = PromptTask("vis", "ds", "ds/1", 1, digest, pack_ids(ids), media=media)
    assert image_columns(PromptTask("vis", "ds", "ds/0", 0, content_hash(ids), pack_ids(ids))) == {
        IMAGE_SHA256: None, IMAGE_PATHS: None, IMAGE_TOKENS: None, IMAGE_POSITIONS: None,
    }  # fmt: skip
    expanded = expand_ids(ids, media)
    assert len(expanded) == len(ids) - 2 + 12 + 108 and expanded.count(163605) == 120
    image_row = make_row(
        "ds/1", input_ids=ids, content_hash=digest, **image_columns(task), **{EXPANDED_INPUT_IDS: expanded}
    )
    text_row = make_row("ds/0", input_ids=ids, content_hash=content_hash(ids))
    table = rows_to_table([image_row, text_row])
    assert table[IMAGE_PATHS].to_pylist() == [[m.uri for m in media], None]
    assert table[IMAGE_TOKENS].to_pylist() == [[12, 108], None]
    assert table[IMAGE_POSITIONS].to_pylist() == [[2, 4], None]
    assert table[EXPANDED_INPUT_IDS].to_pylist() == [expanded, None]
    assert hash_mismatches(table) == []
    # a row whose image list was altered no longer hashes to what was submitted
    altered = rows_to_table([{**image_row, IMAGE_SHA256: ["cd" * 32, "ab" * 32]}])
    assert hash_mismatches(altered) == ["ds/1"]
    # verify (storage/checks.py): the server's expanded ids must be the ids with each placeholder expanded
    assert image_problems(table, 163605) == {}
    shifted = [expanded[0], expanded[2], expanded[1], *expanded[3:]]  # the first placeholder one id early
    assert shifted != expanded
    bad = image_problems(rows_to_table([{**image_row, EXPANDED_INPUT_IDS: shifted}]), 163605)
    assert list(bad) == ["ds/1"] and "expanded_input_ids differ" in bad["ds/1"][0]
    short = image_problems(rows_to_table([{**image_row, EXPANDED_INPUT_IDS: expanded[:-1]}]), 163605)
    assert "expanded_input_ids hold" in short["ds/1"][0]
