"""The continuous-batching timing model on a manual clock (exact simulated time, no HTTP, no wall clock)."""

from __future__ import annotations

import random

import pytest

from sglang_sim.content import expected_generation
from sglang_sim.engine import Engine, EngineConfig, QueueFullError, SimRequest


class ManualClock:
    def __init__(self) -> None:
        self.t_s = 0.0

    def __call__(self) -> float:
        return self.t_s


def make_engine(**config: object) -> tuple[Engine, ManualClock]:
    clock = ManualClock()
    return Engine(EngineConfig(**config), clock), clock  # type: ignore[arg-type]


def request(rid: str, output_len: int, finished: list[SimRequest], prompt_len: int = 10) -> SimRequest:
    prompt = [hash(rid) % 100_000 + i for i in range(prompt_len)]
    return SimRequest(rid, prompt, output_len, on_finish=finished.append)


def test_one_request_decodes_at_the_per_request_cap_after_its_prefill() -> None:
    engine, clock = make_engine(per_request_tok_s=40.0, prefill_tok_s=1000.0)
    finished: list[SimRequest] = []
    engine.submit(request("a", 400, finished, prompt_len=500))

    clock.t_s = 10.4
    engine.advance()
    assert finished == []
    clock.t_s = 10.6
    engine.advance()
    (req,) = finished
    assert req.first_token_s == pytest.approx(0.5)  # 500 uncached tokens at 1000 tok/s
    assert req.e2e_latency_s == pytest.approx(0.5 + 400 / 40)


def test_many_requests_share_the_decode_capacity() -> None:
    engine, clock = make_engine(decode_tok_s=860.0, per_request_tok_s=40.0, prefill_tok_s=1e12)
    finished: list[SimRequest] = []
    for i in range(150):
        engine.submit(request(f"r{i}", 10_000, finished))

    clock.t_s = 100.0
    engine.advance()
    assert engine.num_running == 150
    assert engine.stats.decoded_tokens == pytest.approx(860.0 * 100.0, rel=1e-6)
    assert engine.progress(next(iter(engine._running))) == int(860 / 150 * 100)


def test_at_most_max_running_requests_run_and_the_rest_wait_fifo() -> None:
    engine, clock = make_engine(max_running_requests=2, prefill_tok_s=1e12)
    finished: list[SimRequest] = []
    for i, length in enumerate([100, 10, 10, 10]):
        engine.submit(request(f"r{i}", length, finished))
    assert (engine.num_running, engine.num_waiting) == (2, 2)

    clock.t_s = 1000.0
    engine.advance()
    assert [r.rid for r in finished] == ["r1", "r2", "r3", "r0"]  # r2 and r3 only started as slots freed
    assert finished[1].admitted_s == pytest.approx(finished[0].finish_s)


def test_a_full_waiting_queue_rejects_new_requests() -> None:
    engine, _ = make_engine(max_running_requests=1, max_queued_requests=2)
    finished: list[SimRequest] = []
    for i in range(3):
        engine.submit(request(f"r{i}", 10, finished))

    with pytest.raises(QueueFullError, match=r"The request queue is full\."):
        engine.submit(request("r3", 10, finished))
    assert engine.stats.queue_full_rejections == 1


def test_abort_matches_prefixes_and_reports_partial_progress() -> None:
    engine, clock = make_engine(max_running_requests=2, per_request_tok_s=10.0, prefill_tok_s=1e12)
    finished: list[SimRequest] = []
    for rid in ("job1", "job2", "job10", "job3"):  # job10 and job3 wait
        engine.submit(request(rid, 1000, finished))
    clock.t_s = 3.0

    assert engine.abort("job1") == 2
    by_rid = {r.rid: r for r in finished}
    assert by_rid["job1"].abort_message == "Aborted" and by_rid["job1"].generated_tokens == 30
    assert by_rid["job10"].aborted_while_waiting and by_rid["job10"].generated_tokens == 0
    assert engine.num_running == 2 and engine.num_waiting == 0  # job3 took the freed slot


def client_throughput(engine: Engine, clock: ManualClock, lengths: list[int], in_flight: int, batch: bool) -> float:
    """Generated tokens per simulated second for a client that keeps ``in_flight`` busy, or waits per batch."""
    finished: list[SimRequest] = []
    pending = iter(range(len(lengths)))
    running = 0
    tokens_0, t_0 = engine.stats.decoded_tokens, clock.t_s

    def submit() -> bool:
        nonlocal running
        i = next(pending, None)
        if i is None:
            return False
        running += 1
        engine.submit(SimRequest(f"{batch}-{i}", [i], lengths[i], on_finish=finished.append))
        return True

    more = True
    while more or running:
        if not batch or running == 0:
            while more and running < in_flight:
                more = submit()
        clock.t_s += 0.25
        before = len(finished)
        engine.advance()
        running -= len(finished) - before
    return (engine.stats.decoded_tokens - tokens_0) / (clock.t_s - t_0)


def test_batch_and_wait_client_is_much_slower_than_a_continuous_one() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(160_000) for _ in range(50)] for _ in range(900)]
    lengths = [len(expected_generation(p, {"max_new_tokens": 10_240}).output_ids) for p in prompts]
    engine, clock = make_engine()

    waiting = client_throughput(engine, clock, lengths, in_flight=150, batch=True)
    continuous = client_throughput(engine, clock, lengths, in_flight=150, batch=False)

    assert continuous > 0.9 * 860
    assert continuous / waiting > 1.4  # the heavy tail idles the GPU at the end of every batch
