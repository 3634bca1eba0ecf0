"""``--turns all`` with images: each later turn is rendered from the conversation's messages with the model's own
answers, so its history holds every earlier image exactly once, as the one placeholder the template renders (never
the ids an earlier turn's server expanded), and its message sends all the history's images in order."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from storage.reader import read_committed
from storage.schema import EXPANDED_INPUT_IDS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS
from testing.fleet import WorkerProcess, dead_letters, job_progress, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli, simulator
from testing.images import png_data_uri
from testing.images import random_png as png
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.vision import ImageRef, expand_ids, load_rule

MEDIA_PAD = 163605
TURNS = 3


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_data_uri(data)}}


def conversation(cid: str, first: list[bytes], second: list[bytes]) -> dict[str, Any]:
    """Three user turns: images in turn 0 and turn 1 (``first``/``second``), none in turn 2."""
    return {
        "id": cid,
        "messages": [
            {"role": "user", "content": [*map(image_part, first), {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": [*map(image_part, second), {"type": "text", "text": "And this one?"}]},
            {"role": "assistant", "content": "Another."},
            {"role": "user", "content": "Which do you like more?"},
        ],
    }


@pytest.mark.timeout(300)
def test_turns_all_keeps_each_history_image_once_as_one_placeholder(redis_url: str, tmp_path: Path) -> None:
    # Given image conversations (one image reused across conversations) and a text one, submitted --turns all
    (tmp_path / "logs").mkdir()
    settings = isolated_settings(redis_url, str(tmp_path / "out"), alarm_min_rows=2)
    client = redis.Redis.from_url(redis_url)
    tok = build_test_tokenizer(default_test_tokenizer_dir())
    a, b, c = png(64, 48, 1), png(200, 120, 2), png(40, 40, 3)
    convs = {"c0": ([a], [b]), "c1": ([a, c], [])}
    rows = [conversation(cid, *imgs) for cid, imgs in convs.items()]
    rows.append({"id": "c2", "messages": [m if isinstance(m["content"], str) else {**m, "content": "Hi."}
                                          for m in conversation("c2", [], [])["messages"]]})  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = len(rows) * TURNS
    sim_args = ("--time-scale", "400", "--sglang-version", "0.5.23", "--tokenizer", str(tok))
    with simulator(tmp_path / "logs", *sim_args) as sim:
        # When a worker runs every turn
        worker = WorkerProcess("w1", fast_env(settings, sim, max_inflight=4), tmp_path / "logs").start()
        try:
            submitted = producer_cli(
                settings, "submit", str(data), "--job", "vturns", "--tokenizer", str(tok), "--processes", "1",
                "--no-progress", "--max-new-tokens", "120", "--context-length", "131072", "--turns", "all",
            )  # fmt: skip
            assert submitted.returncode == 0, submitted.stderr
            wait_until(
                lambda: job_progress(client, settings.keys, "vturns")["done"] == total,
                180,
                what=f"{total} turns stored",
                explain=lambda: worker.tail() + str(dead_letters(client, settings.keys, "vturns")),
            )
        finally:
            worker.terminate()
    assert dead_letters(client, settings.keys, "vturns") == {}
    stored = {r["prompt_id"]: r for r in read_committed(settings.output_uri, "vturns").to_pylist()}
    assert len(stored) == total
    rule = load_rule(str(tok))
    for cid, (first, second) in convs.items():
        for turn in range(TURNS):
            row = stored[f"chat/{cid}/t{turn}"]
            history = first if turn == 0 else [*first, *second]
            ids = row["input_ids"]
            # Then turn t's prompt holds each image of its history once, one placeholder each, in order
            positions = [i for i, t in enumerate(ids) if t == MEDIA_PAD]
            assert row[IMAGE_POSITIONS] == positions and len(positions) == len(history), (cid, turn)
            assert row[IMAGE_SHA256] == [hashlib.sha256(d).hexdigest() for d in history]
            # its images were sent with it: the server's count and its expanded ids say so
            assert row[IMAGE_TOKENS] == [rule.tokens(*_size(d)) for d in history]
            assert row["prompt_tokens"] == len(ids) - len(history) + sum(row[IMAGE_TOKENS])
            refs = [ImageRef(s, "x", "image/png", 1, 1, n, p) for s, n, p in
                    zip(row[IMAGE_SHA256], row[IMAGE_TOKENS], positions, strict=True)]  # fmt: skip
            assert row[EXPANDED_INPUT_IDS] == expand_ids(ids, refs)
            # and a later turn's ids never carry an earlier turn's expansion
            assert ids.count(MEDIA_PAD) == len(history)
    for turn in range(TURNS):
        text_row = stored[f"chat/c2/t{turn}"]
        assert text_row[IMAGE_SHA256] is None and MEDIA_PAD not in text_row["input_ids"]
    verified = producer_cli(settings, "verify", "vturns", "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size
