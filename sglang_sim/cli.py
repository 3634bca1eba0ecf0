"""``sglang-sim --port N [...]``: run one simulated SGLang server until SIGTERM/SIGINT.

Every config field is a flag (``max_running_requests`` → ``--max-running-requests``, booleans as
``--think-end/--no-think-end``); ``sglang-sim --help`` lists them with their defaults.
``--sglang-version`` picks the release imitated (default: the deployed one,
``thinkfleet.sglang_version.SGLANG_VERSION``). With ``--load-s S`` the process sleeps S seconds before it
binds the port, as SGLang opens its HTTP port only after the weights are loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import types
import typing
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from sglang_sim.config import ServerConfig, SimConfig
from sglang_sim.content import SIM_FAMILIES, ContentConfig
from sglang_sim.engine import EngineConfig
from sglang_sim.faults import BAD_OUTPUT_KINDS, FaultConfig
from sglang_sim.server import create_app, describe
from sglang_sim.speculative import ALGORITHMS
from sglang_sim.versions import SUPPORTED_VERSIONS

_HELP = {
    "port": "TCP port to listen on.",
    "model_path": "Model name reported by /model_info, /server_info and /v1/models.",
    "tokenizer": "Tokenizer dir/id for text prompts and response text (transformers.AutoTokenizer); with a "
    "preprocessor_config.json beside it the model sees images (image_data).",
    "image_token_skew": "Each image expands into this many more tokens than its processor's rule (a miscounting "
    "server).",
    "context_length": "Context length in tokens (longer prompts get SGLang's 400).",
    "max_running_requests": "Requests decoded at once; the rest wait FIFO.",
    "max_queued_requests": "Waiting-queue bound; beyond it /generate answers 503 (default unbounded).",
    "decode_tok_s": "Total decode capacity in output tokens per simulated second.",
    "per_request_tok_s": "Decode speed cap of one request (tokens per simulated second).",
    "prefill_tok_s": "Prefill speed of uncached prompt tokens per simulated second.",
    "time_scale": "Simulated seconds per wall second (1000 turns 57 h into ~3.4 min).",
    "step_fixed_s": "Per-step cost model: a decode step of n requests takes this + n * --step-per-request-s "
    "(simulated s; unset: the per-request cap model of --decode-tok-s / --per-request-tok-s).",
    "step_per_request_s": "Per-request part of a decode step (simulated s); throughput saturates at its inverse.",
    "kv_capacity_tokens": "Enforce a KV pool of this many tokens (0.5.9's admission, new_token_ratio and "
    "retraction); also what /server_info and /v1/loads report as max_total_num_tokens. Unset: unlimited.",
    "slowdown_at_s": "From this simulated second on, steps and prefill take --slowdown-factor times as long.",
    "slowdown_factor": "How much slower the server gets at --slowdown-at-s (2: half the speed).",
    "tool_call_share": "Share of outputs that end in a native tool call.",
    "tool_catalogue": "JSON of decodable calls in the family's native tokens (sglang_sim.tools.write_catalogue).",
    "malformed_tool_call_share": "Share of catalogue calls whose arguments are cut in half (not JSON).",
    "loop_share": "Share of outputs (kimi) that fall into a repeated cycle of 2-8 ids until max_new_tokens.",
    "empty_answer_share": "Share of outputs (kimi) that close their reasoning and stop with no answer.",
    "think_end": "Close the reasoning (</think>; harmony: <|end|>); --no-think-end reproduces the seed's "
    "empty-reasoning bug.",
    "fault_503_rate": "Share of /generate calls answered 503 (queue full).",
    "fault_drop_rate": "Share of /generate calls whose connection drops mid-response.",
    "fault_hang_rate": "Share of /generate calls never answered.",
    "fault_seed": "Seed of the per-call fault choice.",
    "outage_at_s": "Start an outage this many wall seconds after start.",
    "outage_duration_s": "Length of an outage in wall seconds.",
    "weight_version": "meta_info.weight_version.",
    "sglang_version": "SGLang release whose protocol and behaviour are imitated (docs/sglang-versions.md).",
    "enable_deterministic_inference": "Report --enable-deterministic-inference in /server_info "
    "(the simulator's output is deterministic either way).",
    "load_s": "Wall seconds before the port opens (weights loading: connections are refused).",
    "warmup_s": "Wall seconds after the port opens during which /health* answer 503 (warm-up).",
    "warmup_rejects_generate": "Also answer /generate 503 during warm-up (a real server serves it).",
    "health_min_s": "Least wall seconds a 200 health answer takes (SGLang's scheduler round trip).",
    "health_delay_s": "Extra wall seconds every health answer takes (POST /control/health_delay changes it).",
    "health_check_timeout_s": "SGLANG_HEALTH_CHECK_TIMEOUT: a slower health answer is a 503 after this long.",
    "report_context_length": "Report context_length in /server_info (a real server reports null unless "
    "--context-length was given).",
    "nan_rate": "Share of generations ending on SGLang's NaN path (last id overwritten, matched 'NaN happened').",
    "abort_rate": "Share of generations the scheduler aborts part-way (see --abort-status-code).",
    "abort_status_code": "Status of those aborts: 503 running timeout, 500 internal error, 400 bad request.",
    "bad_output_rate": "Share of prompts (by their input ids: every attempt) answered 200 with a bad output.",
    "bad_output_kind": "What it carries: int32 (an id of 2**31), vocab (an id = the vocabulary size) or "
    "overlong (a stop finish with max_new_tokens + 1 ids).",
    "bad_output_per_attempt": "Draw the bad output per call instead of per prompt (a retry may get a good one).",
    "model_family": "Whose marker ids the outputs carry (kimi, qwen3, deepseek, glm45, harmony); also sets the "
    "vocabulary size, model name, parsers and EOS ids unless given.",
    "eos_token_ids": "The model's own stop ids [the family's].",
    "normal_vocab_size": "Filler ids are drawn below this [the family's first special id].",
    "dtype": "Reported in /server_info (--dtype).",
    "quantization": "Reported in /server_info (--quantization).",
    "kv_cache_dtype": "Reported in /server_info (--kv-cache-dtype).",
    "revision": "Reported in /server_info (--revision: the model's hub revision).",
    "random_seed": "Reported in /server_info (--random-seed; drawn at start when not given, as SGLang does).",
    "speculative_algorithm": "Speculative decoding: finished meta_info carries the per-request acceptance figures "
    "(spec_verify_ct, accepted drafts, …) of the imitated release.",
    "speculative_draft_model_path": "Reported in /server_info (--speculative-draft-model-path).",
    "speculative_num_steps": "Draft steps (reported; unset: SGLang's automatic 3).",
    "speculative_eagle_topk": "Draft top-k (reported; unset: SGLang's automatic 1).",
    "speculative_num_draft_tokens": "Tokens per verify step, the target's included (unset: SGLang's automatic 4).",
    "speculative_accept_rate": "Simulator only: the share of draft tokens accepted (a fixed hash of each output id "
    "and the one before it, so an output always gets the same figures).",
    "sample_per_request": "Every request draws its own output (temperature > 0, no seed): two runs of a prompt differ.",
}
_CHOICES: dict[str, Sequence[Any]] = {
    "model_family": SIM_FAMILIES,
    "sglang_version": SUPPORTED_VERSIONS,
    "abort_status_code": (400, 500, 503),
    "bad_output_kind": BAD_OUTPUT_KINDS,
    "speculative_algorithm": ALGORITHMS,
}


def _flag_type(hint: Any) -> tuple[type, dict[str, Any]]:
    """The argparse type (and extra kwargs) for a dataclass field's type hint."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is tuple:
        return int, {"nargs": "+"}
    if hint is bool:
        return bool, {"action": argparse.BooleanOptionalAction}
    return hint, {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-sim",
        description="A simulated SGLang server (native /generate protocol, continuous-batching timing).",
    )
    for title, klass in (
        ("server", ServerConfig),
        ("engine", EngineConfig),
        ("content", ContentConfig),
        ("faults", FaultConfig),
    ):
        group = parser.add_argument_group(title)
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            flag_type, extra = _flag_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            text = _HELP.get(f.name, "")
            if default is not None:
                text = f"{text} (default: {default})".strip()
            kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text}
            if "action" not in extra:
                kwargs["type"] = flag_type
            if f.name in _CHOICES:
                kwargs["choices"] = _CHOICES[f.name]
            group.add_argument("--" + f.name.replace("_", "-"), **kwargs, **extra)
    parser.add_argument("--slow-start-s", dest="warmup_s", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> SimConfig:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    if "eos_token_ids" in given:
        given["eos_token_ids"] = tuple(given["eos_token_ids"])
    return SimConfig.from_flat(**given)


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.server.load_s > 0:
        logging.getLogger("sglang_sim").info("loading weights for %.1f s: the port stays closed", config.server.load_s)
        time.sleep(config.server.load_s)  # SIGTERM now ends the process, as it would a loading server
    app = create_app(config)
    logging.getLogger("sglang_sim").info(describe(config))
    # run_app handles SIGINT/SIGTERM: on_shutdown drops hanging calls, then the loop exits cleanly.
    web.run_app(
        app,
        host=config.server.host,
        port=config.server.port,
        print=None,
        handler_cancellation=True,
        shutdown_timeout=2.0,
        access_log=None,
    )


if __name__ == "__main__":
    main()
