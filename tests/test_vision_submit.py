"""`producer submit` of image prompts: a mixed text/image dataset in every accepted form becomes messages whose
ids hold one placeholder run per image where the template put it, whose images sit once each in the job's image
store byte for byte, and whose bad rows are refused naming the file, the row and the fix."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow.parquet as pq
import pytest
import redis

from producer import render
from producer.submit import submit
from producer.submit_options import SubmitError, SubmitOptions
from storage.images import read_image
from storage.manifest import read_sources
from storage.verify import verify_job
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.message import PromptTask, content_hash
from thinkfleet.settings import Settings
from thinkfleet.vision import kimi_image_tokens, qwen_image_tokens

QWEN_IMAGE_PAD, QWEN_START, QWEN_END = 151655, 151652, 151653


# -- images, made here -------------------------------------------------------------------------------------------
def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def kimi_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir(family="qwen3"), family="qwen3")


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"))


def opts(paths: list[Path], tok_dir: Path, **kw: Any) -> SubmitOptions:
    return SubmitOptions(
        paths=paths, job=kw.pop("job", "vis"), tokenizer=str(tok_dir), processes=kw.pop("processes", 1), **kw
    )


def queued(client: redis.Redis, settings: Settings) -> list[tuple[PromptTask, int]]:
    """Every queued message decoded as a worker would, with its size in Redis."""
    out = []
    for raw in reversed(client.lrange(settings.queue, 0, -1)):
        message = json.loads(raw)
        args, _kwargs, _embed = msgpack.unpackb(base64.b64decode(message["body"]), raw=False)
        out.append((PromptTask.from_args(args), len(raw)))
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixed_dataset(root: Path) -> tuple[Path, dict[str, bytes]]:
    """A dataset of every form: text only, a data URI, a relative path (twice, and once more as the same bytes in a
    data URI), two images in one turn, a bare part taking the images column, and a ShareGPT-style marker."""
    images = {
        "red": image_bytes(64, 48, seed=1),
        "photo": image_bytes(320, 240, "JPEG", seed=2),
        "tall": image_bytes(40, 200, seed=3),
        "col": image_bytes(100, 60, seed=4),
    }
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "red.png").write_bytes(images["red"])
    (root / "imgs" / "photo.jpg").write_bytes(images["photo"])
    (root / "imgs" / "col.png").write_bytes(images["col"])
    rows = [
        {"id": "text", "messages": [{"role": "user", "content": "What is 2+2?"}]},
        {"id": "uri", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(images["tall"])}},
            {"type": "text", "text": "Describe it."}]}]},
        {"id": "rel", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "text", "text": "What color?"}, {"type": "image", "image": "imgs/red.png"}]}]},
        {"id": "again", "messages": [{"role": "user", "content": [
            {"type": "image", "image": "imgs/red.png"}, {"type": "text", "text": "Same?"},
            {"type": "image_url", "image_url": data_uri(images["red"])}]}]},
        {"id": "two", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "imgs/photo.jpg"}},
            {"type": "text", "text": "and"}, {"type": "image", "image": data_uri(images["tall"])}]},
            {"role": "assistant", "content": [{"type": "image", "image": "imgs/missing-but-cut.png"}]}]},
        {"id": "bare", "images": ["imgs/col.png"], "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Caption this."}]}]},
        {"id": "marker", "images": ["imgs/photo.jpg"], "messages": [
            {"role": "user", "content": "<image>\nWhat is in the picture?"}]},
    ]  # fmt: skip
    return write_jsonl(root / "mixed.jsonl", rows), images


#: The images of each row of mixed_dataset, in placeholder order.
ROW_IMAGES = {
    "text": [],
    "uri": ["tall"],
    "rel": ["red"],
    "again": ["red", "red"],
    "two": ["photo", "tall"],
    "bare": ["col"],
    "marker": ["photo"],
}
SIZES = {"red": (64, 48), "photo": (320, 240), "tall": (40, 200), "col": (100, 60)}


@pytest.mark.parametrize("family", ["kimi", "qwen3"])
def test_mixed_text_and_image_rows_become_exact_placeholder_runs_and_stored_images(
    family: str, settings: Settings, redis_client: redis.Redis, kimi_dir: Path, qwen_dir: Path, tmp_path: Path
) -> None:
    # Given a dataset mixing text rows with images given as data URIs, relative paths, a column and markers
    path, images = mixed_dataset(tmp_path / "data")
    tok_dir = kimi_dir if family == "kimi" else qwen_dir
    # When it is submitted
    report = submit(settings, opts([path], tok_dir))
    assert report.enqueued == len(ROW_IMAGES) and not report.problems
    tok = render.load_tokenizer(str(tok_dir))
    tasks = {t.prompt_id.split("/", 1)[1]: (t, size) for t, size in queued(redis_client, settings)}
    assert set(tasks) == set(ROW_IMAGES)
    for row, names in ROW_IMAGES.items():
        task, _size = tasks[row]
        ids = task.verified_ids()  # the worker's own checks pass: the hash binds ids and images
        assert task.content_hash == content_hash(ids, [m.sha256 for m in task.media])
        # Then every image is one placeholder run, in order, where the template put it
        pad = kimi.MEDIA_PAD if family == "kimi" else QWEN_IMAGE_PAD
        positions = np.flatnonzero(np.asarray(ids) == pad).tolist()
        assert [m.position for m in task.media] == positions and len(positions) == len(names), row
        for ref, name in zip(task.media, names, strict=True):
            p = ref.position
            if family == "kimi":
                assert ids[p - 1] == kimi.MEDIA_CONTENT and ids[p + 1] == kimi.MEDIA_END
                assert tok.decode(ids[ids.index(kimi.MEDIA_BEGIN, p - 8) : p + 3]).startswith(
                    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
                )
                assert ref.tokens == kimi_image_tokens(*SIZES[name])
            else:
                assert ids[p - 1 : p + 2] == [QWEN_START, QWEN_IMAGE_PAD, QWEN_END]
                assert ref.tokens == qwen_image_tokens(*SIZES[name], 16, 2, 65536, 16777216)
            # and reads back from the job's image store byte for byte
            assert (ref.width, ref.height) == SIZES[name]
            assert ref.sha256 == hashlib.sha256(images[name]).hexdigest()
            assert read_image(ref.uri) == images[name]
            assert ref.uri.startswith(str(tmp_path / "out" / "vis" / "_images" / ref.sha256[:2]))
        # a text row's message carries no images, and its ids are the template's as before
        if not names:
            assert task.media == () and ids == render.render_ids(
                tok, [{"role": "user", "content": "What is 2+2?"}], None, {"thinking": True} if family == "kimi" else {}
            )
    # Each distinct image is stored once, however many rows and forms name it
    stored = sorted(p.name for p in (tmp_path / "out" / "vis" / "_images").rglob("*") if p.is_file())
    assert stored == sorted({f"{hashlib.sha256(b).hexdigest()}.{'jpg' if n == 'photo' else 'png'}"
                             for n, b in images.items()})  # fmt: skip
    # The manifest keeps each conversation with its image parts (store URI + sha256), hashed as enqueued
    sources = read_sources(settings.output_uri, "vis")
    two = tasks["two"][0]
    messages = json.loads(sources[(two.prompt_id, two.content_hash)][0])
    parts = [p for p in messages[0]["content"] if p["type"] == "image"]
    assert [(p["image"], p["sha256"]) for p in parts] == [(m.uri, m.sha256) for m in two.media]
    assert len(messages) == 1, "the trailing assistant turn (and its image) is regenerated, never read"
    # Redis holds references, not bytes: an image prompt's message is a few hundred bytes more than a text one's
    text_size, one_image = tasks["text"][1], tasks["rel"][1]
    assert one_image - text_size < 1200, (text_size, one_image)
    print(f"\n{family}: text message {text_size} B, one-image message {one_image} B, two-image {tasks['two'][1]} B")


def test_the_image_hash_catches_a_changed_image_on_resubmit(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    # Given an image row submitted once
    root = tmp_path / "data"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "a.png").write_bytes(image_bytes(64, 48, seed=1))
    row = {"id": "r", "messages": [{"role": "user", "content": [{"type": "image", "image": "imgs/a.png"}]}]}
    path = write_jsonl(root / "one.jsonl", [row])
    assert submit(settings, opts([path], kimi_dir)).enqueued == 1
    # When the image changes (same size: the same ids) and the job is re-submitted
    (root / "imgs" / "a.png").write_bytes(image_bytes(64, 48, seed=2))
    with pytest.raises(SubmitError, match="content changed since job 'vis' was first submitted"):
        submit(settings, opts([path], kimi_dir))
    # Then it is refused as changed content, and a re-submit of the same image enqueues nothing new
    (root / "imgs" / "a.png").write_bytes(image_bytes(64, 48, seed=1))
    assert submit(settings, opts([path], kimi_dir)).enqueued == 0


def test_hf_image_columns_and_parquet_image_structs_are_stored_as_their_bytes(
    settings: Settings, redis_client: redis.Redis, qwen_dir: Path, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    # Given a save_to_disk dataset with a datasets.Image list column (TRL's layout) and the Parquet file of the same
    # rows (each image an Arrow {bytes, path} struct)
    png, jpg = image_bytes(56, 56, seed=5), image_bytes(90, 30, "JPEG", seed=6)
    conversations = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
        [{"role": "user", "content": "<image> left, <image> right: which is wider?"}],
    ]
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
            "messages": datasets.Value("string"),
        }
    )
    hf = datasets.Dataset.from_dict(
        {"id": ["a", "b"], "images": [[{"bytes": png, "path": None}], [{"bytes": jpg, "path": "x.jpg"},
                                                                         {"bytes": png, "path": None}]],
         "messages": [json.dumps(c) for c in conversations]},
        features=features,
    )  # fmt: skip
    hf.save_to_disk(str(tmp_path / "hfds"))
    pq.write_table(hf.data.table, tmp_path / "structs.parquet")
    # When each is submitted, Then both rows are enqueued with the dataset's own image bytes stored
    for path, job in ((tmp_path / "hfds", "hf"), (tmp_path / "structs.parquet", "pq")):
        report = submit(settings, opts([path], qwen_dir, job=job))
        assert report.enqueued == 2, [str(p) for p in report.problems]
        stored = {p.name for p in (tmp_path / "out" / job / "_images").rglob("*.*")}
        assert stored == {f"{hashlib.sha256(png).hexdigest()}.png", f"{hashlib.sha256(jpg).hexdigest()}.jpg"}
    tasks = [t for t, _ in queued(redis_client, settings) if t.job == "hf"]
    assert [len(t.media) for t in tasks] == [1, 2]
    assert [m.width for m in tasks[1].media] == [90, 56]


# -- what is refused ------------------------------------------------------------------------------------------------
def test_bad_images_are_refused_naming_the_file_the_row_and_the_fix_and_good_rows_survive(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "data"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "ok.png").write_bytes(image_bytes(32, 32))
    (root / "imgs" / "notes.png").write_text("not an image at all")
    (root / "imgs" / "cut.png").write_bytes(image_bytes(64, 64)[:-200])
    (root / "imgs" / "big.png").write_bytes(image_bytes(400, 400))

    def row(i: str, *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": i, **extra, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}

    img = lambda v: {"type": "image", "image": v}  # noqa: E731
    rows = [
        row("good", img("imgs/ok.png")),
        row("missing", img("imgs/nope.png")),
        row("notimage", img("imgs/notes.png")),
        row("truncated", img("imgs/cut.png")),
        row("toobig", img("imgs/big.png")),
        row("badb64", img("data:image/png;base64,!!!notbase64")),
        row("audio", {"type": "input_audio", "input_audio": {"data": "x"}}),
        row("nocolumn", {"type": "image"}),
        {"id": "markers", "images": ["imgs/ok.png", "imgs/ok.png"], "messages": [
            {"role": "user", "content": "<image> one marker, two images"}]},
        row("good2", img(data_uri(image_bytes(16, 16)))),
    ]  # fmt: skip
    path = write_jsonl(root / "bad.jsonl", rows)
    small = settings.model_copy(update={"max_image_bytes": 100_000})
    # When submitted: refused whole, every bad row named with file:line, what is wrong and the fix
    with pytest.raises(SubmitError) as info:
        submit(small, opts([path], kimi_dir))
    text = str(info.value)
    expected = {
        2: "no file", 3: "is not an image", 4: "does not decode", 5: "over THINKFLEET_MAX_IMAGE_BYTES",
        6: "base64 does not decode", 7: "part 0 is of type 'input_audio'", 8: "the row's images column holds 0",
        9: "the row has 2 images but its text places 1",
    }  # fmt: skip
    for line, what in expected.items():
        assert f"bad.jsonl:{line}: " in text and what in text, (line, what, text)
    assert "fix the path" in text and "replace it" in text and "shrink the image or raise the setting" in text
    assert redis_client.llen(small.queue) == 0
    # With --skip-invalid the good rows are enqueued and the bad ones recorded: nothing accepted is lost
    report = submit(small, opts([path], kimi_dir, skip_invalid=True))
    assert report.enqueued == 2 and len(report.problems) == len(expected)
    assert sorted(t.prompt_id for t, _ in queued(redis_client, small)) == ["bad/good", "bad/good2"]


def test_image_tokens_count_against_the_context(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    big = image_bytes(1024, 1024)  # 1369 tokens on Kimi: (1024/28 → 37)²
    assert kimi_image_tokens(1024, 1024) == 1369
    path = write_jsonl(tmp_path / "ctx.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": data_uri(big)},
                                                             {"type": "text", "text": "Describe."}]}]}])  # fmt: skip
    with pytest.raises(SubmitError, match=r"each of its 1 image placeholder\(s\) expanded: 1,369 tokens"):
        submit(settings, opts([path], kimi_dir, context_length=1400, sampling={"max_new_tokens": 64}))
    assert submit(settings, opts([path], kimi_dir, context_length=1600, sampling={"max_new_tokens": 64})).enqueued == 1


def test_a_model_directory_without_image_understanding_is_refused_with_its_fix(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [
        {"id": "a", "messages": [{"role": "user", "content": [{"type": "image", "image": data_uri(image_bytes(8, 8))},
                                                             {"type": "text", "text": "?"}]}]},
        {"id": "b", "messages": [{"role": "user", "content": "text only"}]}])  # fmt: skip
    # No preprocessor_config.json: the token counts have no source
    plain = build_test_tokenizer(default_test_tokenizer_dir(family="plain"), family="plain")
    with pytest.raises(SubmitError, match=r"no such file; the image token counts come from .* pass --tokenizer"):
        submit(settings, opts([path], plain, job="p1", reasoning_spans=False))
    # A config.json of a text-only model: SGLang would say has_image_understanding false
    text_model = tmp_path / "kimi-text"
    shutil.copytree(kimi_dir, text_model)
    (text_model / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "vocab_size": 163840}))
    with pytest.raises(SubmitError, match=r"config\.json has no vision_config: a text-only model"):
        submit(settings, opts([path], text_model, job="p2"))
    # A processor config whose placeholder token the tokenizer lacks
    wrong = tmp_path / "kimi-with-qwen-processor"
    shutil.copytree(kimi_dir, wrong)
    qwen_cfg = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "merge_size": 2}
    (wrong / "preprocessor_config.json").write_text(json.dumps(qwen_cfg))
    with pytest.raises(SubmitError, match=r"has no <\|image_pad\|> token"):
        submit(settings, opts([path], wrong, job="p3"))
    # --turns all takes image rows too (each later turn keeps the history's images: tests/test_vision_turns.py)
    report = submit(settings, opts([path], kimi_dir, job="p4", turns="all"))
    assert report.enqueued == 2 and not report.problems
    assert redis_client.llen(settings.queue) == 2


def test_a_dry_run_checks_images_and_writes_none(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    path, _images = mixed_dataset(tmp_path / "data")
    report = submit(settings, opts([path], kimi_dir, dry_run=True))
    assert not report.problems and report.prompt_tokens_enqueued > 0
    assert not (tmp_path / "out" / "vis" / "_images").exists()


def test_verify_finds_a_missing_or_altered_image(
    settings: Settings, redis_client: redis.Redis, kimi_dir: Path, tmp_path: Path
) -> None:
    path, _images = mixed_dataset(tmp_path / "data")
    submit(settings, opts([path], kimi_dir))
    report = verify_job(settings, "vis")
    assert report.images_checked == 4 and report.image_problems == []
    files = sorted((tmp_path / "out" / "vis" / "_images").rglob("*.*"))
    files[0].unlink()
    files[1].write_bytes(files[1].read_bytes() + b"x")
    report = verify_job(settings, "vis")
    assert not report.ok and len(report.image_problems) == 2
    assert any("missing" in p for p in report.image_problems)
    assert any("hashes to" in p for p in report.image_problems)


# -- fetched at submit: http(s) and s3 -------------------------------------------------------------------------------
@pytest.fixture
def http_images(tmp_path: Path) -> Iterator[tuple[str, bytes]]:
    """A loopback HTTP server serving one image at /cat.png (anything else is a 404)."""
    import http.server
    import threading

    served = image_bytes(48, 32, seed=9)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(served)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", served
    server.shutdown()
    server.server_close()


def test_images_on_s3_and_http_are_fetched_by_the_producer_into_an_s3_store(
    redis_url: str, redis_client: redis.Redis, kimi_dir: Path, http_images: tuple[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import boto3
    from moto.server import ThreadedMotoServer

    from testing.fleet import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=10)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="vis")
        # Given a dataset on S3 whose images are a path beside it, an s3:// URI elsewhere and an http URL
        near, far = image_bytes(30, 30, seed=7), image_bytes(60, 20, "JPEG", seed=8)
        s3.put_object(Bucket="vis", Key="data/imgs/near.png", Body=near)
        s3.put_object(Bucket="vis", Key="elsewhere/far.jpg", Body=far)
        base, cat = http_images
        img = lambda v: {"type": "image", "image": v}  # noqa: E731
        user = lambda *parts: [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]  # noqa: E731
        rows = [
            {"id": "s3", "messages": user(img("imgs/near.png"), img("s3://vis/elsewhere/far.jpg"))},
            {"id": "web", "messages": user(img(f"{base}/cat.png"))},
            {"id": "gone", "messages": user(img(f"{base}/gone.png"))},
        ]
        s3.put_object(Bucket="vis", Key="data/rows.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode())
        settings = Settings(redis_url=redis_url, output_uri="s3://vis/out", s3_endpoint_url=endpoint)
        # When it is submitted (the store beside the job, on S3)
        with pytest.raises(SubmitError, match=r"rows\.jsonl:3: image 1 \(.*/gone\.png\): .* answered HTTP 404"):
            submit(settings, opts(["s3://vis/data/rows.jsonl"], kimi_dir))  # type: ignore[list-item]
        report = submit(settings, opts(["s3://vis/data/rows.jsonl"], kimi_dir, skip_invalid=True))  # type: ignore[list-item]
        # Then the good rows are enqueued and their images read back from the S3 store byte for byte
        assert report.enqueued == 2
        tasks = {t.prompt_id: t for t, _ in queued(redis_client, settings)}
        got = [read_image(m.uri, endpoint) for m in tasks["rows/s3"].media + tasks["rows/web"].media]
        assert got == [near, far, cat]
        assert all(m.uri.startswith("s3://vis/out/vis/_images/") for m in tasks["rows/s3"].media)
        assert verify_job(settings, "vis").image_problems == []
    finally:
        moto.stop()
