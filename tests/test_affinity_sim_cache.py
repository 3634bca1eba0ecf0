"""The simulator's prefix cache (sglang_sim/cache.py) follows SGLang 0.5.9's radix cache for what host affinity
measures: a prompt is matched on all but its last id, page-aligned; a finished turn's prompt + every output id is
cached for the turn after it; a prefill short of free slots evicts as many tokens' worth of whole leaves, least
recently used first, never the path it is serving; and the engine charges prefill time for uncached tokens only.
(The same rules against a real server: tests/real_sglang/test_real_cache.py.)"""

from __future__ import annotations

from sglang_sim.cache import PrefixCache
from sglang_sim.engine import Engine, EngineConfig, SimRequest

BLOCK = 16


def test_a_prompt_sent_twice_is_cached_on_its_first_len_minus_one_ids_page_aligned() -> None:
    cache = PrefixCache(BLOCK, 1000)
    prompt = list(range(100))
    assert cache.match_and_insert(prompt) == 0
    assert cache.match_and_insert(prompt) == 96  # floor(99 / 16) pages
    assert cache.match_and_insert(prompt[:96]) == 80, "96 ids: matched on 95, page-aligned (a whole page less)"
    assert cache.match_and_insert([*prompt[:40], 7, 7, 7]) == 32
    tokens = PrefixCache(1, 1000)
    assert tokens.match_and_insert(prompt) == 0 and tokens.match_and_insert(prompt) == 99, "page 1: all but the last"


def test_a_finished_turns_prompt_and_output_are_cached_for_the_next_turn() -> None:
    clock = [0.0]
    engine = Engine(EngineConfig(), lambda: clock[0])
    prompt, output = list(range(1000, 1160)), list(range(5000, 5064))
    req = SimRequest("t0", prompt, len(output), on_finish=lambda r: None)
    req.output_ids = output
    engine.submit(req)
    clock[0] = 1000.0
    engine.advance_to(clock[0])
    assert req.finish_s is not None
    # The next turn starts with the whole history (a template that keeps it) and adds a user turn: with the overlap
    # scheduler every output id's KV was computed (kv_committed_len = prompt + output).
    assert engine.cache.match_and_insert([*prompt, *output, 9, 9, 9, 9]) == 160 + 64


def test_a_short_prefill_evicts_whole_least_recently_used_leaves_never_its_own_path() -> None:
    cache = PrefixCache(1, capacity_blocks=100)
    system = list(range(1000, 1020))
    a, b = [*system, *range(2000, 2030)], [*system, *range(3000, 3030)]
    assert cache.match_and_insert(a) == 0 and cache.match_and_insert(b) == 20  # the system prompt, shared
    assert len(cache) == 80  # 20 shared + 30 + 30
    # 40 new ids, 20 free: evict(40) — not the shortfall — takes a's leaf (30, least recent), then b's (30).
    c = list(range(4000, 4040))
    assert cache.match_and_insert(c) == 0
    assert len(cache) == 20 + 40 and cache.cached_length([*system, 5]) == 20, "the shared head stays"
    assert cache.cached_length([*a, 1]) == 20 and cache.cached_length([*b, 1]) == 20, "each tail went whole"
    # A prompt that extends the head: its matched path is locked while its prefill evicts.
    d = [*system, *range(5000, 5070)]
    assert cache.match_and_insert(d) == 20 and cache.cached_length([*d, 1]) == len(d)
    assert cache.cached_length([*c, 1]) == 0 and len(cache) <= 100


def test_a_history_evicted_by_other_prompts_is_not_cached() -> None:
    cache = PrefixCache(BLOCK, capacity_blocks=20)
    history = list(range(160))  # 10 pages
    cache.insert(history)
    for k in range(3):  # three other prompts of 8 pages fill the pool past its 20
        cache.match_and_insert(list(range(20_000 + 1000 * k, 20_000 + 1000 * k + 128)))
    assert cache.match_and_insert([*history, 1]) == 0, "an evicted history is not cached"


def test_prefill_time_is_charged_for_uncached_tokens_only() -> None:
    """Two identical engines; the second has the prompt's history cached: its first token comes sooner by exactly
    the cached tokens' prefill time (the engine's clock is simulated: no wall clock read)."""
    prefill_tok_s, prompt = 1000.0, list(range(7000, 7800))

    def first_token_s(warm: bool) -> float:
        clock = [0.0]
        engine = Engine(EngineConfig(prefill_tok_s=prefill_tok_s), lambda: clock[0])
        if warm:
            engine.cache.insert(prompt)
        req = SimRequest("r", [*prompt, 1, 2, 3], 4, on_finish=lambda r: None)
        engine.submit(req)
        clock[0] = 100.0
        engine.advance_to(clock[0])
        assert req.first_token_s is not None
        return req.first_token_s - (req.admitted_s or 0.0), req.cached_tokens

    cold_s, cold_cached = first_token_s(False)
    warm_s, warm_cached = first_token_s(True)
    assert cold_cached == 0 and warm_cached == 800 - 800 % BLOCK
    assert abs(cold_s - 803 / prefill_tok_s) < 1e-9
    assert abs(warm_s - (803 - warm_cached) / prefill_tok_s) < 1e-9
