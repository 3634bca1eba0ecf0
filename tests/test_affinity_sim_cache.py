"""The simulator's prefix cache (sglang_sim/cache.py) behaves as a radix cache for what host affinity measures: a
prompt sent twice is cached, a finished turn's prompt + output is cached for the turn after it, a history evicted is
not, and under pressure a history loses its tail before its head."""

from __future__ import annotations

from sglang_sim.cache import PrefixCache
from sglang_sim.engine import Engine, EngineConfig, SimRequest

BLOCK = 16


def test_a_prompt_sent_twice_is_cached_up_to_its_last_block() -> None:
    cache = PrefixCache(BLOCK, 1000)
    prompt = list(range(100))
    assert cache.match_and_insert(prompt) == 0
    assert cache.match_and_insert(prompt) == 96  # whole blocks, and never the last token
    assert cache.match_and_insert([*prompt[:40], 7, 7, 7]) == 32


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
    # The next turn starts with the whole history (a template that keeps it) and adds a user turn.
    assert engine.cache.match_and_insert([*prompt, *output, 9, 9, 9, 9]) == 160 + 48  # output's last id uncomputed


def test_an_evicted_history_is_not_cached_and_pressure_takes_a_tail_before_its_head() -> None:
    cache = PrefixCache(BLOCK, capacity_blocks=10)
    history = list(range(160))  # 10 blocks: the whole cache
    cache.insert(history)
    cache.insert(list(range(10_000, 10_064)))  # 4 blocks of another conversation: the history's deepest 4 go
    assert cache.match_and_insert(history) == 6 * BLOCK, "the head stays, the tail was evicted"
    for k in range(3):  # three other histories fill the cache again
        cache.insert(list(range(20_000 + 1000 * k, 20_000 + 1000 * k + 160)))
    assert cache.match_and_insert([*history, 1]) == 0, "an evicted history is not cached"
