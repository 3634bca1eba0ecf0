"""The simulator's tool calls with a tool catalogue decode to real calls, in each family's native tokens.

Given the Kimi, Qwen3, DeepSeek, GLM-4.5 and gpt-oss (harmony) test tokenizers and a catalogue built with each
(sglang_sim/tools.py), when the simulator answers with tool calls, then the stored spans decode
(storage/conversations.py, as the worker decodes them to chain) to one OpenAI call per call the simulator emitted —
single and parallel (harmony: one per message), in order — with the catalogue's names and JSON arguments; malformed
calls carry arguments that are not JSON (and keep their name, but for Qwen3, whose call is one JSON object); a call
cut by ``max_new_tokens`` is a span without its end marker. Without a catalogue the ids are exactly as before.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from sglang_sim.content import ContentConfig, expected_generation
from sglang_sim.tools import DEFAULT_TOOLS, write_catalogue
from storage.conversations import ToolMarkers, output_message
from storage.spans import compute_spans, prompt_opens_reasoning
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import profiles
from thinkfleet.template import load_tokenizer, render_ids


def _family(family: str) -> tuple[Any, Any, ToolMarkers]:
    tok = load_tokenizer(str(build_test_tokenizer(default_test_tokenizer_dir(family=family), family=family)))
    res = profiles.resolve(tok, family)
    # As a job record gives them (harmony reads <|start|>, <|message|> and the channel names from these).
    tokens = profiles.span_tokens(
        family, res.marker_ids, res.stop_ids, token_ids=res.token_ids, channel_ids=res.channel_ids
    )
    ids = res.marker_ids
    markers = ToolMarkers(
        ids["tool_call_begin_id"], ids.get("tool_call_argument_begin_id"), ids["tool_call_end_id"], family
    )
    return tok, tokens, markers


def _prompt(tok: Any) -> list[int]:
    return render_ids(tok, [{"role": "user", "content": "What is 240 / 80?"}], None, {})


@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek", "glm45", "harmony"])
def test_catalogue_calls_decode_to_named_calls_single_parallel_and_malformed(family: str, tmp_path: Path) -> None:
    tok, tokens, markers = _family(family)
    path = write_catalogue(tmp_path / "tools.json", tok, family)
    config = ContentConfig(model_family=family, tool_call_share=1.0, tool_catalogue=str(path), max_tool_calls=3,
                           malformed_tool_call_share=0.2, length_median_tokens=40)  # fmt: skip
    names = {n for n, _ in DEFAULT_TOOLS}
    good_args = {json.dumps(a) for _, a in DEFAULT_TOOLS}
    base = _prompt(tok)
    seen_parallel = seen_malformed = 0
    for seed in range(40):
        gen = expected_generation(base, {"max_new_tokens": 4000, "sampling_seed": seed}, config)
        assert gen.tool_call and gen.finish_reason["type"] == "stop"
        opens = prompt_opens_reasoning(base, tokens)
        spans = compute_spans(gen.output_ids, **{**asdict(tokens), "prompt_ends_with_think_start": opens})
        message = output_message(
            tok, gen.output_ids, (spans.reasoning_start, spans.reasoning_end), (spans.answer_start, spans.answer_end),
            spans.tool_call_spans, markers,
        )  # fmt: skip
        calls = message["tool_calls"]
        assert len(calls) == len(spans.tool_call_spans) >= 1
        seen_parallel += len(calls) > 1
        for i, call in enumerate(calls):
            name, args = call["function"]["name"], call["function"]["arguments"]
            if args in good_args:
                assert name in names, call
                if family == "kimi":
                    assert call["id"] == f"functions.{name}:{i}"
                continue
            # Malformed: arguments that are not JSON (a Qwen3 call is one JSON object: its name is lost with it).
            seen_malformed += 1
            assert name in (names if family != "qwen3" else {""}), call
            with pytest.raises(ValueError):
                json.loads(args)
    # (A harmony message addresses one recipient: gpt-oss calls one tool per message, the simulator one per output.)
    assert seen_parallel or family == "harmony", "some turns call several tools"
    assert seen_malformed, "some calls are malformed"


def test_a_call_cut_by_max_new_tokens_is_an_open_span(tmp_path: Path) -> None:
    tok, tokens, _ = _family("kimi")
    config = ContentConfig(tool_call_share=1.0, tool_catalogue=str(write_catalogue(tmp_path / "t.json", tok, "kimi")),
                           length_median_tokens=40)  # fmt: skip
    whole = expected_generation(_prompt(tok), {"max_new_tokens": 4000}, config).output_ids
    cut_at = len(whole) - 4  # inside the last call's arguments
    cut = expected_generation(_prompt(tok), {"max_new_tokens": cut_at}, config)
    assert cut.output_ids == whole[:cut_at] and cut.finish_reason["type"] == "length"
    spans = compute_spans(cut.output_ids, **asdict(tokens))
    assert cut.output_ids[spans.tool_call_spans[-1][1] - 1] != tokens.tool_call_end_id


def test_without_a_catalogue_outputs_are_unchanged() -> None:
    # The catalogue fields' defaults draw nothing: the ids every existing test checks are those of the simulator
    # before catalogues (this digest was computed with that version of sglang_sim/content.py).
    import hashlib

    digest = hashlib.sha256()
    for family in ("kimi", "qwen3"):
        for seed in range(20):
            gen = expected_generation([1000 + i for i in range(30)], {"max_new_tokens": 3000, "sampling_seed": seed},
                                      ContentConfig(model_family=family, tool_call_share=0.5))  # fmt: skip
            digest.update(json.dumps(gen.output_ids).encode())
    assert digest.hexdigest()[:16] == "8f10bb7907255d2c"
