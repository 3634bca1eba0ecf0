"""The simulator's radix cache (sglang_sim/cache.py) against a real ``sglang==0.5.9`` server's, request by request.

One real CPU server with a small KV pool (``--max-total-tokens 1024``: eviction is cheap), its cache flushed, then a
sequence sent one request at a time (greedy, ``ignore_eos``: every answer is its full budget). Each prompt also goes
to the simulator's engine configured with the same pool and page (``cache_block_tokens=1``,
``cache_capacity_blocks=1024``) with the real answer's ids; the simulator's ``cached_tokens`` must equal the real
server's for every request. Along the way, the rules the simulator copies (SGLang 0.5.9, sglang/srt/…):

- a prompt sent twice is cached on all but its last id (``Req.init_next_round_input``: ``max_prefix_len =
  input_len - 1``; page-aligned in ``RadixCache.match_prefix`` — the CPU server runs page 1: a larger
  ``--page-size`` needs the triton paged allocator, which has no CPU driver);
- the next turn finds the previous turn's prompt **and every output id** cached (``cache_finished_req`` inserts
  ``kv_committed_len`` ids: with the overlap scheduler the step scheduled before the finish is seen computed the last
  id's KV);
- a prefill short of free slots evicts as many tokens' worth of whole leaves as it needs in all, not the shortfall
  (``mem_cache/common.py evict_from_tree_cache`` → ``RadixCache.evict``), least recently used first: a history other
  prompts pushed out is not cached; three small prompts go for a shortfall of one.
"""

from __future__ import annotations

import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_server import COMPOSE_FLAGS, SCRIPT, VERSION, RealServer, ensure_environment, ensure_model, post

from sglang_sim.engine import Engine, EngineConfig, SimRequest
from testing.tokenizer import default_test_tokenizer_dir

pytestmark = pytest.mark.timeout(1800)  # the first run builds the venv (minutes)

#: The real server's KV pool, and the simulator's (page 1).
POOL = 1024
OUT = 4
SAMPLING = {"max_new_tokens": OUT, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}


class SmallPoolServer(RealServer):
    """The tier's server (scripts/real_sglang.sh serve, the compose flags) with a ``POOL``-token KV pool."""

    def start(self, wait: bool = True) -> SmallPoolServer:
        assert self.model is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 — the child keeps it
        flags = [*COMPOSE_FLAGS, f"--max-total-tokens {POOL}"]  # after the script's 65536: the last one counts
        env = {**os.environ, "THINKFLEET_REAL_SGLANG_ARGS": " ".join(flags)}
        self.proc = subprocess.Popen(
            ["bash", str(SCRIPT), "serve", str(self.model), str(self.port), VERSION],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        log.close()
        if wait:
            self.wait_healthy()
        return self


@pytest.fixture(scope="module")
def small_pool(real_tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    if os.environ.get("THINKFLEET_REAL_SGLANG_URL"):
        pytest.skip("an external server's KV pool is its own: this test starts one with a small pool")
    ensure_environment()
    model = ensure_model(real_tok_dir, default_test_tokenizer_dir().parent)
    server = SmallPoolServer(model=model, log_path=tmp_path_factory.mktemp("real-cache") / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


class Twin:
    """The real server and the simulator's engine, sent the same prompts one at a time."""

    def __init__(self, server: RealServer) -> None:
        self.server = server
        self.clock = [0.0]
        self.engine = Engine(EngineConfig(cache_block_tokens=1, cache_capacity_blocks=POOL), lambda: self.clock[0])
        self.log: list[tuple[str, int, int, int]] = []  # (name, prompt length, real cached, sim cached)

    def send(self, name: str, ids: list[int]) -> tuple[int, list[int]]:
        status, body = self.server.generate({"input_ids": ids, "sampling_params": SAMPLING})
        assert status == 200 and isinstance(body, dict), f"/generate answered {status}: {body}"
        real, output = int(body["meta_info"]["cached_tokens"]), list(body["output_ids"])
        assert len(output) == OUT
        req = SimRequest(name, ids, len(output), on_finish=lambda r: None)
        req.output_ids = output
        self.engine.submit(req)
        self.clock[0] += 1000.0
        self.engine.advance_to(self.clock[0])
        assert req.finish_s is not None
        self.log.append((name, len(ids), real, req.cached_tokens))
        assert req.cached_tokens == real, (
            f"{name}: the simulator says {req.cached_tokens}, the server {real}: {self.log}"
        )
        return real, output


def test_the_simulators_cached_tokens_are_the_real_servers_through_reuse_and_eviction(small_pool: RealServer) -> None:
    status, _ = post(small_pool.url + "/flush_cache", {})
    assert status == 200, "the server is idle: its tree (the warm-up's, the health checks') is emptied"
    rng = random.Random(35)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1000, 150_000) for _ in range(n)]

    twin = Twin(small_pool)
    # A turn sent twice: cached on all but its last id.
    history = fresh(300)
    assert twin.send("turn", history)[0] == 0
    again, answer = twin.send("turn again", history)
    assert again == len(history) - 1
    # The next turn: the prompt and every output id of the turn before it.
    user = fresh(20)
    assert twin.send("next turn", [*history, *answer, *user])[0] == len(history) + OUT
    # Three other prompts of 300 fill the pool (328 + 3 × 304 > 1024): the third's prefill evicts the history.
    for k in range(3):
        assert twin.send(f"other {k}", fresh(300))[0] == 0
    assert twin.send("next turn after eviction", [*history, *answer, *user])[0] == 0, "an evicted history"

    # A prefill short of free slots evicts its whole need's worth of leaves, not the shortfall.
    status, _ = post(small_pool.url + "/flush_cache", {})
    assert status == 200
    twin.engine.cache.clear()
    small = [fresh(40) for _ in range(6)]
    for k, ids in enumerate(small):
        twin.send(f"small {k}", ids)  # 6 × 44 = 264 in the tree
    twin.send("large", fresh(700))  # 964: 60 free
    twin.send("needs 100", fresh(100))  # short by 40: evicts 100 → the three oldest small ones (3 × 44)
    assert twin.send("small 3 again", small[3])[0] == len(small[3]) - 1, "the fourth stayed"
    for k in range(3):
        assert twin.send(f"small {k} again", small[k])[0] == 0, f"small {k} was evicted with the need's worth"
