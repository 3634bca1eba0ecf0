"""The real-SGLang vision tier: image prompts against a real ``sglang==0.5.9`` (the deployed release), or
``sglang==0.5.23`` with ``THINKFLEET_REAL_SGLANG_VERSION=0.5.23``, serving a tiny random-weight Qwen2-VL on this CPU.

The model (``scripts/real_sglang.sh model TOKDIR OUT qwen2vl``) is a ``Qwen2VLForConditionalGeneration`` around the
Qwen3 test tokenizer (its real vision ids: ``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655,
``<|vision_end|>`` 151653) with a Qwen2-VL ``preprocessor_config.json`` of small pixel bounds (4 to 64 tokens an
image); the server runs from the venv's vision overlay (the real torchvision, patched; a decord stand-in:
docs/real-sglang.md). One server for the module (start-up is a minute or more).

What it proves: the tokens each image costs on the real server are what ``thinkfleet/vision.py``'s rule computes
from the model's ``preprocessor_config.json`` (``prompt_tokens == len(ids) − n + Σ counts``) across its resize
branches; how the release treats ids (0.5.9 decodes and re-tokenizes them, 0.5.13+ keeps them and returns them
expanded); what it answers to a pre-expanded prompt and other image mistakes; where the simulator's profile of the
release answers otherwise (each difference listed, with its reason, in docs/sglang-versions.md); and an image job
run end to end by a worker, stored as the server processed it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from real_server import VERSION, RealServer, ensure_model, ensure_vision_environment, get, post

from storage.reader import raw_duplicates, read_committed
from storage.schema import EXPANDED_INPUT_IDS, IMAGE_POSITIONS, IMAGE_SHA256, IMAGE_TOKENS, SAMPLING_PARAMS
from testing.fleet import WorkerProcess, dead_letters, job_settled, wait_until
from testing.harness import fast_env, isolated_settings, producer_cli
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet.vision import ImageRule, load_rule

#: The first test also waits for the venv and its vision overlay (minutes, once) and the server (a minute or more).
pytestmark = pytest.mark.timeout(1800)

#: Qwen3's vocabulary (the model's embedding rows), and the image placeholder's id.
VOCAB = 151936
PAD = 151655
#: From 0.5.13 the server keeps the caller's ids (``SGLANG_MM_AVOID_RETOKENIZE``) and returns them expanded
#: (``return_prompt_token_ids``); 0.5.9 decodes them to text and re-tokenizes.
KEEPS_IDS = tuple(int(x) for x in VERSION.split(".")) >= (0, 5, 13)
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0}
#: The server's flags beyond the script's CPU and vision ones (not the compose file's Kimi parsers: a Qwen model).
FLAGS = ("--log-level warning", "--sleep-on-idle", "--max-running-requests 64")
#: The real server is slower than the simulator and a loaded CI box slower still (test_real_sglang.py's values).
REAL_WORKER = {"lease_s": 60, "request_timeout_floor_s": 300, "request_min_decode_tok_s": 1, "health_interval_s": 1}


@dataclass(frozen=True)
class Img:
    """A PNG of random pixels (``seed``: the same seed, the same bytes)."""

    width: int
    height: int
    seed: int = 0

    def png(self) -> bytes:
        from PIL import Image

        rng = np.random.default_rng(self.seed)
        pixels = rng.integers(0, 255, size=(self.height, self.width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        return buf.getvalue()

    def uri(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode()


#: Prompts whose images take each branch of Qwen-VL's smart_resize on this model's bounds (56×56 to 224×224 px):
#: already in bounds, scaled up to the minimum, scaled down to the maximum, rounding both ways, extreme aspects.
COUNT_CASES: dict[str, list[Img]] = {
    "in_bounds": [Img(64, 64, 1)],
    "scaled_up": [Img(17, 23, 2)],
    "scaled_down": [Img(640, 480, 3)],
    "rounded": [Img(99, 41, 4)],
    "tall_scaled_down": [Img(300, 1000, 5)],
    "thin": [Img(1, 150, 6)],
    "two": [Img(70, 126, 7), Img(84, 42, 8)],
    "three_one_repeated": [Img(56, 56, 9), Img(640, 480, 10), Img(56, 56, 9)],
}


@dataclass
class Vision:
    server: RealServer
    model: Path
    tok: Any  # the model directory's tokenizer, loaded by thinkfleet's transformers
    rule: ImageRule  # thinkfleet/vision.py's rule of the model's preprocessor_config.json


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vision]:
    from transformers import AutoTokenizer

    tokenizer = build_test_tokenizer(default_test_tokenizer_dir(family="qwen3"), family="qwen3")
    ensure_vision_environment()
    model = ensure_model(tokenizer, default_test_tokenizer_dir().parent, arch="qwen2vl", vocab_size=VOCAB)
    log = tmp_path_factory.mktemp("real-sglang-vision") / "server.log"
    server = RealServer(model=model, log_path=log, flags=FLAGS).start()
    try:
        yield Vision(server, model, AutoTokenizer.from_pretrained(str(model)), load_rule(str(model)))
    finally:
        server.stop()


def render(tok: Any, images: int, topic: str) -> list[int]:
    """A user turn of ``images`` image parts between text, rendered by the model's chat template (one
    ``<|vision_start|><|image_pad|><|vision_end|>`` each) and tokenized canonically."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": f"Look at these, about {topic.replace('_', ' ')}."}]
    for i in range(images):
        parts += [{"type": "image"}, {"type": "text", "text": f"That was picture {i + 1}."}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)
    ids = list(tok.encode(text, add_special_tokens=False))
    assert ids.count(PAD) == images
    return ids


def request(ids: list[int], images: list[Img] | list[str]) -> dict[str, Any]:
    """A /generate of ``ids`` with ``images`` as data URIs (a string: sent as it is), greedy, asking for the
    expanded ids where the release returns them."""
    image_data = [i.uri() if isinstance(i, Img) else i for i in images]
    payload: dict[str, Any] = {"input_ids": ids, "image_data": image_data, "sampling_params": GREEDY}
    if KEEPS_IDS:
        payload["return_prompt_token_ids"] = True
    return payload


def expand(ids: list[int], counts: list[int]) -> list[int]:
    """``ids`` with the i-th placeholder repeated ``counts[i]`` times."""
    out: list[int] = []
    it = iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == PAD else [t])
    return out


def prompt_token_ids(body: dict[str, Any]) -> list[int] | None:
    """The expanded ids a ≥ 0.5.13 server returns with ``return_prompt_token_ids`` (None when absent)."""
    ids = body.get("prompt_token_ids", body.get("meta_info", {}).get("prompt_token_ids"))
    return list(ids) if ids is not None else None


# -- the count rule against the real processor --------------------------------------------------------------------
def test_prompt_tokens_are_the_ids_with_each_placeholder_expanded_by_the_rule(vision: Vision) -> None:
    counts_seen: set[int] = set()
    for name, images in COUNT_CASES.items():
        ids = render(vision.tok, len(images), name)
        # (canonical ids: what 0.5.9's decode → re-tokenize gives back unchanged)
        assert list(vision.tok.encode(vision.tok.decode(ids), add_special_tokens=False)) == ids, name
        counts = [vision.rule.tokens(i.width, i.height) for i in images]
        status, body = vision.server.generate(request(ids, images))
        assert status == 200, f"{name}: {body}"
        assert isinstance(body, dict)
        assert body["meta_info"]["prompt_tokens"] == len(ids) - len(images) + sum(counts), (name, counts)
        if KEEPS_IDS:
            assert prompt_token_ids(body) == expand(ids, counts), name
        counts_seen.update(counts)
    # the cases reach different counts (each resize branch), not one count many times
    assert len(counts_seen) >= 6, counts_seen


def non_canonical(tok: Any) -> list[int]:
    """A one-image prompt whose text part is spelled one character a token: ids that decode to the canonical
    prompt's text but are not what tokenizing that text gives."""
    ids = render(tok, 1, "spelling")
    start = ids.index(PAD) - 1  # <|vision_start|>
    word = "Spelled one character at a time"
    spelled = [t for ch in word for t in tok.encode(ch, add_special_tokens=False)]
    return ids[:start] + spelled + ids[start:]


def test_ids_are_re_tokenized_by_0_5_9_and_kept_from_0_5_13(vision: Vision) -> None:
    ids = non_canonical(vision.tok)
    canonical = list(vision.tok.encode(vision.tok.decode(ids), add_special_tokens=False))
    assert canonical != ids and len(canonical) < len(ids)
    image = Img(99, 41, 4)
    count = vision.rule.tokens(image.width, image.height)
    status, body = vision.server.generate(request(ids, [image]))
    assert status == 200 and isinstance(body, dict), body
    if KEEPS_IDS:
        # the caller's ids, only the placeholder expanded
        assert body["meta_info"]["prompt_tokens"] == len(ids) - 1 + count
        assert prompt_token_ids(body) == expand(ids, [count])
    else:
        # the ids decoded to text and tokenized again: the model ran on the canonical ids (a silent drift)
        assert body["meta_info"]["prompt_tokens"] == len(canonical) - 1 + count


# -- mistakes, as the real server answers them --------------------------------------------------------------------
def refusal_cases(tok: Any, rule: ImageRule) -> dict[str, dict[str, Any]]:
    one = render(tok, 1, "refusals")
    at = one.index(PAD)
    image = Img(64, 64, 1)
    n = rule.tokens(image.width, image.height)
    return {
        # the known trap: the placeholder already expanded (as many as the image makes)
        "pre_expanded": request(one[:at] + [PAD] * n + one[at + 1 :], [image]),
        "more_placeholders_than_images": request(render(tok, 2, "refusals"), [image]),
        "too_elongated": request(one, [Img(1, 250, 11)]),
        "not_an_image": request(one, ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]),
        # answered, silently: the extra image is dropped / the image unused
        "more_images_than_placeholders": request(one, [image, Img(640, 480, 3)]),
        "image_without_placeholder": request(render(tok, 0, "refusals"), [image]),
    }


#: Status 0: no answer within :data:`MISTAKE_WAIT_S` (the request hangs).
NO_ANSWER = 0
#: How long a mistake is given to be answered (the real server answers each in well under a second when it does).
MISTAKE_WAIT_S = 60.0
#: What each mistake gets from the real server, when not a 200.
EXPECTED_REFUSALS: dict[str, dict[str, int]] = {
    # 0.5.9: an exception out of the processor the HTTP layer does not map (IndexError in transformers'
    # Qwen2VLProcessor for the pre-expanded run, RuntimeError from load_mm_data): a bare 500; the processor's own
    # ValueError (aspect ratio) a 400.
    "0.5.9": {"pre_expanded": 500, "more_placeholders_than_images": 500, "too_elongated": 400, "not_an_image": 500},
    # 0.5.23: ValueErrors (400) with messages, but the pre-expanded run is never answered: transformers 5's processor
    # raises StopIteration in the processor's thread, which asyncio cannot set on the request's future
    # ("TypeError: StopIteration interacts badly with generators and cannot be raised into a Future", logged).
    "0.5.23": {
        "pre_expanded": NO_ANSWER,
        "more_placeholders_than_images": 400,
        "too_elongated": 400,
        "not_an_image": 400,
    },
}


def send_mistake(url: str, payload: dict[str, Any]) -> tuple[int, Any]:
    """(status, body) of a mistaken request; (:data:`NO_ANSWER`, None) when none comes in :data:`MISTAKE_WAIT_S`."""
    try:
        return post(url + "/generate", payload, timeout_s=MISTAKE_WAIT_S)
    except TimeoutError:
        return NO_ANSWER, None


def test_mistakes_get_the_real_servers_answers_and_it_keeps_serving(vision: Vision) -> None:
    cases = refusal_cases(vision.tok, vision.rule)
    answers = {name: send_mistake(vision.server.url, payload) for name, payload in cases.items()}
    refused = {name: status for name, (status, _) in answers.items() if status != 200}
    assert refused == EXPECTED_REFUSALS[VERSION], {k: (s, str(b)[:300]) for k, (s, b) in answers.items()}
    _, body = answers["too_elongated"]
    assert "aspect ratio" in json.dumps(body), body
    # The extra image is dropped: the count is the first image's alone; an image without a placeholder is unused.
    image_tokens = vision.rule.tokens(64, 64)
    one = cases["more_images_than_placeholders"]["input_ids"]
    _, extra = answers["more_images_than_placeholders"]
    assert extra["meta_info"]["prompt_tokens"] == len(one) - 1 + image_tokens, extra
    _, unused = answers["image_without_placeholder"]
    assert unused["meta_info"]["prompt_tokens"] == len(cases["image_without_placeholder"]["input_ids"]), unused
    # None of it took the server down.
    assert get(vision.server.url + "/health_generate", timeout_s=60)[0] == 200


# -- the simulator's profile of the release, request by request --------------------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang-versions.md"
DOC_SECTION = f"## Measured: image requests, the simulator's {VERSION} profile against a real {VERSION}"


def documented_differences() -> set[str]:
    """The differences docs/sglang-versions.md lists (and explains) in :data:`DOC_SECTION`: each bullet's first
    backticked text."""
    text = DOC.read_text()
    assert DOC_SECTION in text, f"{DOC} has no section {DOC_SECTION!r}"
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}


def summary(status: int, body: Any) -> dict[str, Any]:
    """What the comparison looks at: the status; for a 200 the counted prompt and the returned ids; for an error
    the body's form (plain text, or the JSON keys)."""
    if status == 200 and isinstance(body, dict):
        return {"status": 200, "prompt_tokens": body["meta_info"]["prompt_tokens"], "ids": prompt_token_ids(body)}
    form = "none" if body is None else "text" if not isinstance(body, dict) else ",".join(sorted(body))
    return {"status": status, "body": form}


def test_the_simulator_counts_and_refuses_images_as_the_real_server_does(vision: Vision) -> None:
    from sglang_sim.testing import SimulatorProcess

    payloads: dict[str, dict[str, Any]] = {
        name: request(render(vision.tok, len(images), name), images) for name, images in COUNT_CASES.items()
    }
    payloads["non_canonical_ids"] = request(non_canonical(vision.tok), [Img(99, 41, 4)])
    payloads.update(refusal_cases(vision.tok, vision.rule))
    _, info = get(vision.server.url + "/get_model_info")
    sim = SimulatorProcess(
        "--sglang-version", VERSION, "--model-path", json.loads(info)["model_path"], "--model-family", "qwen3",
        "--tokenizer", str(vision.model), "--vocab-size", str(VOCAB), "--context-length", "8192",
        "--time-scale", "2", "--health-min-s", "0.2",
    ).start()  # fmt: skip
    try:
        found: set[str] = set()
        for name, payload in payloads.items():
            real = summary(*send_mistake(vision.server.url, payload))
            simulated = summary(*send_mistake(sim.url, payload))
            for key in sorted(set(real) | set(simulated)):
                if real.get(key) != simulated.get(key):
                    value = lambda v: f"{len(v)} ids" if isinstance(v, list) else v  # noqa: E731
                    found.add(f"{name}: {key} real {value(real.get(key))}, sim {value(simulated.get(key))}")
    finally:
        sim.stop()
    documented = documented_differences()
    unexplained = sorted(found - documented)
    stale = sorted(documented - found)
    assert not unexplained, (
        "differences neither fixed in the simulator nor listed in docs/sglang-versions.md:\n" + "\n".join(unexplained)
    )
    assert not stale, "docs/sglang-versions.md lists differences that no longer occur:\n" + "\n".join(stale)


# -- a job end to end -----------------------------------------------------------------------------------------------
#: Rows of the job: one image, two in one turn, an image shared with another row, and a text row.
JOB_ROWS: dict[str, list[Img]] = {
    "one": [Img(64, 48, 21)],
    "two": [Img(320, 200, 22), Img(40, 40, 23)],
    "shared_a": [Img(96, 64, 24)],
    "shared_b": [Img(96, 64, 24)],
    "text": [],
}


def test_an_image_job_is_stored_as_the_server_processed_it(vision: Vision, redis_url: str, tmp_path: Path) -> None:
    # Given a small image dataset (data URIs) submitted with the model's own directory as the tokenizer
    rows = []
    for rid, images in JOB_ROWS.items():
        parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": i.uri()}} for i in images]
        content: Any = [*parts, {"type": "text", "text": f"What is in {rid}?"}] if images else f"What is {rid}?"
        rows.append({"id": rid, "messages": [{"role": "user", "content": content}]})
    data = tmp_path / "pictures.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = isolated_settings(redis_url, str(tmp_path / "out"))
    client = redis.Redis.from_url(redis_url)
    submitted = producer_cli(
        settings, "submit", str(data), "--job", "vis", "--tokenizer", str(vision.model), "--processes", "1",
        "--no-progress", "--max-new-tokens", "8", "--temperature", "0", "--context-length", "8192",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-3000:]
    # When one worker runs it against the real server
    env = fast_env(settings, vision.server.url, max_inflight=4, **REAL_WORKER)
    worker = WorkerProcess("real-vis", env, tmp_path).start()
    try:
        worker.wait_ready(client, settings.keys, timeout_s=120)
        wait_until(
            lambda: job_settled(client, settings, "vis", len(JOB_ROWS)),
            600,
            1,
            what="the image job settled",
            explain=lambda: worker.tail() + str(dead_letters(client, settings.keys, "vis")),
        )
    finally:
        worker.terminate()
    # Then every row is stored once, with its images, and is what the server answers to the same request again
    assert dead_letters(client, settings.keys, "vis") == {}
    stored = read_committed(settings.output_uri, "vis").to_pylist()
    assert sorted(r["prompt_id"] for r in stored) == sorted(f"pictures/{k}" for k in JOB_ROWS)
    assert raw_duplicates(settings.output_uri, "vis").num_rows == 0
    for row in stored:
        images = JOB_ROWS[row["prompt_id"].split("/", 1)[1]]
        ids = list(row["input_ids"])
        if not images:
            assert row[IMAGE_SHA256] is None and row["prompt_tokens"] == len(ids)
            continue
        counts = [vision.rule.tokens(i.width, i.height) for i in images]
        assert row[IMAGE_SHA256] == [hashlib.sha256(i.png()).hexdigest() for i in images]
        assert row[IMAGE_TOKENS] == counts
        assert row[IMAGE_POSITIONS] == [i for i, t in enumerate(ids) if t == PAD]
        payload = request(ids, images)
        payload["sampling_params"] = json.loads(row[SAMPLING_PARAMS])
        status, answer = vision.server.generate(payload)
        assert status == 200 and isinstance(answer, dict), answer
        assert row["prompt_tokens"] == answer["meta_info"]["prompt_tokens"] == len(ids) - len(images) + sum(counts)
        assert list(row["output_ids"]) == answer["output_ids"], row["prompt_id"]
        if KEEPS_IDS:
            assert list(row[EXPANDED_INPUT_IDS]) == prompt_token_ids(answer) == expand(ids, counts)
        else:
            assert row[EXPANDED_INPUT_IDS] is None
