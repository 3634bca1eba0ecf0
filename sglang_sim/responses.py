"""What the simulated server answers when it answers: ``/generate``'s ``meta_info`` and SSE framing, and the bodies
of the informational routes (start-up times, launch command, embedding plan, loads) and of an abort finish.

These are the shapes a client parses, kept in SGLang's key order per release (measured against real 0.5.9 and
0.5.23 servers: tests/real_sglang); which layout applies is :class:`sglang_sim.versions.VersionProfile`'s call,
made by the callers (:mod:`sglang_sim.simulator`, :mod:`sglang_sim.generate`, :mod:`sglang_sim.server`). Error
bodies are :mod:`sglang_sim.errors`'.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    """One SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(obj) + b"\n\n"


# -- response ----------------------------------------------------------------------------------------
def meta_info(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    weight_version: str,
    reasoning_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency_s: float | None = None,
    sent_ts: float | None = None,
    retractions_key: str = "num_retractions",
    with_reasoning_tokens: bool = True,
    with_cached_tokens_details: bool = False,
    timing: bool = False,
    in_batch: bool = False,
    layout: str = "0.5.9",
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``meta_info`` in ``_handle_batch_output``'s key order; ``e2e_latency`` only once finished.

    0.5.9: ``total_retractions`` and no ``reasoning_tokens``; 0.5.12+: ``num_retractions``; 0.5.10+:
    ``reasoning_tokens`` (see :class:`sglang_sim.versions.VersionProfile`). ``cached_tokens_details`` is
    null (no hierarchical cache). ``timing`` (0.5.9 with ``--enable-metrics``, as compose runs it): the
    scheduler's ``queue_time``, ``prefill_launch_delay``, ``prefill_launch_latency``, ``prefill_finished_ts``
    in every chunk, and ``_calculate_timing_metrics``' timestamps once finished (measured against a real
    0.5.9: tests/real_sglang). ``decode_throughput`` is left out: the real server adds it only when a token
    reached the tokenizer manager before the last one, which depends on its batching. A request of a batch
    (``input_ids`` a list of lists) has no ``request_sent_to_scheduler_ts``. ``layout="0.5.23"``: that
    release's keys (:func:`_meta_info_0_5_23`). ``spec``: a finished request's speculative-decoding keys
    (:mod:`sglang_sim.speculative`), right after ``e2e_latency`` as both releases put them.
    """
    if layout == "0.5.23":
        return _meta_info_0_5_23(
            rid=rid, finish_reason=finish_reason, prompt_tokens=prompt_tokens, weight_version=weight_version,
            reasoning_tokens=reasoning_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
            e2e_latency_s=e2e_latency_s, sent_ts=sent_ts, retractions_key=retractions_key, timing=timing, spec=spec,
        )  # fmt: skip
    now = time.time()
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        retractions_key: 0,
    }
    if with_reasoning_tokens:
        meta["reasoning_tokens"] = reasoning_tokens
    if timing:
        meta |= {"queue_time": 0.0, "prefill_launch_delay": 0.0, "prefill_launch_latency": 0.0}
        meta["prefill_finished_ts"] = now - (e2e_latency_s or 0.0)
    meta["completion_tokens"] = completion_tokens
    meta["cached_tokens"] = cached_tokens
    if with_cached_tokens_details:
        meta["cached_tokens_details"] = None
    if e2e_latency_s is not None:
        meta["e2e_latency"] = e2e_latency_s
        meta |= spec or {}
        if timing:
            received = (sent_ts or now) - e2e_latency_s
            meta["request_received_ts"] = received
            if not in_batch:
                meta["request_sent_to_scheduler_ts"] = received
            meta |= {"decode_finished_ts": sent_ts or now, "inference_time": e2e_latency_s}
        meta["response_sent_to_client_ts"] = sent_ts
    return meta


def _meta_info_0_5_23(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    weight_version: str,
    reasoning_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency_s: float | None,
    sent_ts: float | None,
    retractions_key: str,
    timing: bool,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """0.5.23's ``meta_info`` (``TokenizerManager._handle_batch_output``, measured against a real 0.5.23:
    tests/real_sglang). With ``--enable-metrics`` (``timing``) the scheduler's ``SchedulerReqTimeStats.
    convert_to_output_meta_info`` keys after the retraction count in every chunk, and once finished the tokenizer
    manager's ``ReqTimeStats.convert_to_output_meta_info`` keys (``decode_throughput`` left out, as for 0.5.9).
    ``weight_versions`` (one span: no weight update mid-request) only once finished (``compute_weight_version_spans``);
    ``cached_tokens_details`` ``{"device", "host"}`` once a prefix was cached, else null
    (``OutputStreamer.get_cached_tokens_details``); ``dp_rank`` null (no DP attention)."""
    now = time.time()
    final = e2e_latency_s is not None
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        retractions_key: 0,
    }
    received = (sent_ts or now) - (e2e_latency_s or 0.0)
    if timing:
        meta |= {"storage_prefetch_wait": 0.0, "storage_staging_wait": 0.0}
        meta |= {"forward_entry_time": received, "prefill_finished_time": received, "queue_time": 0.0}
    meta["reasoning_tokens"] = reasoning_tokens
    meta |= {"completion_tokens": completion_tokens, "cached_tokens": cached_tokens}
    if final:
        meta["weight_versions"] = [{"version": weight_version, "start": 0, "end": completion_tokens}]
    meta["cached_tokens_details"] = {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None
    meta["dp_rank"] = None
    if final:
        meta["e2e_latency"] = e2e_latency_s
        meta |= spec or {}
        if timing:
            meta |= {"request_received_ts": received, "first_token_latency": 0.0}
            meta |= {"api_server_dispatch_finish_ts": received, "request_finished_ts": sent_ts or now}
        meta["response_sent_to_client_ts"] = sent_ts
    return meta


#: CUDA-graph capture phases ``startup_time`` and ``memory_usage.graph`` report per phase in 0.5.23.
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


def startup_time_0_5_23(total_s: float, tokenizer: bool) -> dict[str, Any]:
    """0.5.23's ``startup_time`` (``/server_info``: with ``tokenizer_e2e``; ``internal_states[i]``: without):
    seconds per start-up phase, measured against a real 0.5.23. The simulator has no phases: ``total_s`` is
    split as a GPU host might (weights most of it)."""
    out: dict[str, Any] = {
        "load_weight": 0.7 * total_s,
        "kv_cache_allocation": 0.05 * total_s,
        "scheduler_e2e": 0.9 * total_s,
        "cuda_graph": dict.fromkeys(GRAPH_PHASES, 0.0) | {"decode": 0.1 * total_s},
    }
    if tokenizer:
        out["tokenizer_e2e"] = total_s
    return out


def launch_command() -> str:
    """0.5.23's ``/server_info.launch_command``: the server's command-line arguments, one string."""
    return " ".join(sys.argv[1:])


def embedding_plan_0_5_23() -> dict[str, Any]:
    """0.5.23's ``/model_info.embedding`` for a generation model: ``configs/embedding_model_spec.py``
    ``resolved_embedding_plan`` of the ``none`` spec (present for every model; keys measured against a real
    0.5.23, the capture sizes shortened)."""
    return {
        "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
        "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
        "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
        "enabled": False, "matryoshka_dimensions": [],
        "bcg": {"prefill_backend": "disabled", "enabled": False, "capture_token_budget": 4096,
                "capture_batch_sizes": [4, 8, 16, 32]},
        "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
    }  # fmt: skip


def abort_reason(message: str, status_code: int | None = None, waiting: bool = False) -> dict[str, Any]:
    """``FINISH_ABORT.to_json`` (running) or the tokenizer manager's waiting-queue abort shape."""
    if waiting:
        return {"type": "abort", "message": message}
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


# -- load (GET /get_load, GET /v1/loads) -----------------------------------------------------------------
def get_load_body(running: int, waiting: int, num_tokens: int) -> list[dict[str, Any]]:
    """0.5.9's deprecated ``/get_load``: one ``GetLoadReqOutput`` per DP rank, dataclass fields in order
    (``BaseReq``'s ``rid`` and ``http_worker_ipc`` first, both null; ``dp_rank`` null without DP).
    ``num_reqs`` counts running + waiting, and ``num_tokens`` adds the waiting requests' lengths to the
    KV tokens in use (``scheduler_metrics_mixin.get_load``)."""
    return [
        {
            "rid": None,
            "http_worker_ipc": None,
            "dp_rank": None,
            "num_reqs": running + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": num_tokens,
            "ts_tic": time.perf_counter(),
        }
    ]


def v1_loads_body(
    *,
    version: str,
    running: int,
    waiting: int,
    used_tokens: int,
    max_total_num_tokens: int,
    gen_throughput: float,
    cache_hit_rate: float,
    max_running_requests: int,
    retracted: int,
    token_capacity: int,
) -> dict[str, Any]:
    """0.5.9's ``/v1/loads`` (``entrypoints/v1_loads.py``, default ``include=all``): per DP rank a
    ``GetLoadsReqOutput`` without its null fields (``dp_rank`` is null without DP, so absent) nor
    ``timestamp``, plus ``num_total_reqs``; then the aggregate. ``utilization`` is 0 unless the server
    was given an SLO bound (``max_running_requests_under_SLO``); ``speculative`` and ``lora`` are null
    (absent) without speculative decoding or LoRA; ``queues.retracted`` is the last retraction's count."""
    usage = round(used_tokens / max_total_num_tokens, 4) if max_total_num_tokens > 0 else 0.0
    load = {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used_tokens,
        "max_total_num_tokens": max_total_num_tokens,
        "token_usage": usage,
        "gen_throughput": round(gen_throughput, 2),
        "cache_hit_rate": round(cache_hit_rate, 4),
        "utilization": 0.0,
        "max_running_requests": max_running_requests,
        "memory": {"weight_gb": 68.5, "kv_cache_gb": 52.3, "graph_gb": 1.6, "token_capacity": token_capacity},
        "disaggregation": {
            "mode": "null",
            "prefill_prealloc_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": retracted},
        "num_total_reqs": running + waiting,
    }
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": version,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": usage,
            "avg_throughput": round(gen_throughput, 2),
            "avg_utilization": 0.0,
        },
    }
