"""Until workers send ``image_data`` (issue 33 part 3), an image prompt that reaches one is dead-lettered with the
reason — never generated as a prompt whose images are bare placeholders — while the text prompts beside it are
stored; and the row columns that will carry image references round-trip through Parquet with verify's hash
check."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import redis

from storage.checks import hash_mismatches
from storage.reader import read_committed
from storage.schema import IMAGE_PATHS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS, rows_to_table
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, sim_stats, simulator
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.message import PromptTask, content_hash, pack_ids
from thinkfleet.vision import ImageRef
from workers.admission import IMAGES_UNSUPPORTED
from workers.rows import image_columns

TEXT_ROWS, IMAGE_ROWS = 4, 3


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.timeout(240)
def test_an_image_prompt_reaching_a_worker_is_dead_lettered_with_the_reason(redis_url: str, tmp_path: Path) -> None:
    # Given a job of text rows and image rows, submitted with the real CLI
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    rows = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}]}
            for i in range(TEXT_ROWS)]  # fmt: skip
    for i in range(IMAGE_ROWS):
        uri = "data:image/png;base64," + base64.b64encode(_png(32 + i, 32, i)).decode()
        parts = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "What is this?"}]
        rows.append({"id": f"i{i}", "messages": [{"role": "user", "content": parts}]})
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("submit", str(data), "--job", "vis", "--tokenizer", str(tok), "--processes", "1", "--no-progress")
    with simulator(tmp_path / "logs", "--time-scale", "400") as sim:
        submitted = producer_cli(settings, *args, "--max-new-tokens", "256")
        assert submitted.returncode == 0, submitted.stderr
        # When a real worker drives the simulator
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
        try:
            wait_until(
                lambda: (
                    job_progress(client, settings.keys, "vis")["done"] == TEXT_ROWS
                    and len(dead_letters(client, settings.keys, "vis")) == IMAGE_ROWS
                ),
                120,
                what="text rows stored, image rows dead-lettered",
                explain=worker.tail,
            )
            stats = sim_stats(sim)
        finally:
            worker.terminate()
    # Then every image prompt is a dead letter saying why, kept whole for producer retry
    dead = dead_letters(client, settings.keys, "vis")
    assert sorted(dead) == [f"mixed/i{i}" for i in range(IMAGE_ROWS)]
    for record in dead.values():
        text = json.dumps(record)
        assert IMAGES_UNSUPPORTED in text and "this worker does not send image_data yet" in text
    # none of them was sent to the server, and the text prompts were stored as always
    assert stats["generate_items"] == TEXT_ROWS, stats
    stored = read_committed(settings.output_uri, "vis")
    assert sorted(stored["prompt_id"].to_pylist()) == [f"mixed/t{i}" for i in range(TEXT_ROWS)]
    assert stored[IMAGE_SHA256].null_count == TEXT_ROWS


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
    image_row = make_row("ds/1", input_ids=ids, content_hash=digest, **image_columns(task))
    text_row = make_row("ds/0", input_ids=ids, content_hash=content_hash(ids))
    table = rows_to_table([image_row, text_row])
    assert table[IMAGE_PATHS].to_pylist() == [[m.uri for m in media], None]
    assert table[IMAGE_TOKENS].to_pylist() == [[12, 108], None]
    assert table[IMAGE_POSITIONS].to_pylist() == [[2, 4], None]
    assert hash_mismatches(table) == []
    # a row whose image list was altered no longer hashes to what was submitted
    altered = rows_to_table([{**image_row, IMAGE_SHA256: ["cd" * 32, "ab" * 32]}])
    assert hash_mismatches(altered) == ["ds/1"]
