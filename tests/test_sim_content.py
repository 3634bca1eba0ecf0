"""The simulated model's outputs: deterministic, Kimi-shaped, heavy-tailed (pure library, no server)."""

from __future__ import annotations

import random
import statistics

import pytest

from sglang_sim.content import ContentConfig, expected_generation, reasoning_token_count
from thinkfleet import kimi

THINK_START_PROMPT = [kimi.IM_ASSISTANT, 1, 2, kimi.IM_MIDDLE, kimi.THINK_START]
TOOL_IDS = {
    kimi.TOOL_CALLS_SECTION_BEGIN,
    kimi.TOOL_CALLS_SECTION_END,
    kimi.TOOL_CALL_BEGIN,
    kimi.TOOL_CALL_ARGUMENT_BEGIN,
    kimi.TOOL_CALL_END,
}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(kimi.FIRST_SPECIAL_ID) for _ in range(rng.randint(20, 200))] + [kimi.THINK_START]
        for _ in range(n)
    ]


def test_same_prompt_and_seed_give_identical_ids_and_other_seeds_differ() -> None:
    params = {"max_new_tokens": 4096, "sampling_seed": 7}
    first = expected_generation(THINK_START_PROMPT, params)
    again = expected_generation(list(THINK_START_PROMPT), dict(params))
    other_seed = expected_generation(THINK_START_PROMPT, {**params, "sampling_seed": 8})
    other_prompt = expected_generation([*THINK_START_PROMPT[:-1], 5, kimi.THINK_START], params)

    assert first == again
    assert first.output_ids != other_seed.output_ids
    assert first.output_ids != other_prompt.output_ids
    # sampling_seed None is seed 0
    assert expected_generation(THINK_START_PROMPT, {"max_new_tokens": 64}) == expected_generation(
        THINK_START_PROMPT, {"max_new_tokens": 64, "sampling_seed": 0}
    )


def test_lengths_follow_the_seed_runs_heavy_tailed_distribution() -> None:
    lengths = [len(expected_generation(p, {"max_new_tokens": 200_000}).output_ids) for p in prompts(1500)]

    assert 520 <= statistics.median(lengths) <= 780  # seed: 646
    assert 1100 <= statistics.mean(lengths) <= 1800  # seed: 1416
    assert sum(n > 5000 for n in lengths) / len(lengths) > 0.02  # a real tail (seed: 19 of 488)


def test_normal_output_is_reasoning_think_end_answer_im_end() -> None:
    config = ContentConfig(tool_call_share=0.0)
    for prompt in prompts(200, seed=1):
        gen = expected_generation(prompt, {"max_new_tokens": 200_000}, config)
        ids = gen.output_ids

        assert gen.finish_reason == {"type": "stop", "matched": kimi.IM_END}
        assert ids[-1] == kimi.IM_END and ids.count(kimi.THINK_END) == 1
        assert all(t < kimi.FIRST_SPECIAL_ID for t in ids if t not in (kimi.THINK_END, kimi.IM_END))
        think_end = ids.index(kimi.THINK_END)
        assert 0.5 <= think_end / len(ids) <= 0.85
        assert gen.reasoning_tokens == think_end + 1 == reasoning_token_count(ids)


def test_tool_call_share_produces_native_kimi_tool_call_sections() -> None:
    config = ContentConfig(tool_call_share=0.5)
    gens = [expected_generation(p, {"max_new_tokens": 200_000}, config) for p in prompts(400, seed=2)]
    calls = [g for g in gens if g.tool_call]

    assert 0.4 <= len(calls) / len(gens) <= 0.6
    direct = 0
    for gen in calls:
        ids = gen.output_ids
        section = ids.index(kimi.TOOL_CALLS_SECTION_BEGIN)
        assert ids[-2:] == [kimi.TOOL_CALLS_SECTION_END, kimi.IM_END]
        markers = [t for t in ids[section:] if t in TOOL_IDS]
        body = markers[1:-1]
        assert len(body) % 3 == 0 and body == [
            kimi.TOOL_CALL_BEGIN,
            kimi.TOOL_CALL_ARGUMENT_BEGIN,
            kimi.TOOL_CALL_END,
        ] * (len(body) // 3)
        if kimi.THINK_END in ids:
            assert ids.index(kimi.THINK_END) < section
        else:
            direct += 1  # straight from reasoning into the tool section
        assert gen.finish_reason == {"type": "stop", "matched": kimi.IM_END}
    assert direct > 0


def test_no_think_end_mode_never_emits_think_end() -> None:
    config = ContentConfig(think_end=False, tool_call_share=0.3)
    for prompt in prompts(200, seed=3):
        gen = expected_generation(prompt, {"max_new_tokens": 200_000}, config)

        assert kimi.THINK_END not in gen.output_ids
        assert gen.reasoning_tokens == len(gen.output_ids)


def test_max_new_tokens_cuts_to_a_prefix_with_a_length_finish() -> None:
    full = expected_generation(THINK_START_PROMPT, {"max_new_tokens": 200_000}).output_ids
    for cap in (1, 7, len(full) - 1, len(full)):
        gen = expected_generation(THINK_START_PROMPT, {"max_new_tokens": cap})

        assert gen.output_ids == full[:cap]
        assert gen.finish_reason == {"type": "length", "length": cap}  # length is checked before stop
    assert expected_generation(THINK_START_PROMPT, {"max_new_tokens": 0}).output_ids == []


def test_stop_token_id_in_output_stops_there_and_is_included() -> None:
    full = expected_generation(THINK_START_PROMPT, {"max_new_tokens": 200_000}).output_ids
    target = full[5]
    gen = expected_generation(THINK_START_PROMPT, {"max_new_tokens": 200_000, "stop_token_ids": [target]})

    assert gen.output_ids == full[: full.index(target) + 1]
    assert gen.finish_reason == {"type": "stop", "matched": target}


@pytest.mark.parametrize("cap", [50, 5000])
def test_ignore_eos_decodes_past_the_end_token_to_max_new_tokens(cap: int) -> None:
    natural = expected_generation(THINK_START_PROMPT, {"max_new_tokens": 200_000}).output_ids
    gen = expected_generation(THINK_START_PROMPT, {"max_new_tokens": cap, "ignore_eos": True})

    assert len(gen.output_ids) == cap
    assert gen.finish_reason == {"type": "length", "length": cap}
    assert gen.output_ids[: min(cap, len(natural))] == natural[:cap]
