"""Model profiles: detected from the tokenizer, every marker id read from it, refused when a reasoning marker
is missing; the spans, the job record, the alarm and the simulator follow the job's profile."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from producer.submit import submit
from producer.submit_options import SubmitError, SubmitOptions
from sglang_sim.config import SimConfig
from sglang_sim.content import ContentConfig, expected_generation
from storage.spans import compute_spans, compute_spans_batch
from testing.datasets import chat_rows, write_jsonl
from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir
from thinkfleet import kimi, profiles
from thinkfleet.settings import Settings
from thinkfleet.state.job import MARKER_FIELDS, JobRecord
from thinkfleet.state.ledger import Finalized
from thinkfleet.tokens import KIMI_TOKENS, SpanTokens
from workers.committer import GroupCommitter
from workers.rows import JobFinalRow

# The real tokenizers' ids (profiles' docstring table); the test tokenizers put the markers there.
QWEN3 = {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658, "<|im_end|>": 151645}
HARMONY = {
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|channel|>": 200005,
    "<|return|>": 200002,
    "<|call|>": 200012,
    "<|constrain|>": 200003,
}
ANALYSIS, FINAL, ASSISTANT = 35644, 17196, 173781


@pytest.fixture(scope="module")
def toks() -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {
        family: AutoTokenizer.from_pretrained(str(build_test_tokenizer(default_test_tokenizer_dir(family=family))))
        for family in ("kimi", "qwen3", "harmony", "plain")
    }


class FakeTok:
    """A tokenizer that is only a vocabulary (``encode`` gives ``encoded`` for a string, else its one id)."""

    def __init__(self, vocab: dict[str, int], encoded: dict[str, list[int]] | None = None) -> None:
        self.vocab, self.encoded = vocab, encoded or {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encoded.get(text, [self.vocab[text]] if text in self.vocab else [1, 2])


# -- detection: every id from the tokenizer ---------------------------------------------------------------
def test_each_test_tokenizer_is_detected_with_its_real_marker_ids(toks: dict[str, Any]) -> None:
    k = profiles.resolve(toks["kimi"])
    assert k.family == "kimi" and k.detected and k.reasoning_spans
    assert k.marker_ids == {
        "think_start_id": kimi.THINK_START,
        "think_end_id": kimi.THINK_END,
        "tool_section_begin_id": kimi.TOOL_CALLS_SECTION_BEGIN,
        "tool_section_end_id": kimi.TOOL_CALLS_SECTION_END,
        "tool_call_begin_id": kimi.TOOL_CALL_BEGIN,
        "tool_call_argument_begin_id": kimi.TOOL_CALL_ARGUMENT_BEGIN,
        "tool_call_end_id": kimi.TOOL_CALL_END,
    }
    assert k.stop_ids == [kimi.IM_END] and not k.warnings

    q = profiles.resolve(toks["qwen3"])
    assert q.family == "qwen3" and q.profile.thinking_kwargs == {"enable_thinking": True}
    assert q.marker_ids == {
        "think_start_id": QWEN3["<think>"],
        "think_end_id": QWEN3["</think>"],
        "tool_section_begin_id": None,
        "tool_section_end_id": None,
        "tool_call_begin_id": QWEN3["<tool_call>"],
        "tool_call_argument_begin_id": None,
        "tool_call_end_id": QWEN3["</tool_call>"],
    }
    assert q.stop_ids == [QWEN3["<|im_end|>"]] and not q.warnings

    h = profiles.resolve(toks["harmony"])
    assert h.family == "harmony" and h.profile.scheme == "harmony"
    assert {t: h.token_ids[t] for t in HARMONY} == HARMONY
    assert h.marker_ids["think_end_id"] == HARMONY["<|end|>"] and h.marker_ids["think_start_id"] is None
    assert (h.marker_ids["tool_call_begin_id"], h.marker_ids["tool_call_end_id"]) == (200005, 200012)
    assert h.channel_ids["analysis"] == [ANALYSIS] and h.channel_ids["final"] == [FINAL]
    assert h.stop_ids == [HARMONY["<|return|>"], HARMONY["<|call|>"]]


def test_a_glm45_tokenizer_is_detected_with_every_marker_id_and_its_thinking_switch() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_test_tokenizer(default_test_tokenizer_dir(family="glm45"))))
    ref = profiles.GLM45.reference_ids
    g = profiles.resolve(tok)
    assert g.family == "glm45" and g.detected and g.reasoning_spans and not g.warnings
    assert g.profile.thinking_kwargs == {"enable_thinking": True}
    assert g.marker_ids == {
        "think_start_id": ref["<think>"],
        "think_end_id": ref["</think>"],
        "tool_section_begin_id": None,
        "tool_section_end_id": None,
        "tool_call_begin_id": ref["<tool_call>"],
        "tool_call_argument_begin_id": ref["<arg_key>"],
        "tool_call_end_id": ref["</tool_call>"],
    }
    assert g.stop_ids == [ref["<|endoftext|>"], ref["<|user|>"], ref["<|observation|>"]]
    assert {t: tok.convert_tokens_to_ids(t) for t in ref} == dict(ref)
    # The template: the model opens <think> itself; thinking off closes an empty block in the prompt.
    chat = [{"role": "user", "content": "hi"}]
    on, off = (
        tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=flag),
            add_special_tokens=False)["input_ids"]
        for flag in (True, False)
    )  # fmt: skip
    assert on[:2] == [151331, 151333] and on[-1] == ref["<|assistant|>"]  # [gMASK]<sop> … <|assistant|>
    assert off[-2:] == [ref["<think>"], ref["</think>"]] and 151360 in off  # /nothink


@pytest.mark.parametrize(
    ("family", "kwargs", "expected"),
    [
        ("qwen3", {"enable_thinking": True}, True),
        ("qwen3", {}, True),  # the template's default is on
        ("qwen3", {"enable_thinking": False}, False),
        ("glm45", {"enable_thinking": True}, True),
        ("glm45", {"enable_thinking": False}, False),
        ("harmony", {"reasoning_effort": "low"}, True),
        ("kimi", {"thinking": True}, False),  # the prompt opens reasoning: rows decide by their prompt
        ("deepseek", {"thinking": True}, False),
        ("none", {}, False),
        ("mystery", {"enable_thinking": True}, False),
    ],
)
def test_rows_are_expected_to_reason_when_the_model_opens_it_and_thinking_is_on(
    family: str, kwargs: dict[str, Any], expected: bool
) -> None:
    assert profiles.expects_reasoning(family, kwargs) is expected
    assert profiles.expects_reasoning(family, kwargs, reasoning_spans=False) is False


def test_ids_follow_the_tokenizer_not_a_table() -> None:
    """DeepSeek-R1-Distill-Qwen keeps DeepSeek's strings on Qwen ids: the ids are the tokenizer's."""
    vocab = {"<｜Assistant｜>": 151645, "<｜end▁of▁sentence｜>": 151643, "<think>": 151648, "</think>": 151649}
    r = profiles.resolve(FakeTok(vocab))
    assert r.family == "deepseek"
    assert (r.marker_ids["think_start_id"], r.marker_ids["think_end_id"]) == (151648, 151649)
    assert r.stop_ids == [151643]
    assert r.missing_tool_tokens and "no tool-call spans" in r.warnings[0]  # said, not silent


def test_a_tokenizer_without_reasoning_markers_is_refused_naming_them(toks: dict[str, Any]) -> None:
    named = r"(?s)no '<think>', '</think>' tokens.*qwen3.*--no-reasoning-spans"
    with pytest.raises(profiles.ProfileError, match=named):
        profiles.resolve(toks["plain"])  # ChatML → qwen3, which needs <think>
    with pytest.raises(profiles.ProfileError, match=r"has no '<\|channel\|>'.*harmony"):
        profiles.resolve(FakeTok({"<|start|>": 1, "<|message|>": 2, "<|end|>": 3}), "harmony")
    off = profiles.resolve(toks["plain"], reasoning_spans=False)
    assert off.family == "qwen3" and not off.reasoning_spans
    assert off.marker_ids["think_start_id"] is None and off.marker_ids["think_end_id"] is None
    assert off.marker_ids["tool_call_begin_id"] == QWEN3["<tool_call>"]  # tool calls are still found
    assert any("reasoning alarm is disabled" in w for w in off.warnings)


def test_no_family_at_all_needs_a_flag(toks: dict[str, Any]) -> None:
    bare = FakeTok({"a": 0, "b": 1})
    with pytest.raises(profiles.ProfileError, match=r"(?s)cannot tell the model family.*--model-family"):
        profiles.resolve(bare)
    none = profiles.resolve(bare, reasoning_spans=False)
    assert none.family == "none" and set(none.marker_ids.values()) == {None}
    with pytest.raises(profiles.ProfileError, match="unknown model family 'llama'"):
        profiles.resolve(bare, "llama")


def test_a_marker_that_is_not_one_token_does_not_count() -> None:
    vocab = {"<|im_start|>": 5, "<|im_end|>": 6, "<think>": 7, "</think>": 8}
    split = FakeTok(vocab, encoded={"</think>": [60, 61, 62]})  # in the vocabulary, but not an added token
    with pytest.raises(profiles.ProfileError, match=r"(?s)no '</think>' token.*encodes to \[60, 61, 62\]"):
        profiles.resolve(split)


def test_model_family_flag_wins_and_the_user_given_ids_stand_in() -> None:
    vocab = {"<|im_start|>": 5, "<|im_end|>": 6}
    r = profiles.resolve(FakeTok(vocab), "qwen3", given_ids={"think_start_id": 70, "think_end_id": 71})
    assert not r.detected and (r.marker_ids["think_start_id"], r.marker_ids["think_end_id"]) == (70, 71)


# -- the job record ----------------------------------------------------------------------------------------
def _encode(values: dict[str, Any]) -> dict[bytes, bytes]:
    return {k.encode(): json.dumps(v).encode() for k, v in values.items()}


def test_old_records_read_as_kimi_with_reasoning_spans_and_new_ones_never_borrow_kimis_ids() -> None:
    old = JobRecord.from_hash(_encode({"name": "old"}))
    assert old.model_family == "kimi" and old.reasoning_spans is True
    assert old.span_tokens() == KIMI_TOKENS
    new = JobRecord.from_hash(_encode({"name": "new", "model_family": "qwen3", "think_end_id": 9}))
    assert {f: getattr(new, f) for f in MARKER_FIELDS} == {**dict.fromkeys(MARKER_FIELDS), "think_end_id": 9}


def test_span_tokens_follow_the_profile() -> None:
    markers = {**dict.fromkeys(MARKER_FIELDS), "think_end_id": 200007, "tool_call_begin_id": 200005}
    markers["tool_call_end_id"] = 200012
    harmony = JobRecord(
        name="h",
        model_family="harmony",
        **markers,
        markers=dict(HARMONY),
        channel_ids={"analysis": [ANALYSIS], "final": [FINAL], "commentary": [12606, 815]},
        sampling_params={"stop_token_ids": [200002, 200012]},
    )
    again = JobRecord.from_hash(harmony.to_hash())
    tokens = again.span_tokens()
    assert tokens.scheme == "harmony" and tokens.reasoning_spans
    assert (tokens.message_start_id, tokens.message_id, tokens.return_id) == (200006, 200008, 200002)
    assert tokens.analysis_channel == (ANALYSIS,) and tokens.final_channel == (FINAL,)
    off = JobRecord(name="o", model_family="qwen3", reasoning_spans=False, think_start_id=1, think_end_id=2)
    assert off.span_tokens().think_start_id is None and off.span_tokens().think_end_id is None
    assert off.span_tokens().reasoning_spans is False


# -- spans -------------------------------------------------------------------------------------------------
def _harmony_tokens() -> SpanTokens:
    return profiles.span_tokens(
        "harmony",
        {"think_end_id": 200007, "tool_call_begin_id": 200005, "tool_call_end_id": 200012},
        (200002, 199999, 200012),
        token_ids=HARMONY,
        channel_ids={"analysis": [ANALYSIS], "final": [FINAL]},
    )


H = HARMONY
ANALYSIS_MSG = [H["<|channel|>"], ANALYSIS, H["<|message|>"], 11, 12, 13]  # reasoning = 11 12 13 at 3:6
FINAL_HEADER = [H["<|end|>"], H["<|start|>"], ASSISTANT, H["<|channel|>"], FINAL, H["<|message|>"]]
CALL_HEADER = [H["<|end|>"], H["<|start|>"], ASSISTANT, H["<|channel|>"], 12606, 815, 316, 28, 44580, 99]
CALL = [*ANALYSIS_MSG, *CALL_HEADER, 220, H["<|constrain|>"], 4108, H["<|message|>"], 31, 32, H["<|call|>"]]


@pytest.mark.parametrize(
    ("ids", "want"),
    [
        # analysis, then the final answer and <|return|> (a stop token, in no span)
        ([*ANALYSIS_MSG, *FINAL_HEADER, 21, 22, H["<|return|>"]], (3, 6, True, 12, 14, (), H["<|return|>"])),
        # a tool call: from its <|channel|> to its <|call|> included; no final answer
        (CALL, (3, 6, True, len(CALL) - 1, len(CALL) - 1, ((9, len(CALL)),), H["<|call|>"])),
        # cut off inside the reasoning (length)
        (ANALYSIS_MSG, (3, 6, False, 6, 6, (), None)),
        # the analysis never closed: reasoning runs to the stop token, no </think>-equivalent
        ([*ANALYSIS_MSG, H["<|return|>"]], (3, 6, False, 6, 6, (), H["<|return|>"])),
        # no analysis message at all: empty reasoning, the final message is the answer
        ([H["<|channel|>"], FINAL, H["<|message|>"], 21, H["<|return|>"]], (0, 0, False, 3, 4, (), H["<|return|>"])),
    ],
)
def test_harmony_spans_are_channel_delimited(ids: list[int], want: tuple[Any, ...]) -> None:
    tokens = _harmony_tokens()
    s = compute_spans(ids, **asdict(tokens))
    got = (s.reasoning_start, s.reasoning_end, s.has_think_end, s.answer_start, s.answer_end)
    assert (*got, s.tool_call_spans, s.stop_token) == want
    if s.has_think_end:
        assert ids[s.reasoning_end] == tokens.think_end_id  # what verify's row checks assume
    for start, end in s.tool_call_spans:
        assert ids[start] == tokens.tool_call_begin_id and ids[end - 1] == tokens.tool_call_end_id


def test_harmony_batch_equals_row_by_row_on_simulated_outputs() -> None:
    tokens = _harmony_tokens()
    config = ContentConfig(model_family="harmony", tool_call_share=0.4)
    params = {"max_new_tokens": 700, "stop_token_ids": [200002, 200012]}
    outs = [expected_generation([200006, 1428, i], params, config).output_ids for i in range(40)]
    flat = np.concatenate([np.asarray(o, dtype=np.int64) for o in outs])
    offsets = np.cumsum([0, *map(len, outs)])
    batch = compute_spans_batch(flat, offsets, False, tokens)
    rows = [compute_spans(o, **asdict(tokens)) for o in outs]
    assert [batch.row(i) for i in range(len(outs))] == rows
    assert any(r.tool_call_spans for r in rows) and any(r.answer_end > r.answer_start for r in rows)


def test_qwen3_answer_ends_at_the_first_tool_call() -> None:
    q = QWEN3
    tokens = SpanTokens(
        q["<think>"], q["</think>"], None, None, q["<tool_call>"], q["</tool_call>"], (q["<|im_end|>"],)
    )
    ids = [q["<think>"], 5, 6, q["</think>"], 7, q["<tool_call>"], 8, q["</tool_call>"], 9, q["<tool_call>"], 10]
    ids += [q["</tool_call>"], q["<|im_end|>"]]
    s = compute_spans(ids, prompt_ends_with_think_start=False, **asdict(tokens))
    assert (s.reasoning_start, s.reasoning_end, s.has_think_end) == (1, 3, True)
    assert (s.answer_start, s.answer_end) == (4, 5) and s.tool_call_spans == ((5, 8), (9, 12))
    batch = compute_spans_batch(np.asarray(ids), np.array([0, len(ids)]), False, tokens)
    assert batch.row(0) == s


# -- the submit ---------------------------------------------------------------------------------------------
def test_submit_refuses_a_tokenizer_without_think_and_runs_with_no_reasoning_spans(
    redis_url: str, redis_client: Any, tmp_path: Path
) -> None:
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"), key_prefix="tfp", queue="qp")
    tok = str(build_test_tokenizer(default_test_tokenizer_dir(family="plain"), family="plain"))
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(3, words=10))
    base = {"paths": [path], "job": "plain", "tokenizer": tok, "processes": 1, "context_length": 32_768}
    with pytest.raises(SubmitError, match="has no '<think>', '</think>' tokens"):
        submit(settings, SubmitOptions(**base))
    assert redis_client.llen("qp") == 0, "nothing enqueued"
    report = submit(settings, SubmitOptions(**base, reasoning_spans=False))
    assert report.enqueued == 3 and any("reasoning alarm is disabled" in w for w in report.warnings)
    record = JobRecord.load(redis_client, settings.keys, "plain")
    assert record is not None and record.model_family == "qwen3" and record.reasoning_spans is False
    assert record.think_start_id is None and record.think_end_id is None
    assert record.chat_template_kwargs == {"enable_thinking": True}
    assert record.span_tokens().reasoning_spans is False
    # A re-submit with reasoning spans on is another setup: refused, naming it.
    with pytest.raises(SubmitError, match=r"has no '<think>'"):
        submit(settings, SubmitOptions(**base))


def test_submit_records_the_detected_family_and_its_thinking_switch(
    redis_url: str, redis_client: Any, tmp_path: Path
) -> None:
    settings = Settings(redis_url=redis_url, output_uri=str(tmp_path / "out"), key_prefix="tfq", queue="qq")
    tok = str(build_test_tokenizer(default_test_tokenizer_dir(family="harmony"), family="harmony"))
    path = write_jsonl(tmp_path / "alpha.jsonl", chat_rows(2, words=10))
    opts = SubmitOptions(paths=[path], job="h", tokenizer=tok, processes=1, context_length=131_072)
    report = submit(settings, opts)
    assert not report.warnings, report.warnings  # harmony prompts end with <|start|>assistant, not <think>
    record = JobRecord.load(redis_client, settings.keys, "h")
    assert record is not None and record.model_family == "harmony" and record.reasoning_spans
    assert record.chat_template_kwargs == {"reasoning_effort": "medium"}
    assert record.sampling_params["stop_token_ids"] == [200002, 199999, 200012]
    assert record.markers["<|start|>"] == 200006 and record.channel_ids["analysis"] == [ANALYSIS]
    assert record.span_tokens().scheme == "harmony"
    with pytest.raises(SubmitError, match=r"reasoning spans True ≠ False"):
        submit(settings, SubmitOptions(**{**opts.__dict__, "reasoning_spans": False}))


# -- the alarm ---------------------------------------------------------------------------------------------
class _Writer:
    def part_name(self, job: str, dataset: str) -> str:
        return f"{job}/{dataset}/part-0"

    def write(self, *args: Any, **kwargs: Any) -> str:
        return "part"

    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        return b""

    def write_encoded(self, *args: Any, **kwargs: Any) -> str:
        return "part"

    def exists(self, part: str) -> bool:
        return True


class _Ledger:
    def fence(self, job: str, prompt_id: str) -> None:
        return None  # no claim held here

    async def mark_part(self, *args: Any) -> dict[str, str]:
        return {}  # no row fenced

    async def finalize(self, job: str, dataset: str, rows: list[Any], *args: Any) -> Finalized:
        return Finalized(len(rows), True, len(rows), len(rows), {})  # the Lua script says: alarm


@pytest.mark.parametrize("reasoning_spans", [True, False])
def test_the_committer_never_alarms_for_a_job_without_reasoning_spans(reasoning_spans: bool) -> None:
    alarms: list[str] = []

    async def on_alarm(job: str, seen: int, miss: int) -> None:
        alarms.append(job)

    async def run() -> None:
        committer = GroupCommitter(_Writer(), _Ledger(), 10, 0.01, 1, 0.5, on_alarm)  # type: ignore[arg-type]
        committer.start()
        final = JobFinalRow("p", 10, False, False, reasoning_alarm=reasoning_spans)
        await asyncio.wait_for(committer.commit("j", "d", {}, final), 5)

    asyncio.run(run())
    assert alarms == (["j"] if reasoning_spans else [])


def test_an_alarm_that_cannot_be_recorded_leaves_the_rows_stored_and_the_committer_running() -> None:
    # Given a committer whose alarm write fails (Redis answered an error in the middle of the flush).
    async def on_alarm(job: str, seen: int, miss: int) -> None:
        raise redis.exceptions.ConnectionError("Redis went away during the alarm write")

    async def run() -> list[str]:
        committer = GroupCommitter(_Writer(), _Ledger(), 10, 0.01, 1, 0.5, on_alarm)  # type: ignore[arg-type]
        committer.start()
        # When two rows are committed one after the other, each firing the alarm.
        first = await asyncio.wait_for(committer.commit("j", "d", {}, JobFinalRow("p1", 10, False, False)), 30)
        second = await asyncio.wait_for(committer.commit("j", "d", {}, JobFinalRow("p2", 10, False, False)), 30)
        return [first, second]

    # Then both rows are stored (their part named), and the group-commit task is still alive for the second.
    assert asyncio.run(run()) == ["j/d/part-0", "j/d/part-0"]


# -- the simulator ------------------------------------------------------------------------------------------
def test_the_simulator_speaks_each_family() -> None:
    params = {"max_new_tokens": 4000, "sampling_seed": 3}
    for family, start, end in (("qwen3", QWEN3["<think>"], QWEN3["</think>"]), ("harmony", None, H["<|end|>"])):
        config = ContentConfig(model_family=family, tool_call_share=0.3)
        outs = [expected_generation([1, 2, i], params, config) for i in range(30)]
        first_special = config.vocabulary.first_special_id
        for g in outs:
            specials = {t for t in g.output_ids if t >= first_special}
            assert specials <= set(range(first_special, config.vocabulary.vocab_size))  # the family's own
            if start is not None:
                assert g.output_ids[0] == start
            if g.finish_reason["type"] == "stop":  # the natural end (the lognormal tail runs past the cap)
                assert end in g.output_ids and g.reasoning_tokens == g.output_ids.index(end) + 1
                assert g.output_ids[-1] in config.eos_token_ids
        assert any(g.tool_call for g in outs) and sum(g.finish_reason["type"] == "stop" for g in outs) > 20
    # The prompt already opened <think> (a Qwen3-Thinking-2507 style template): the model does not repeat it.
    opened = expected_generation([1, QWEN3["<think>"]], params, ContentConfig(model_family="qwen3"))
    assert opened.output_ids[0] != QWEN3["<think>"]
    # DeepSeek-R1-0528 (the prompt ends <think>\\n) and GLM-4.5 (the model opens <think>): ids from their profiles.
    for family, prompt, opens in (("deepseek", [5, 128804, 128798, 201], True), ("glm45", [5, 151337], False)):
        config = ContentConfig(model_family=family, tool_call_share=0.5)
        v = config.vocabulary
        ref = profiles.PROFILES[family].reference_ids
        assert (v.think_start, v.think_end) == (ref["<think>"], ref["</think>"])
        outs = [expected_generation([*prompt[:-1], i, prompt[-1]], params, config) for i in range(40)]
        for g in outs:
            ids = g.output_ids
            assert (ids[0] == v.think_start) is not opens and ids.count(v.think_end) <= 1
            assert min(ids) >= v.filler_low or ids[-1] in v.eos_token_ids
            if g.finish_reason["type"] == "stop":
                assert v.think_end in ids and ids[-1] == (v.call_end_of_turn if g.tool_call else v.end_of_turn)
                if g.tool_call and v.tool_section is not None:
                    assert ids[-2] == v.tool_section[1] and v.tool_section[0] in ids
                if g.tool_call:
                    assert ids.count(v.tool_call[0]) == ids.count(v.tool_call[1]) == ids.count(v.tool_sep)
        assert any(g.tool_call for g in outs) and sum(g.finish_reason["type"] == "stop" for g in outs) > 25
        assert (
            SimConfig.from_flat(model_family=family).server.vocab_size == profiles.PROFILES[family].reference_vocab_size
        )
    # Thinking off: the prompt closed an empty block, so the model answers at once (no think markers).
    closed = expected_generation(
        [1, QWEN3["<think>"], 9, QWEN3["</think>"], 9], params, ContentConfig(model_family="qwen3")
    )
    assert not {QWEN3["<think>"], QWEN3["</think>"]} & set(closed.output_ids)
    sim = SimConfig.from_flat(model_family="harmony")
    assert sim.server.vocab_size == 201_088 and sim.content.eos_token_ids == (200002, 199999, 200012)
    assert SimConfig.from_flat(model_family="qwen3", vocab_size=200_000).server.vocab_size == 200_000


# -- the export hook ----------------------------------------------------------------------------------------
def test_parse_tool_call_reads_each_familys_header() -> None:
    assert profiles.parse_tool_call("kimi", "functions.get_weather:0", '{"a": 1}') == ("get_weather", '{"a": 1}')
    assert profiles.parse_tool_call("harmony", "commentary to=functions.get_weather <|constrain|>json", "{}") == (
        "get_weather",
        "{}",
    )
    assert profiles.parse_tool_call("deepseek", "function", 'get_weather\n```json\n{"a": 1}\n```') == (
        "get_weather",
        '{"a": 1}',
    )
    assert profiles.parse_tool_call("deepseek", "get_weather", '{"a": 1}') == ("get_weather", '{"a": 1}')
    name, args = profiles.parse_tool_call("glm45", "get_weather\n", "city</arg_key>\n<arg_value>Paris</arg_value>\n")
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
