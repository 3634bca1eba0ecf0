"""Exports and verify of image prompts: each format writes an image prompt's images as its consumer reads them, read
back from the job's image store byte for byte, and ``producer verify`` fails, naming the file, the row and the fix,
when an image row's placeholders or its stored images are not what was submitted.

The job is the demo's vision sample (demo/data/vision.jsonl and its PNGs), submitted for real with the Kimi-shaped
test tokenizer; its rows are built from the queued messages as a worker stores them (workers/rows.py
``image_columns``), since workers that send images are issue 33 part 3.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pytest
import redis
from click.testing import CliRunner

from demo.vision_images import IMAGES_DIR, PICTURES
from producer import render
from producer.submit import submit
from producer.submit_options import SubmitOptions
from storage.checks import image_problems
from storage.cli import export
from storage.exports import ExportError, export_job
from storage.verify import verify_job
from storage.writer import PartWriter
from testing.rows import make_row
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.message import PromptTask, unpack_ids
from thinkfleet.settings import Settings
from workers.rows import image_columns

JOB = "vis"
DATA = Path(__file__).resolve().parent.parent / "demo" / "data" / "vision.jsonl"
#: Kimi's image placeholder (<|media_pad|>).
MEDIA_PAD = 163605
#: The pictures of each row of the vision sample, in placeholder order.
ROW_PICTURES = {
    "text-0": [],
    "shapes-0": ["shapes.png"],
    "bars-0": ["bars.png"],
    "grid-0": ["grid.png"],
    "compare-0": ["shapes.png", "grid.png"],
    "followup-0": ["bars.png"],
}


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "store"))


def queued(client: redis.Redis, settings: Settings) -> dict[str, PromptTask]:
    """Every queued message decoded as a worker decodes it."""
    out = {}
    for raw in client.lrange(settings.queue, 0, -1):
        args, _kwargs, _embed = msgpack.unpackb(base64.b64decode(json.loads(raw)["body"]), raw=False)
        task = PromptTask.from_args(args)
        out[task.prompt_id] = task
    return out


def store_job(
    settings: Settings,
    client: redis.Redis,
    tok_dir: Path,
    alter: Callable[[dict[str, PromptTask]], dict[str, dict[str, Any]]] | None = None,
) -> dict[str, PromptTask]:
    """Submit the vision sample for real, then store one generation per prompt as a worker would (``alter``: the
    queued messages → prompt id → columns stored otherwise)."""
    submit(settings, SubmitOptions(paths=[DATA], job=JOB, tokenizer=str(tok_dir), processes=1))
    tasks = queued(client, settings)
    changed = alter(tasks) if alter else {}
    tok = render.load_tokenizer(str(tok_dir))
    rows = []
    for pid, task in sorted(tasks.items()):
        output = [*tok(f"Looking at {pid}.", add_special_tokens=False)["input_ids"], kimi.THINK_END]
        output += [*tok("It shows shapes.", add_special_tokens=False)["input_ids"], kimi.IM_END]
        rows.append(
            make_row(
                pid, dataset="vision", job=JOB, input_ids=unpack_ids(task.ids_blob), output_ids=output,
                content_hash=task.content_hash, finish_reason={"type": "stop", "matched": kimi.IM_END},
                **{**image_columns(task), **changed.get(pid, {})},
            )
        )  # fmt: skip
    PartWriter(settings.output_uri, "w1").write(JOB, "vision", rows)
    return tasks


@pytest.fixture
def job(settings: Settings, redis_client: redis.Redis, tok_dir: Path) -> dict[str, PromptTask]:
    return store_job(settings, redis_client, tok_dir)


def picture(name: str) -> bytes:
    return (IMAGES_DIR / name).read_bytes()


def lines(path: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: r for r in records}


# -- the demo's pictures ---------------------------------------------------------------------------------------------
def test_the_demos_pictures_are_what_their_drawing_code_draws() -> None:
    from PIL import Image

    for name, draw in PICTURES.items():
        shipped = Image.open(IMAGES_DIR / name)
        assert shipped.format == "PNG" and len(picture(name)) < 4096
        assert np.array_equal(np.asarray(shipped.convert("RGB")), np.asarray(draw())), name


# -- hf ------------------------------------------------------------------------------------------------------------
def test_hf_carries_each_image_byte_identical_as_a_datasets_image(settings, job, tmp_path) -> None:
    import datasets

    out = tmp_path / "hf"
    result = export_job(settings, JOB, "hf", str(out))
    assert result.rows == len(ROW_PICTURES) and not result.warnings
    ds = datasets.load_from_disk(str(out))
    # Then load_from_disk sees Image features
    assert isinstance(ds.features["images"], datasets.List)
    assert isinstance(ds.features["images"].feature, datasets.Image)
    raw = ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
    for rec, decoded in zip(raw, ds, strict=True):
        pid, task = rec["id"], job[rec["id"]]
        names = ROW_PICTURES[pid.split("/", 1)[1]]
        # each image's bytes are the shipped file's, in placeholder order
        assert [img["bytes"] for img in rec["images"]] == [picture(n) for n in names], pid
        assert [img.size for img in decoded["images"]] == [(m.width, m.height) for m in task.media]
        if not names:  # a text prompt: no images, null references
            assert rec["image_sha256"] is None and rec["image_positions"] is None
            continue
        assert rec["image_sha256"] == [hashlib.sha256(picture(n)).hexdigest() for n in names]
        assert rec["image_tokens"] == [m.tokens for m in task.media]
        # the placeholders are prompt tokens: never trained, in either mask
        n = rec["prompt_len"]
        assert all(rec["input_ids"][p] == MEDIA_PAD and p < n for p in rec["image_positions"])
        assert rec["loss_mask"] == rec["assistant_masks"] == [0] * n + [1] * (len(rec["input_ids"]) - n)
    # and the export says where its rows came from
    assert (out / "_provenance.json").exists() and (out / "README.md").exists()


def test_a_text_only_job_keeps_the_plain_hf_columns(settings, redis_client, tok_dir, tmp_path) -> None:
    import datasets

    text = tmp_path / "text.jsonl"
    text.write_text(DATA.read_text().splitlines()[0] + "\n")
    submit(settings, SubmitOptions(paths=[text], job="plain", tokenizer=str(tok_dir), processes=1))
    (task,) = queued(redis_client, settings).values()
    row = make_row(task.prompt_id, dataset="text", job="plain", input_ids=unpack_ids(task.ids_blob),
                   content_hash=task.content_hash)  # fmt: skip
    PartWriter(settings.output_uri, "w1").write("plain", "text", [row])
    export_job(settings, "plain", "hf", str(tmp_path / "hf"))
    # an images column would make TRL take it for a vision dataset
    assert "images" not in datasets.load_from_disk(str(tmp_path / "hf")).column_names


# -- messages ------------------------------------------------------------------------------------------------------
def test_messages_keep_the_content_parts_pointing_at_the_stored_images(settings, job, tok_dir, tmp_path) -> None:
    for mode in ("store", "data"):
        out = _export(settings, tok_dir, tmp_path / f"messages-{mode}.jsonl", "messages", "--image-urls", mode)
        records = lines(out)
        assert len(records) == len(ROW_PICTURES)
        for pid, rec in records.items():
            names, task = ROW_PICTURES[pid.split("/", 1)[1]], job[pid]
            parts = [p for m in rec["messages"] if isinstance(m["content"], list) for p in m["content"]]
            assert {p["type"] for p in parts} <= {"text", "image_url"}  # OpenAI content parts, nothing of ours
            urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
            if mode == "store":  # a file:// URL of the image in the job's store
                assert all(u.startswith(f"file://{settings.output_uri}/{JOB}/_images/") for u in urls)
                got = [Path(u.removeprefix("file://")).read_bytes() for u in urls]
            else:  # the bytes inline
                assert all(u.startswith("data:image/png;base64,") for u in urls)
                got = [base64.b64decode(u.split(",", 1)[1]) for u in urls]
            assert got == [picture(n) for n in names], pid
            if names:  # what a consumer needs to expand the placeholders of prompt_ids
                assert rec["image_positions"] == [m.position for m in task.media]
                assert rec["image_tokens"] == [m.tokens for m in task.media]
            else:
                assert "image_sha256" not in rec
        # each image stays where the conversation had it, between the same texts
        shapes, bars = records["vision/shapes-0"]["messages"][0], records["vision/bars-0"]["messages"][1]
        assert [p["type"] for p in shapes["content"]] == ["image_url", "text"]
        assert [p["type"] for p in bars["content"]] == ["text", "image_url"]
        assert bars["content"][0]["text"] == "How many bars does this chart have, and which is tallest?"


# -- SpecForge -----------------------------------------------------------------------------------------------------
def test_conversations_is_specforges_vlm_shape_and_leaves_out_what_it_cannot_hold(
    settings, job, tok_dir, tmp_path
) -> None:
    out = tmp_path / "sf.jsonl"
    result = export_job(settings, JOB, "conversations", str(out), tokenizer=str(tok_dir))
    records = lines(out)
    # SpecForge's VLM path takes one image, in the first user turn: the two others are left out, and said so
    assert result.skipped == {"images_over_one_per_sample": 1, "image_outside_first_user_turn": 1}
    assert sorted(records) == [f"vision/{r}" for r in ("bars-0", "grid-0", "shapes-0", "text-0")]
    assert any("SpecForge's VLM shape cannot hold" in w for w in result.warnings)
    assert "image" not in records["vision/text-0"]
    for name in ("bars-0", "grid-0", "shapes-0"):
        rec = records[f"vision/{name}"]
        # {image, conversations}: the image a path SpecForge opens, every content a string
        assert Path(rec["image"]).read_bytes() == picture(ROW_PICTURES[name][0])
        assert all(isinstance(m["content"], str) for m in rec["conversations"])
        assert rec["conversations"][-1]["role"] == "assistant"
    assert records["vision/bars-0"]["conversations"][1]["content"].startswith("How many bars")
    inline = lines(_export(settings, tok_dir, tmp_path / "sf-data.jsonl", "conversations", "--image-urls", "data"))
    assert base64.b64decode(inline["vision/grid-0"]["image"].split(",", 1)[1]) == picture("grid.png")


def test_specforge_ids_leave_out_image_prompts_saying_why(settings, job, tmp_path) -> None:
    out = tmp_path / "ids.jsonl"
    result = export_job(settings, JOB, "specforge", str(out))
    # SpecForge 0.2.0 would send these ids with no image: bare placeholders, trained on silently
    assert result.skipped == {"image_prompts": 5}
    assert list(lines(out)) == ["vision/text-0"]
    assert any("left out 5 image prompts" in w and "--format conversations" in w for w in result.warnings)
    assert Path(str(out) + ".provenance.json").exists()
    with pytest.raises(ExportError, match="--image-urls is for the messages and conversations formats"):
        export_job(settings, JOB, "specforge", str(out), image_urls="data")


def test_an_export_refuses_an_image_altered_in_the_store(settings, job, tok_dir, tmp_path) -> None:
    stored = job["vision/grid-0"].media[0].uri
    Path(stored).write_bytes(picture("grid.png") + b"x")
    with pytest.raises(ExportError, match=r"_images/.*\.png \(prompt vision/.*\) hashes to .* Delete the file"):
        export_job(settings, JOB, "hf", str(tmp_path / "hf"))
    Path(stored).unlink()
    args = [JOB, "--format", "messages", "--out", str(tmp_path / "m.jsonl"), "--tokenizer", str(tok_dir)]
    result = CliRunner().invoke(export, [*args, *_where(settings), "--image-urls", "data"])
    assert result.exit_code == 1 and "is not in the image store: re-run the job's `producer submit`" in result.output
    assert not (tmp_path / "m.jsonl").exists()  # nothing half-written


def _export(settings: Settings, tok_dir: Path, out: Path, fmt: str, *extra: str) -> Path:
    """``producer export`` through its click command (the options as a user types them)."""
    args = [JOB, "--format", fmt, "--out", str(out), "--tokenizer", str(tok_dir), *_where(settings), *extra]
    result = CliRunner().invoke(export, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _where(settings: Settings) -> list[str]:
    return ["--output-uri", settings.output_uri, "--redis-url", settings.redis_url]


# -- verify --------------------------------------------------------------------------------------------------------
def test_verify_names_a_missing_or_altered_image_with_its_fix(settings, job, redis_client, tok_dir) -> None:
    assert verify_job(settings, JOB).ok
    gone, altered = job["vision/shapes-0"].media[0].uri, job["vision/bars-0"].media[0].uri
    Path(gone).unlink()
    Path(altered).write_bytes(b"not the chart")
    report = verify_job(settings, JOB)
    assert not report.ok
    problems = {p.split(" ", 1)[0]: p for p in report.image_problems}
    assert set(problems) == {gone, altered}
    assert "missing → re-run the job's `producer submit` with the same inputs" in problems[gone]
    assert f"hashes to {hashlib.sha256(b'not the chart').hexdigest()}" in problems[altered]
    assert f"→ delete {altered}, then re-run" in problems[altered]
    # When the fix is followed: the altered file deleted, the same submit run again
    Path(altered).unlink()
    submit(settings, SubmitOptions(paths=[DATA], job=JOB, tokenizer=str(tok_dir), processes=1))
    # Then both images are back, byte for byte
    assert verify_job(settings, JOB).image_problems == []
    assert Path(gone).read_bytes() == picture("shapes.png") and Path(altered).read_bytes() == picture("bars.png")


def test_verify_checks_one_placeholder_per_image_at_the_recorded_positions(settings, redis_client, tok_dir) -> None:
    # Given a stored image row whose second position is off by one
    def off_by_one(tasks: dict[str, PromptTask]) -> dict[str, dict[str, Any]]:
        first, second = [m.position for m in tasks["vision/compare-0"].media]
        return {"vision/compare-0": {"image_positions": [first, second - 1]}}

    task = store_job(settings, redis_client, tok_dir, alter=off_by_one)["vision/compare-0"]
    ids, (first, second) = unpack_ids(task.ids_blob), [m.position for m in task.media]
    # Then producer verify reports it as malformed, naming it and what is wrong; every other row is sound
    report = verify_job(settings, JOB)
    assert not report.ok and list(report.malformed) == [task.prompt_id]
    assert report.malformed[task.prompt_id] == [f"input_ids hold no placeholder (id {MEDIA_PAD}) at image_positions "
                                                f"[{second - 1}]"]  # fmt: skip

    # The rule, row by row: one placeholder per image, at the recorded positions, and nowhere else
    base = image_columns(task)

    def problems(**change: Any) -> list[str]:
        row = make_row(task.prompt_id, input_ids=change.pop("input_ids", ids), **{**base, **change})
        return image_problems(pa.Table.from_pylist([row]), MEDIA_PAD).get(task.prompt_id, [])

    assert problems() == []
    assert "are not increasing" in problems(image_positions=[second, first])[0]
    assert "image columns disagree" in problems(image_tokens=[4])[0]
    expanded = [*ids[: second + 1], MEDIA_PAD, *ids[second + 1 :]]  # one placeholder expanded: SGLang would again
    assert problems(input_ids=expanded, image_positions=[first, second]) == [
        f"input_ids hold 3 placeholders (id {MEDIA_PAD}) for 2 images: one per image, never expanded"
    ]
