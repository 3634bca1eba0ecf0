"""sglang-sim takes ``image_data`` as a vision model's server does: each image's one placeholder expanded by the
model's own processor rule (its ``preprocessor_config.json``), ``prompt_tokens`` the expanded length, the expanded
ids returned from 0.5.13 on, pre-expanded placeholders refused with the real server's error, and a model without
an image processor reporting ``has_image_understanding: false`` and ignoring images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from sglang_sim.testing import SimulatorThread
from testing.images import png_data_uri, random_png
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi
from thinkfleet.vision import kimi_image_tokens, load_rule

MEDIA_PAD = 163605
QWEN_IMAGE_PAD = 151655
FAST = {"time_scale": 2000, "health_min_s": 0.05}


def png_uri(width: int, height: int, seed: int = 0) -> str:
    return png_data_uri(random_png(width, height, seed))


def kimi_prompt(images: int) -> list[int]:
    """A Kimi prompt with ``images`` placeholder runs (one <|media_pad|> each) in its user turn."""
    run = [163602, 1000, 163603, MEDIA_PAD, 163604, 198]
    return [kimi.IM_USER, 13, kimi.IM_MIDDLE, *(run * images), 15, kimi.IM_END, kimi.IM_ASSISTANT, kimi.THINK_START]


def generate(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=30)


@pytest.fixture(scope="module")
def kimi_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="module")
def new_sim(kimi_dir: Path) -> Iterator[SimulatorThread]:
    with SimulatorThread(sglang_version="0.5.23", tokenizer=str(kimi_dir), **FAST) as thread:
        yield thread


@pytest.fixture(scope="module")
def old_sim(kimi_dir: Path) -> Iterator[SimulatorThread]:
    with SimulatorThread(sglang_version="0.5.9", tokenizer=str(kimi_dir), **FAST) as thread:
        yield thread


def test_each_placeholder_expands_by_the_processor_rule_and_the_ids_come_back(new_sim: SimulatorThread) -> None:
    # Given a prompt with two images of different sizes (and the same image twice)
    ids = kimi_prompt(3)
    images = [png_uri(64, 48, 1), png_uri(300, 200, 2), png_uri(64, 48, 1)]
    counts = [kimi_image_tokens(64, 48), kimi_image_tokens(300, 200), kimi_image_tokens(64, 48)]
    body = {"input_ids": ids, "image_data": images, "sampling_params": {"max_new_tokens": 8}}
    # When it is sent to the 0.5.23 profile asking for the prompt ids
    out = generate(new_sim.url, {**body, "return_prompt_token_ids": True}).json()
    # Then prompt_tokens is the expanded length and prompt_token_ids the ids with each placeholder repeated
    assert out["meta_info"]["prompt_tokens"] == len(ids) - 3 + sum(counts)
    expanded: list[int] = []
    k = 0
    for t in ids:
        expanded.extend([t] * counts[k] if t == MEDIA_PAD else [t])
        k += t == MEDIA_PAD
    assert out["prompt_token_ids"] == expanded
    assert new_sim.sim.engine.stats.prompt_tokens_total >= len(expanded)  # the prefill was charged for them


def test_the_deployed_release_returns_no_prompt_ids_but_counts_the_images(old_sim: SimulatorThread) -> None:
    ids = kimi_prompt(1)
    body = {"input_ids": ids, "image_data": [png_uri(640, 480)], "return_prompt_token_ids": True,
            "sampling_params": {"max_new_tokens": 4}}  # fmt: skip
    out = generate(old_sim.url, body).json()
    assert "prompt_token_ids" not in out  # 0.5.9's GenerateReqInput has no such field
    assert out["meta_info"]["prompt_tokens"] == len(ids) - 1 + kimi_image_tokens(640, 480)


def test_pre_expanded_placeholders_are_refused_as_the_real_server_refuses_them(
    new_sim: SimulatorThread, old_sim: SimulatorThread
) -> None:
    # Given ids whose one image's placeholder was already expanded (the pre-tokenized VLM trap)
    ids = kimi_prompt(1)
    at = ids.index(MEDIA_PAD)
    pre_expanded = [*ids[:at], *[MEDIA_PAD] * 12, *ids[at + 1 :]]
    body = {"input_ids": pre_expanded, "image_data": [png_uri(64, 48)], "sampling_params": {"max_new_tokens": 4}}
    # Then 0.5.23 answers its placeholder-mismatch 400, and 0.5.9 fails the request (500)
    new = generate(new_sim.url, body)
    assert new.status_code == 400
    assert new.json()["error"]["message"] == "Prompt has 12 image placeholders but 1 image inputs were provided"
    assert generate(old_sim.url, body).status_code == 500
    # and an undecodable image is the same kind of refusal
    broken = {**body, "input_ids": ids, "image_data": ["data:image/png;base64,AAAA"]}
    refused = generate(new_sim.url, broken)
    assert refused.status_code == 400 and "loading IMAGE data at index 0" in refused.json()["error"]["message"]


def test_a_miscounting_server_is_a_fault_the_simulator_can_play(kimi_dir: Path) -> None:
    with SimulatorThread(sglang_version="0.5.23", tokenizer=str(kimi_dir), image_token_skew=3, **FAST) as sim:
        ids = kimi_prompt(1)
        out = generate(sim.url, {"input_ids": ids, "image_data": [png_uri(64, 48)]}).json()
    assert out["meta_info"]["prompt_tokens"] == len(ids) - 1 + kimi_image_tokens(64, 48) + 3


def test_qwen_vl_counts_with_smart_resize() -> None:
    qwen = build_test_tokenizer(default_test_tokenizer_dir(family="qwen3"), family="qwen3")
    options = {"model_family": "qwen3", "sglang_version": "0.5.23", "tokenizer": str(qwen), **FAST}
    with SimulatorThread(**options) as sim:
        ids = [151644, 872, 198, 151652, QWEN_IMAGE_PAD, 151653, 3838, 151645, 198]
        out = generate(sim.url, {"input_ids": ids, "image_data": [png_uri(224, 224)]}).json()
        # an image the processor refuses (over 200:1) is the processor's ValueError: a 400, as a real 0.5.9 answers
        elongated = generate(sim.url, {"input_ids": ids, "image_data": [png_uri(1, 250)]})
    # Qwen3-VL's processor (patch 16, merge 2): 224×224 → 64 tokens, as docs/vision.md says
    assert load_rule(str(qwen)).tokens(224, 224) == 64
    assert out["meta_info"]["prompt_tokens"] == len(ids) - 1 + 64
    assert elongated.status_code == 400
    assert elongated.json()["error"]["message"] == "absolute aspect ratio must be smaller than 200, got 250.0"


def test_a_model_without_an_image_processor_sees_no_images() -> None:
    # Given the simulator with no model directory (no preprocessor_config.json): a text-only model
    with SimulatorThread(sglang_version="0.5.23", **FAST) as sim:
        info = requests.get(f"{sim.url}/model_info", timeout=10).json()
        ids = kimi_prompt(1)
        out = generate(sim.url, {"input_ids": ids, "image_data": [png_uri(64, 48)]}).json()
    # Then it says so, and ignores image_data as a real text-only server does
    assert info["has_image_understanding"] is False
    assert out["meta_info"]["prompt_tokens"] == len(ids)
