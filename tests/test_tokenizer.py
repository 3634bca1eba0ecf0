"""The Kimi-shaped test tokenizer loads like the real one and renders K2.5's chat template shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testing.tokenizer import MARKER, build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]


def ids_of(tok, messages, **kwargs) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_sit_at_kimis_real_ids(tok) -> None:
    for token, token_id in kimi.SPECIAL_TOKENS.items():
        assert tok.convert_tokens_to_ids(token) == token_id, token
    assert len(tok) == kimi.VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == kimi.IM_END
    assert tok.convert_ids_to_tokens(163700) == "<|reserved_token_163700|>"


def test_base_vocabulary_is_exactly_163584(tok_dir: Path) -> None:
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    assert len(data["model"]["vocab"]) == kimi.FIRST_SPECIAL_ID
    assert sorted(data["model"]["vocab"].values()) == list(range(kimi.FIRST_SPECIAL_ID))


def test_system_user_prompt_ends_with_think_start(tok) -> None:
    ids = ids_of(tok, SYSTEM_USER)
    assert ids[0] == kimi.IM_SYSTEM
    assert ids[-2:] == [kimi.IM_MIDDLE, kimi.THINK_START]
    assert ids.count(kimi.IM_END) == 2 and kimi.IM_ASSISTANT in ids
    text = tok.decode(ids)
    assert text == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_thinking_off_ends_with_an_empty_think_block(tok) -> None:
    ids = ids_of(tok, SYSTEM_USER, thinking=False)
    assert ids[-2:] == [kimi.THINK_START, kimi.THINK_END]


def test_default_system_turn_when_none_is_given(tok) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith(
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|>"
    )
    assert "\n" not in text


def test_tool_declarations_render_as_a_tool_declare_turn(tok) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(SYSTEM_USER, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert '"get_weather"' in text
    assert text.index("tool_declare") < text.index("You are terse.")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == kimi.IM_SYSTEM and ids[-1] == kimi.THINK_START


def test_history_reasoning_is_dropped_and_tool_turns_render(tok) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "plan",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "12 C"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>" in text  # history: dropped
    assert "old thoughts" not in text
    assert (
        "<think>plan</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    ) in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n12 C<|im_end|>" in text
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert kimi.TOOL_CALLS_SECTION_BEGIN in ids and kimi.TOOL_CALL_ARGUMENT_BEGIN in ids


def test_plain_text_round_trips(tok) -> None:
    text = "Hello, world! The answer is 42.\n\tdef f(x): return x ** 2  # 注释 café"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < kimi.FIRST_SPECIAL_ID
    assert tok.decode(ids) == text


def test_apply_chat_template_tokenize_matches_render_then_encode(tok) -> None:
    direct = tok.apply_chat_template(SYSTEM_USER, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(direct) == ids_of(tok, SYSTEM_USER)


def test_a_second_build_reuses_the_cached_directory(tok_dir: Path) -> None:
    marker = tok_dir / MARKER
    before = marker.stat().st_mtime_ns
    assert build_test_tokenizer(tok_dir) == tok_dir
    assert marker.stat().st_mtime_ns == before
