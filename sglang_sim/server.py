"""The simulator's aiohttp application: state (:class:`Simulator`) and every route but /generate.

Native SGLang routes: ``/generate`` (see :mod:`sglang_sim.generate`), ``/health``,
``/health_generate``, ``/model_info`` (+ ``/get_model_info``), ``/server_info`` (+
``/get_server_info``), ``/v1/models``, ``/flush_cache``, ``/abort_request``, ``/metrics``, the load
endpoints ``/v1/loads`` and (deprecated in 0.5.9) ``/get_load``, and ``/ready`` where the imitated
release has it. Shapes follow ``--sglang-version``
(:mod:`sglang_sim.versions`).

Lifecycle, as a real server's: the port opens only after ``load_s`` (the CLI binds late); for
``warmup_s`` after that /health* answer 503 at once; afterwards a health answer is a 1-token scheduler
round trip — 200 after ``health_min_s + health_delay_s`` wall seconds, or 503 after
``health_check_timeout_s`` if that is longer (``SGLANG_HEALTH_CHECK_TIMEOUT``). Bodies are empty.

Control routes (simulator only; they answer even during a stall):

- ``GET /control/faults`` → the fault settings; ``POST /control/faults`` with any of
  ``{"fault_503_rate", "fault_drop_rate", "fault_hang_rate", "fault_seed", "nan_rate", "abort_rate",
  "abort_status_code", "bad_output_rate", "bad_output_kind", "bad_output_per_attempt"}`` changes them.
- ``POST /control/outage`` ``{"duration_s": 30, "mode": "drop"|"abort"}``: from now on /generate and
  /health* answer 503 for ``duration_s`` wall seconds; in-flight calls are dropped (connection closed,
  default) or aborted (200 with ``finish_reason.type == "abort"``). ``duration_s: 0`` ends an outage.
- ``POST /control/health_delay`` ``{"seconds": S}``: every health answer takes S more seconds.
- ``POST /control/stall`` ``{"seconds": S}``: for S wall seconds the server answers nothing — it accepts
  connections and reads requests but sends no byte; generations in flight freeze (the simulated clock
  stops). Afterwards everything resumes: requests received during the stall are then served as if
  they had just arrived (a client whose timeout is shorter has given up by then). ``seconds: 0`` ends
  a stall; a new stall replaces the running one.
- ``GET /control/stats[?rids=0]`` → counts (see :class:`~sglang_sim.metrics.CallStats`), including the
  rids whose generation took the NaN path (``nan_rids``), was aborted by ``--abort-rate``
  (``abort_rids``) or was answered with a bad output by ``--bad-output-rate`` (``bad_output_rids``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from sglang_sim import errors, responses
from sglang_sim.config import SimConfig
from sglang_sim.generate import SIM_KEY, handle_generate
from sglang_sim.simulator import Simulator

logger = logging.getLogger("sglang_sim")


def _sim(request: web.Request) -> Simulator:
    return request.app[SIM_KEY]


async def health(request: web.Request) -> web.Response:
    """``/health`` and ``/health_generate`` (the same handler; SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION).

    503 at once while warming up, shutting down or in an outage. Otherwise SGLang sends a 1-token
    generation and polls once a second for *any* scheduler output: 200 after ``health_min_s`` plus the
    extra delay, or 503 once ``health_check_timeout_s`` has passed without one (and ``/ready`` answers
    503 until a later health check passes). A stall holds the answer until it ends.
    """
    sim = _sim(request)
    server = sim.config.server
    if sim.shutting_down or sim.warming() or sim.faults.in_outage():
        return web.Response(status=503)
    sim.stats.health_checks += 1
    takes_s = server.health_min_s + sim.health_delay_s
    if takes_s > server.health_check_timeout_s:
        await asyncio.sleep(server.health_check_timeout_s)
        await sim.wait_unstalled()
        sim.unhealthy = True
        return web.Response(status=503)
    await asyncio.sleep(takes_s)
    await sim.wait_unstalled()
    if sim.shutting_down or sim.faults.in_outage():  # went down while the probe waited
        return web.Response(status=503)
    sim.unhealthy = False
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    """``/ready`` (0.5.21+): 200 once warm-up is over and the last health check passed."""
    return web.Response(status=200 if _sim(request).ready() else 503)


async def model_info(request: web.Request) -> web.Response:
    """``/model_info``: no vocabulary size and no context length in any release (docs/sglang-versions.md)."""
    sim = _sim(request)
    server = sim.config.server
    info: dict[str, Any] = {"model_path": server.model_path}
    if sim.profile.model_info_extended:
        info["served_model_name"] = server.model_name
    info |= {
        "tokenizer_path": server.tokenizer or server.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": server.weight_version,
    }
    if sim.profile.model_info_extended:
        info |= {
            "load_format": "auto",
            "reasoning_parser": server.reasoning_parser,
            "tool_call_parser": server.tool_call_parser,
            "disaggregation_mode": "null",
        }
    info |= {
        # Kimi-K2.5 is natively multimodal; the simulator sees images only with its processor's config (vision.py)
        "has_image_understanding": sim.vision is not None,
        "has_audio_understanding": False,
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
    }
    info |= {"embedding": responses.embedding_plan_0_5_23()} if sim.profile.model_info_extended else {}
    return web.json_response(info)


def _server_args(sim: Simulator) -> dict[str, Any]:
    """The ``ServerArgs`` fields a client may read, with the simulator's values (flat in every release)."""
    server, engine = sim.config.server, sim.config.engine
    deterministic = server.enable_deterministic_inference
    args: dict[str, Any] = {
        "model_path": server.model_path,
        "tokenizer_path": server.tokenizer or server.model_path,
        "served_model_name": server.model_name,
        "skip_tokenizer_init": not sim.codec.has_tokenizer,
        "trust_remote_code": True,
        "host": server.host,
        "port": server.port,
        # The raw --context-length: null on a real server started without the flag.
        "context_length": server.context_length if server.report_context_length else None,
        "revision": server.revision,
        "dtype": server.dtype,
        "quantization": server.quantization,
        "kv_cache_dtype": server.kv_cache_dtype,
        "tp_size": server.tp_size,
        "pp_size": 1,
        "random_seed": server.random_seed,
        "dp_size": 1,
        "ep_size": 1,
        "max_running_requests": engine.max_running_requests,
        "max_queued_requests": engine.max_queued_requests,
        "max_total_tokens": None,
        "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs",
        "schedule_conservativeness": 1.0,
        "page_size": 1,
        "disable_radix_cache": False,
        "mem_fraction_static": 0.88,
        "reasoning_parser": server.reasoning_parser,
        "tool_call_parser": server.tool_call_parser,
        "weight_version": server.weight_version,
        "enable_metrics": server.enable_metrics,
        "allow_auto_truncate": False,
        "preferred_sampling_params": None,
        # --enable-deterministic-inference forces the PyTorch sampler, fa3 attention on Hopper and, with
        # tp > 1, NCCL tree all-reduce without the custom all-reduce (server_args / attention_hook).
        "enable_deterministic_inference": deterministic,
        "attention_backend": "fa3",
        "sampling_backend": "pytorch" if deterministic else "flashinfer",
        "disable_custom_all_reduce": deterministic and server.tp_size > 1,
        # sglang_sim.speculative: null without --speculative-algorithm, as on a real server.
        "speculative_algorithm": server.speculative_algorithm,
        "speculative_draft_model_path": server.speculative_draft_model_path,
        "speculative_draft_model_revision": None,
        "speculative_num_steps": server.speculative_num_steps,
        "speculative_eagle_topk": server.speculative_eagle_topk,
        "speculative_num_draft_tokens": server.speculative_num_draft_tokens,
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
    }
    if sim.profile.server_info_extended:
        args["incremental_streaming_output"] = False
        args["enable_dp_attention"] = False  # reported for old clients; --attn-dp-size replaced it
        args["attn_dp_size"] = 1
    else:
        args["stream_output"] = False
        args["enable_dp_attention"] = False
    return args


async def server_info(request: web.Request) -> web.Response:
    """``/server_info``: server args + scheduler info + ``internal_states`` + ``version``, per release."""
    sim = _sim(request)
    sim.engine.advance()
    server, engine = sim.config.server, sim.config.engine
    args = _server_args(sim)
    extended = sim.profile.server_info_extended
    internal: dict[str, Any] = dict(args)
    if extended:
        internal |= {
            "world_size": server.tp_size,
            "startup_time": responses.startup_time_0_5_23(server.load_s, tokenizer=False),
            "effective_max_running_requests_per_dp": engine.max_running_requests,
            "last_gen_throughput": sim.engine.gen_throughput_tok_s(),
            "memory_usage": {
                "weight": 68.5,
                "kvcache": 52.3,
                "startup_available": 139.8,
                "token_capacity": server.max_total_num_tokens,
                "token_capacity_swa": None,
                "graph": {"decode": 1.6},
            },
        }
    else:
        internal |= {
            "last_gen_throughput": sim.engine.gen_throughput_tok_s(),
            "memory_usage": {
                "weight": 68.5,
                "kvcache": 52.3,
                "token_capacity": server.max_total_num_tokens,
                "graph": 1.6,
            },
            "effective_max_running_requests_per_dp": engine.max_running_requests,
        }
    if server.speculative_algorithm is not None and sim.spec_steps:  # the scheduler's running average
        internal["avg_spec_accept_length"] = sim.spec_tokens / sim.spec_steps
    info: dict[str, Any] = dict(args)
    if extended:
        info["launch_command"] = responses.launch_command()
    info |= {
        "status": "ready",
        "max_total_num_tokens": server.max_total_num_tokens,
        "max_req_input_len": server.max_req_input_len,
    }
    if extended:
        info |= {
            "startup_time": responses.startup_time_0_5_23(server.load_s, tokenizer=True),
            "hicache_object_layout": {
                "enabled": False,
                "backend": None,
                "page_size": 1,
                "hicache_object_layout": {"pools": []},
                "reason": "Hierarchical cache is disabled",
            },
            "kv_events": None,
        }
    info |= {"internal_states": [internal], "version": sim.profile.version}
    if extended:
        info["frontend"] = "python"
    info["simulator"] = {
        "time_scale": server.time_scale,
        "sim_time_s": sim.engine.now_s,
        "paused_wall_s": sim.clock.paused_wall_s,
    }
    return web.json_response(info)


def _model_card(sim: Simulator, model: str) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": sim.created_unix_s,
        "owned_by": "sglang",
        "root": model,
        "parent": None,
        "max_model_len": sim.config.server.context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    sim = _sim(request)
    return web.json_response({"object": "list", "data": [_model_card(sim, sim.config.server.model_name)]})


async def retrieve_model(request: web.Request) -> web.Response:
    sim = _sim(request)
    model = request.match_info["model"]
    if model != sim.config.server.model_name:
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return web.json_response({"error": error}, status=404)
    return web.json_response(_model_card(sim, model))


async def flush_cache(request: web.Request) -> web.Response:
    sim = _sim(request)
    idle = sim.engine.num_running == 0 and sim.engine.num_waiting == 0
    if idle:
        sim.engine.cache.clear()
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n",
        status=200 if idle else 400,
    )


async def abort_request(request: web.Request) -> web.Response:
    """``AbortReq``: forwarded only if ``rid`` is in flight (or abort_all); the scheduler matches by prefix."""
    sim = _sim(request)
    try:
        body = json.loads(await request.read() or b"{}")
        rid = body.get("rid") or ""
        abort_all = bool(body.get("abort_all", False))
    except (json.JSONDecodeError, AttributeError) as exc:
        return web.json_response(errors.error_body(str(exc)), status=400)
    if abort_all:
        sim.engine.abort(abort_all=True)
    elif rid and rid in sim.inflight:
        sim.engine.abort(rid)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    sim = _sim(request)
    sim.engine.advance()
    body = sim.metrics.render(sim.engine, sim.config.server.context_length, sim.config.server.max_total_num_tokens)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def get_load(request: web.Request) -> web.Response:
    """0.5.9's deprecated ``/get_load`` (``num_tokens``: KV in use plus the waiting requests' lengths)."""
    sim = _sim(request)
    sim.engine.advance()
    engine = sim.engine
    tokens = int(engine.used_tokens) + engine.waiting_tokens()
    return web.json_response(responses.get_load_body(engine.num_running, engine.num_waiting, tokens))


async def v1_loads(request: web.Request) -> web.Response:
    """``/v1/loads``: the scheduler's load per DP rank (one here) and the aggregate."""
    sim = _sim(request)
    sim.engine.advance()
    engine, stats, server = sim.engine, sim.engine.stats, sim.config.server
    hit = stats.cached_tokens_total / stats.prompt_tokens_total if stats.prompt_tokens_total else 0.0
    body = responses.v1_loads_body(
        version=sim.profile.version,
        running=engine.num_running,
        waiting=engine.num_waiting,
        used_tokens=int(engine.used_tokens),
        max_total_num_tokens=server.max_total_num_tokens,
        gen_throughput=engine.gen_throughput_tok_s(),
        cache_hit_rate=hit,
        max_running_requests=engine.config.max_running_requests,
        retracted=stats.last_retracted_reqs,
        token_capacity=server.max_total_num_tokens,
    )
    return web.json_response(body)


async def control_faults(request: web.Request) -> web.Response:
    sim = _sim(request)
    if request.method == "POST":
        try:
            changes = json.loads(await request.read() or b"{}")
            return web.json_response(sim.faults.update(changes))
        except (ValueError, TypeError) as exc:
            return web.json_response(errors.error_body(str(exc)), status=400)
    return web.json_response(sim.faults.describe())


async def control_outage(request: web.Request) -> web.Response:
    sim = _sim(request)
    try:
        body = json.loads(await request.read() or b"{}")
        duration_s = float(body.get("duration_s", sim.config.faults.outage_duration_s))
        mode = body.get("mode", "drop")
        if mode not in ("drop", "abort"):
            raise ValueError(f"mode must be 'drop' or 'abort', got {mode!r}")
    except (ValueError, TypeError, AttributeError) as exc:
        return web.json_response(errors.error_body(str(exc)), status=400)
    sim.begin_outage(duration_s, mode)
    return web.json_response(sim.faults.describe())


async def _seconds(request: web.Request) -> float:
    body = json.loads(await request.read() or b"{}")
    seconds = float(body["seconds"])
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    return seconds


async def control_health_delay(request: web.Request) -> web.Response:
    sim = _sim(request)
    try:
        sim.health_delay_s = await _seconds(request)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return web.json_response(errors.error_body(f'expected {{"seconds": S >= 0}}: {exc}'), status=400)
    return web.json_response({"health_delay_s": sim.health_delay_s})


async def control_stall(request: web.Request) -> web.Response:
    sim = _sim(request)
    try:
        seconds = await _seconds(request)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return web.json_response(errors.error_body(f'expected {{"seconds": S >= 0}}: {exc}'), status=400)
    sim.begin_stall(seconds)
    return web.json_response({"stalled": sim.stalled, "seconds": seconds})


async def control_stats(request: web.Request) -> web.Response:
    sim = _sim(request)
    sim.engine.advance()
    include_rids = request.query.get("rids", "1") not in ("0", "false", "no")
    snapshot = sim.stats.snapshot(sim.engine, dict(sim.faults.injected), include_rids)
    snapshot["paused_wall_s"] = sim.clock.paused_wall_s
    snapshot["stalled"] = sim.stalled
    snapshot["sglang_version"] = sim.profile.version
    return web.json_response(snapshot)


@web.middleware
async def _stall_gate(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """During a stall nothing but /control/* is answered (requests wait here until it ends)."""
    if not request.path.startswith("/control/"):
        await request.app[SIM_KEY].wait_unstalled()
    return await handler(request)


def create_app(config: SimConfig | None = None) -> web.Application:
    """The aiohttp app of one simulator (``app[SIM_KEY]`` is its :class:`Simulator`)."""
    # A 262k-token prompt is ~2 MB of JSON.
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_stall_gate])
    sim = Simulator(config or SimConfig())
    app[SIM_KEY] = sim

    async def on_startup(_: web.Application) -> None:
        await sim.start()

    async def on_shutdown(_: web.Application) -> None:
        await sim.stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.router.add_route("POST", "/generate", handle_generate)
    app.router.add_route("PUT", "/generate", handle_generate)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    if sim.profile.ready_route:
        app.router.add_get("/ready", ready)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/v1/loads", v1_loads)
    app.router.add_route("*", "/control/faults", control_faults)
    app.router.add_post("/control/outage", control_outage)
    app.router.add_post("/control/health_delay", control_health_delay)
    app.router.add_post("/control/stall", control_stall)
    app.router.add_get("/control/stats", control_stats)
    return app


def _active_faults(config: SimConfig) -> dict[str, Any]:
    faults = dataclasses.asdict(config.faults)
    active = {k: v for k, v in faults.items() if k.endswith("_rate") and v}
    if faults["outage_at_s"] is not None:
        active["outage_at_s"], active["outage_duration_s"] = faults["outage_at_s"], faults["outage_duration_s"]
    return active


def describe(config: SimConfig) -> str:
    """The one start-up log line."""
    server, engine = config.server, config.engine
    return (
        f"sglang-sim serving {server.model_name} on http://{server.host}:{server.port} "
        f"(sglang {server.sglang_version}, time_scale={server.time_scale:g}, "
        f"max_running={engine.max_running_requests}, kv_capacity={engine.kv_capacity_tokens or 'unlimited'}, "
        f"decode={engine.decode_tok_s:g} tok/s, per_request={engine.per_request_tok_s:g} tok/s, "
        f"speculative={server.speculative_algorithm or 'off'}, faults={_active_faults(config)})"
    )
