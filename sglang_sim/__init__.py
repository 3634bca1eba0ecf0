"""sglang-sim: a simulated SGLang server for thinkfleet's tests, demos and benchmarks.

It speaks SGLang's native protocol as a given release does (``--sglang-version``; see
docs/sglang-versions.md) — ``/generate`` with token ids, JSON or SSE; ``/health``,
``/model_info``, ``/server_info``, ``/v1/models``, ``/flush_cache``, ``/abort_request``, ``/metrics``)
with SGLang's keys, shapes and error wording, and times requests like a continuously batched GPU
server, ``time_scale`` times faster than wall time.

Modules, one concern each:

- :mod:`~sglang_sim.content` — what the model says: ``expected_generation(input_ids, sampling_params,
  ContentConfig)``, deterministic from (input ids, sampling_seed); tests check stored data against it.
- :mod:`~sglang_sim.engine` — the continuous-batching timing model (admission, prefill, decode).
- :mod:`~sglang_sim.cache` — a cheap radix-cache stand-in for ``cached_tokens``.
- :mod:`~sglang_sim.request` — a ``/generate`` body parsed, normalized into one item per prompt, validated.
- :mod:`~sglang_sim.sampling` — ``sampling_params``: SGLang's rules and the 0.5.22+ api/v1 contract check.
- :mod:`~sglang_sim.responses` — ``meta_info``, SSE framing, the info/load/abort bodies.
- :mod:`~sglang_sim.errors` — SGLang's error paths: the exceptions and the error bodies they answer with.
- :mod:`~sglang_sim.text` — the ``text`` field (a real tokenizer, or a built-in rendering).
- :mod:`~sglang_sim.generate` — the ``/generate`` handler.
- :mod:`~sglang_sim.versions` — what differs between the SGLang releases imitated (``--sglang-version``;
  default the deployed one, :data:`thinkfleet.sglang_version.SGLANG_VERSION`).
- :mod:`~sglang_sim.faults` — 503s, dropped connections, hangs, outages, NaN and abort finishes.
- :mod:`~sglang_sim.metrics` — Prometheus metrics and ``/control/stats`` counts.
- :mod:`~sglang_sim.server` — the aiohttp app, the other routes, the scheduler tick.
- :mod:`~sglang_sim.config` — ``SimConfig`` (server/engine/content/faults parts, flat option names).
- :mod:`~sglang_sim.cli` — ``sglang-sim --port N …``.
- :mod:`~sglang_sim.testing` — ``run_simulator(**options)`` (thread) and ``run_simulator_process(*args)``.
"""

from sglang_sim.config import SimConfig
from sglang_sim.content import ContentConfig, Generation, expected_generation

__all__ = ["ContentConfig", "Generation", "SimConfig", "expected_generation"]
