"""Spans that depend on how a family's template ends the prompt, and on how its outputs get cut off:
``<think>\\n`` prompts (Qwen3-Thinking-2507, DeepSeek-R1-0528), and harmony calls cut before ``<|call|>``."""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import pytest

from storage.checks import flat_ids, row_problems
from storage.schema import rows_to_table
from storage.spans import SpanTokens, compute_spans, compute_spans_batch, prompt_opens_reasoning, prompts_open_reasoning
from testing.rows import make_row
from thinkfleet import profiles

Q = profiles.QWEN3.reference_ids
THINK, END_THINK, CALL, END_CALL, IM_END = (
    Q["<think>"],
    Q["</think>"],
    Q["<tool_call>"],
    Q["</tool_call>"],
    Q["<|im_end|>"],
)
NL, NLNL = 198, 271  # "\n" and "\n\n" in Qwen3's real vocabulary
QWEN3 = SpanTokens(THINK, END_THINK, None, None, CALL, END_CALL, (IM_END,), prompt_trailing_ids=(NL, NLNL))
ASSISTANT = [Q["<|im_start|>"], 77091, NL]  # <|im_start|>assistant\n


@pytest.mark.parametrize(
    ("tail", "opens"),
    [
        ([THINK], True),  # Kimi-K2.5: the prompt ends with <think>
        ([THINK, NL], True),  # Qwen3-Thinking-2507, DeepSeek-R1-0528: <think>\n
        ([THINK, NL, NL], True),
        ([THINK, NLNL], True),
        ([THINK, NL, NL, NL], False),  # more whitespace than a template writes
        ([THINK, 5], False),  # an ordinary id after <think>: the user wrote it
        ([THINK, NL, NL, END_THINK, NLNL], False),  # Qwen3 with thinking off: <think>\n\n</think>\n\n
        ([], False),  # the generation prompt alone: the model opens reasoning itself
        ([NL], False),
    ],
)
def test_a_prompt_opens_reasoning_when_it_ends_with_think_start_and_whitespace(tail: list[int], opens: bool) -> None:
    prompt = [*ASSISTANT, *tail]
    assert prompt_opens_reasoning(prompt, QWEN3) is opens
    assert prompt_opens_reasoning(np.asarray(prompt), QWEN3) is opens
    # The batch twin agrees, also with prompts shorter than the window.
    prompts = [prompt, tail, [THINK], [NL], []]
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    offsets = np.cumsum([0, *map(len, prompts)])
    want = [prompt_opens_reasoning(p, QWEN3) for p in prompts]
    assert prompts_open_reasoning(flat, offsets, QWEN3).tolist() == want


def test_without_recorded_whitespace_ids_only_an_exact_think_start_opens() -> None:
    """A job record from before whitespace ids were recorded reads as it did: the last id decides."""
    old = replace(QWEN3, prompt_trailing_ids=())
    assert prompt_opens_reasoning([*ASSISTANT, THINK], old)
    assert not prompt_opens_reasoning([*ASSISTANT, THINK, NL], old)
    assert not prompt_opens_reasoning([*ASSISTANT, THINK, NL], replace(QWEN3, think_start_id=None))


def test_a_think_newline_prompt_row_gets_its_reasoning_span_through_storage() -> None:
    """Qwen3-Thinking-2507: the output holds reasoning, </think>, the answer — no <think> of its own."""
    prompt = [*ASSISTANT, THINK, NL]
    out = [11, 12, 13, END_THINK, NLNL, 21, 22, IM_END]
    worker = compute_spans(out, prompt_ends_with_think_start=prompt_opens_reasoning(prompt, QWEN3), **asdict(QWEN3))
    assert (worker.reasoning_start, worker.reasoning_end, worker.has_think_end) == (0, 3, True)
    assert (worker.answer_start, worker.answer_end) == (4, 7)

    # The schema computes the same spans when a row comes without them …
    table = rows_to_table([make_row("p-0", input_ids=prompt, output_ids=out)], tokens=QWEN3)
    row = table.to_pylist()[0]
    assert (row["reasoning_start"], row["reasoning_end"], row["has_think_end"]) == (0, 3, True)
    assert (row["answer_start"], row["answer_end"], row["stop_token"]) == (4, 7, IM_END)
    # … verify's row checks find them right, and count the row as a thinking-mode row that closed reasoning.
    problems, stats = row_problems(table, QWEN3)
    assert problems == {}
    assert (stats.thinking_rows, stats.think_end_rows) == (1, 1)

    # The old rule (last prompt id only) would have lost the reasoning: spans are checked against the ids.
    lost = rows_to_table(
        [make_row("p-0", input_ids=prompt, output_ids=out)], tokens=replace(QWEN3, prompt_trailing_ids=())
    )
    assert lost["reasoning_end"][0].as_py() == 0
    problems, _ = row_problems(lost, QWEN3)
    assert "reasoning_end differs from the ids (recomputed reasoning_end)" in problems["p-0"]


def test_the_alarm_counts_think_newline_prompts_whose_outputs_never_close_reasoning() -> None:
    prompt = [*ASSISTANT, THINK, NL]
    rows = [make_row(f"p-{i}", input_ids=prompt, output_ids=[11 + i, 12, 13, IM_END]) for i in range(4)]
    table = rows_to_table(rows, tokens=QWEN3)
    problems, stats = row_problems(table, QWEN3)
    assert problems == {}
    assert (stats.thinking_rows, stats.think_end_rows) == (4, 0)  # the seed's bug, seen
    values, offsets = flat_ids(table["input_ids"])
    assert prompts_open_reasoning(values, offsets, QWEN3).all()


def test_resolve_records_the_newline_id_and_the_job_reads_it_back() -> None:
    class Tok:
        def get_vocab(self) -> dict[str, int]:
            return {"<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": THINK, "</think>": END_THINK}

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            known = {**self.get_vocab(), "\n": NL}
            return {"input_ids": [known[text]] if text in known else [1, 2]}

    res = profiles.resolve(Tok())
    assert res.family == "qwen3" and res.token_ids["\n"] == NL and "\n\n" not in res.token_ids
    tokens = profiles.span_tokens("qwen3", res.marker_ids, res.stop_ids, token_ids=res.token_ids)
    assert tokens.prompt_trailing_ids == (NL,)
    off = profiles.resolve(Tok(), reasoning_spans=False)
    assert "\n" not in off.token_ids  # no reasoning spans: nothing opens reasoning


# -- harmony: a call cut off before <|call|> -----------------------------------------------------------------
H = profiles.HARMONY.reference_ids
ANALYSIS, FINAL = H["analysis"], H["final"]
HARMONY = profiles.span_tokens(
    "harmony",
    {"think_end_id": H["<|end|>"], "tool_call_begin_id": H["<|channel|>"], "tool_call_end_id": H["<|call|>"]},
    (H["<|return|>"], H["<|call|>"]),
    token_ids=dict(H),
    channel_ids={"analysis": [ANALYSIS], "final": [FINAL]},
)
REASONING = [H["<|channel|>"], ANALYSIS, H["<|message|>"], 11, 12, H["<|end|>"], H["<|start|>"], H["assistant"]]
CALL_HEADER = [H["<|channel|>"], 12606, 815, 316, 28, 44580, 99, 220, H["<|constrain|>"], 4108]  # commentary to=…


@pytest.mark.parametrize(
    ("out", "calls"),
    [
        # cut inside the arguments: the call runs to the end, and does not end with <|call|>
        ([*REASONING, *CALL_HEADER, H["<|message|>"], 31, 32], ((8, 21),)),
        # cut inside the header (after the channel name): still a call of this output
        ([*REASONING, *CALL_HEADER[:5]], ((8, 13),)),
        # cut right after <|channel|>: the channel is unknown, no span
        ([*REASONING, H["<|channel|>"]], ()),
        # the complete call, for comparison: through <|call|>, the stop token
        ([*REASONING, *CALL_HEADER, H["<|message|>"], 31, H["<|call|>"]], ((8, 21),)),
        # cut inside the final answer or the reasoning: no call
        ([*REASONING, H["<|channel|>"], FINAL, H["<|message|>"], 21, 22], ()),
        (REASONING[:5], ()),
    ],
)
def test_a_harmony_call_cut_before_its_call_token_is_spanned_to_the_end(
    out: list[int], calls: tuple[tuple[int, int], ...]
) -> None:
    s = compute_spans(out, **asdict(HARMONY))
    assert s.tool_call_spans == calls
    for start, end in calls:
        assert out[start] == HARMONY.tool_call_begin_id
        complete = out[end - 1] == HARMONY.tool_call_end_id  # the same test as for a cut-off Kimi call
        assert complete == (out[-1] == H["<|call|>"])
    batch = compute_spans_batch(np.asarray(out, dtype=np.int64), np.array([0, len(out)]), False, HARMONY)
    assert batch.row(0) == s
    table = rows_to_table(
        [make_row("h-0", input_ids=[H["<|start|>"], H["assistant"]], output_ids=out, finish_reason="length")],
        tokens=HARMONY,
    )
    assert row_problems(table, HARMONY)[0] == {}


# -- DeepSeek-R1-0528: its test tokenizer, detected, with the real marker ids --------------------------------------
def test_a_deepseek_tokenizer_is_detected_with_its_real_ids_and_its_think_newline_prompt_opens_reasoning() -> None:
    from transformers import AutoTokenizer

    from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir

    path = build_test_tokenizer(default_test_tokenizer_dir(family="deepseek"), family="deepseek")
    tok = AutoTokenizer.from_pretrained(str(path))
    res = profiles.resolve(tok)
    assert res.family == "deepseek" and res.detected and res.missing_tool_tokens == ()
    ds = profiles.DEEPSEEK
    want = {role: ds.reference_ids[text] for role, text in ds.markers.items() if text is not None}
    assert {role: res.marker_ids[role] for role in want} == want
    assert res.stop_ids == [ds.reference_ids["<｜end▁of▁sentence｜>"]] == [tok.eos_token_id]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True, **ds.thinking_kwargs
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    tokens = profiles.span_tokens("deepseek", res.marker_ids, res.stop_ids, token_ids=res.token_ids)
    think, end_think = want["think_start_id"], want["think_end_id"]
    assert prompt[0] == 0 and prompt[-3:] == [ds.reference_ids["<｜Assistant｜>"], think, res.token_ids["\n"]]
    assert prompt_opens_reasoning(prompt, tokens)
    # reasoning, </think>, answer, one tool call in its section, <｜end▁of▁sentence｜>
    sec, sec_end, call, sep, call_end = (
        want["tool_section_begin_id"],
        want["tool_section_end_id"],
        want["tool_call_begin_id"],
        want["tool_call_argument_begin_id"],
        want["tool_call_end_id"],
    )
    out = [5, 6, end_think, 7, sec, call, 8, sep, 9, call_end, sec_end, 1]
    s = compute_spans(out, prompt_ends_with_think_start=True, **asdict(tokens))
    assert (s.reasoning_start, s.reasoning_end, s.has_think_end, s.answer_start, s.answer_end) == (0, 2, True, 3, 4)
    assert s.tool_call_spans == ((5, 10),) and s.stop_token == 1
