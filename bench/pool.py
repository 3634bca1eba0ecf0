"""The reference client: one process, one event loop, one aiohttp session, no queue and no storage.

``--mode pool`` (the ideal): each server gets ``bound`` coroutines that pull the next prompt from one
shared in-memory queue the moment their previous request returns — a freed slot is refilled at once,
from a global queue, with nothing in between.

``--mode batch`` (the anti-pattern): each server takes ``bound`` prompts, sends them all, waits for the
slowest, then takes the next ``bound`` — the heavy tail of every batch leaves slots idle.

Writes JSON with per-request (start, end, server, completion tokens), all times ``time.time()``.

    python -m bench.pool --urls http://127.0.0.1:30000 --bound 150 --prompts p.npz --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque
from typing import Any

import aiohttp
import numpy as np

from workers.sglang import build_request

#: A benchmark against a healthy server sees none; past this many the client gives up.
MAX_ERRORS = 100


def load_prompts(path: str) -> tuple[list[str], list[list[int]]]:
    data = np.load(path)
    ids = [str(x) for x in data["prompt_ids"]]
    bounds = np.concatenate([[0], np.cumsum(data["lengths"])])
    flat = data["flat"]
    return ids, [flat[bounds[i] : bounds[i + 1]].tolist() for i in range(len(ids))]


class PoolClient:
    def __init__(self, urls: list[str], bound: int, sampling: dict[str, Any]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.bound = bound
        self.sampling = sampling
        self.records: list[tuple[int, int, float, float, int]] = []  # index, server, start, end, tokens
        self.errors = 0

    async def _one(self, session: aiohttp.ClientSession, server: int, index: int, ids: list[int]) -> None:
        body = build_request(ids, self.sampling, f"pool-{index}-{server}")
        while True:
            start = time.time()
            try:
                async with session.post(f"{self.urls[server]}/generate", json=body) as resp:
                    payload = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {payload[:200]!r}")
                tokens = int(json.loads(payload)["meta_info"]["completion_tokens"])
                self.records.append((index, server, start, time.time(), tokens))
                return
            except (aiohttp.ClientError, RuntimeError):
                self.errors += 1
                if self.errors > MAX_ERRORS:
                    raise SystemExit(f"more than {MAX_ERRORS} failed requests: is the server gone?") from None
                await asyncio.sleep(0.1)

    async def run(self, prompts: list[list[int]], mode: str) -> None:
        queue = deque(range(len(prompts)))
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

            async def slot(server: int) -> None:
                while queue:
                    index = queue.popleft()
                    await self._one(session, server, index, prompts[index])

            async def batches(server: int) -> None:
                while queue:
                    batch = [queue.popleft() for _ in range(min(self.bound, len(queue)))]
                    await asyncio.gather(*(self._one(session, server, i, prompts[i]) for i in batch))

            if mode == "pool":
                # Interleaved, so the first wave is dealt round-robin as independent hosts would fetch it.
                await asyncio.gather(*(slot(s) for _ in range(self.bound) for s in range(len(self.urls))))
            else:
                await asyncio.gather(*(batches(s) for s in range(len(self.urls))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", required=True, help="comma-separated simulator/SGLang base URLs")
    parser.add_argument("--bound", type=int, default=150, help="requests in flight per server")
    parser.add_argument("--prompts", required=True, help=".npz written by bench.harness.save_prompts")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("pool", "batch"), default="pool")
    parser.add_argument("--sampling", default="{}", help="sampling params JSON")
    parser.add_argument("--start-at", type=float, default=0.0, help="time.time() to start at (sync with a peer)")
    args = parser.parse_args()

    ids, prompts = load_prompts(args.prompts)
    client = PoolClient(args.urls.split(","), args.bound, json.loads(args.sampling))
    delay = args.start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    cpu0, t0 = time.process_time(), time.time()
    asyncio.run(client.run(prompts, args.mode))
    cpu1, t1 = time.process_time(), time.time()
    records = sorted(client.records)
    result = {
        "mode": args.mode,
        "servers": len(client.urls),
        "bound": args.bound,
        "t0": t0,
        "t1": t1,
        "cpu_s": cpu1 - cpu0,
        "errors": client.errors,
        "prompt_ids": [ids[r[0]] for r in records],
        "server": [r[1] for r in records],
        "start": [r[2] for r in records],
        "end": [r[3] for r in records],
        "tokens": [r[4] for r in records],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
