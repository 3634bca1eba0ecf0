"""The simulator's configuration: one dataclass per concern, gathered in :class:`SimConfig`.

Every field has a flat name that is also its CLI flag (``max_running_requests`` ↔
``--max-running-requests``); :meth:`SimConfig.from_flat` routes flat keyword arguments to the right
part, which is how ``sglang_sim.testing.run_simulator(**kwargs)`` and the CLI build a config.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from sglang_sim.content import VOCABULARIES, ContentConfig
from sglang_sim.engine import EngineConfig
from sglang_sim.faults import FaultConfig
from sglang_sim.speculative import ALGORITHMS, DEFAULT_PARAMS
from sglang_sim.versions import DEFAULT_VERSION, VersionProfile, profile
from thinkfleet import kimi
from thinkfleet.sglang_version import SGLANG_VERSION

__all__ = ["FAMILY_SERVER_DEFAULTS", "SGLANG_VERSION", "ServerConfig", "SimConfig"]

#: ``--model-family``'s server settings (each flag given still wins): the vocabulary the server checks
#: prompt ids against, the model it reports, and the parsers SGLang would run it with.
FAMILY_SERVER_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "model_path": "Qwen/Qwen3-8B",
        "vocab_size": VOCABULARIES["qwen3"].vocab_size,
        "reasoning_parser": "qwen3",
        "tool_call_parser": "qwen25",
    },
    "deepseek": {
        "model_path": "deepseek-ai/DeepSeek-R1-0528",
        "vocab_size": VOCABULARIES["deepseek"].vocab_size,
        "reasoning_parser": "deepseek-r1",
        "tool_call_parser": "deepseekv3",
    },
    "glm45": {
        "model_path": "zai-org/GLM-4.5",
        "vocab_size": VOCABULARIES["glm45"].vocab_size,
        "reasoning_parser": "glm45",
        "tool_call_parser": "glm45",
    },
    "harmony": {
        "model_path": "openai/gpt-oss-120b",
        "vocab_size": VOCABULARIES["harmony"].vocab_size,
        "reasoning_parser": "gpt-oss",
        "tool_call_parser": "gpt-oss",
    },
}


@dataclass
class ServerConfig:
    # -- network ------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 30000

    # -- which SGLang ----------------------------------------------------------------------------------
    #: The release whose wire format and behaviour are imitated (sglang_sim.versions); the deployed one
    #: by default. /server_info reports it as ``version``.
    sglang_version: str = DEFAULT_VERSION
    #: Reported in /server_info (``enable_deterministic_inference`` and the settings it forces); the
    #: simulator's output is deterministic either way (it does not model batch-dependent sampling).
    enable_deterministic_inference: bool = False
    #: ``--enable-metrics`` (the compose file runs it): reported in /server_info, and 0.5.9 then adds the
    #: scheduler's timing keys to every ``meta_info``.
    enable_metrics: bool = True

    # -- lifecycle and health (wall seconds) --------------------------------------------------------------
    #: Weights loading: the port refuses connections this long after start (SGLang starts uvicorn only
    #: once the scheduler has loaded the model).
    load_s: float = 0.0
    #: Warm-up after the port opens: /health and /health_generate answer 503 (ServerStatus.Starting).
    warmup_s: float = 0.0
    #: During warm-up /generate also answers 503 (the real server serves it; this is a test knob).
    warmup_rejects_generate: bool = False
    #: Least time a 200 health answer takes (SGLang polls its scheduler round trip once a second).
    health_min_s: float = 1.0
    #: Extra time every health answer takes (a slow scheduler); POST /control/health_delay changes it.
    health_delay_s: float = 0.0
    #: SGLANG_HEALTH_CHECK_TIMEOUT: a health answer that would take longer is a 503 after this long.
    health_check_timeout_s: float = 20.0

    # -- model --------------------------------------------------------------------------------------
    model_path: str = "moonshotai/Kimi-K2.5"
    #: /v1/models id; defaults to model_path, as in SGLang.
    served_model_name: str | None = None
    #: Loaded with transformers.AutoTokenizer; without it ``text`` prompts are refused (400).
    tokenizer: str | None = None
    context_length: int = 262_144
    vocab_size: int = kimi.VOCAB_SIZE
    weight_version: str = "default"
    #: /server_info ``context_length`` is SGLang's *CLI value*: False reports null, as a server started
    #: without ``--context-length`` does (the effective length is /v1/models ``max_model_len``).
    report_context_length: bool = True
    tp_size: int = 8
    #: KV-cache capacity reported by /server_info and /v1/loads (enforced only with the engine's
    #: ``kv_capacity_tokens``, which sets it when it is not given).
    max_total_num_tokens: int = 1_200_000
    reasoning_parser: str | None = "kimi_k2"
    tool_call_parser: str | None = "kimi_k2"
    #: Launch arguments /server_info reports as given (what a data set's provenance records of the server).
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    revision: str | None = None
    #: ``--random-seed``; a real server given none draws ``random.randint(0, 1 << 30)`` at start (ServerArgs).
    random_seed: int | None = None

    # -- speculative decoding (sglang_sim.speculative) ------------------------------------------------
    #: ``--speculative-algorithm``: finished ``meta_info`` then carries the acceptance figures.
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    #: Unset with an algorithm: SGLang's automatic choice (3 steps, top-k 1, 4 draft tokens).
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    #: Simulator only: the share of draft tokens the (imagined) draft model guesses right.
    speculative_accept_rate: float = 0.7

    # -- simulation ---------------------------------------------------------------------------------
    #: Simulated time runs this many times faster than wall time (1000: the 57-hour job in minutes).
    #: One core serves ~400–700 responses/s; beyond that the clock slows (see max_tick_lag_ms), so
    #: at 1000 on a small box the effective scale may be lower (/control/stats reports paused_wall_s).
    time_scale: float = 1.0
    #: Wall milliseconds between engine ticks.
    tick_ms: float = 5.0
    #: A tick woken later than this (the simulator's process was overloaded) does not count the excess
    #: as simulated time; None charges every wall second (see simulator.SimClock).
    max_tick_lag_ms: float | None = 20.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.tick_ms <= 0:
            raise ValueError("time_scale and tick_ms must be > 0")
        if self.context_length < 2:
            raise ValueError("context_length must be >= 2")
        profile(self.sglang_version)  # validates
        for name in ("load_s", "warmup_s", "health_min_s", "health_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.health_check_timeout_s <= 0:
            raise ValueError("health_check_timeout_s must be > 0")
        if self.random_seed is None:  # as ServerArgs.__post_init__ does: /server_info reports the one drawn
            self.random_seed = random.randint(0, 1 << 30)
        self._resolve_speculative()

    def _resolve_speculative(self) -> None:
        """``ServerArgs``' speculative settings after its post-init: NEXTN is EAGLE, unset sizes chosen."""
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm.upper() not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        self.speculative_algorithm = "EAGLE" if algorithm.upper() == "NEXTN" else algorithm.upper()
        steps, topk, drafts = DEFAULT_PARAMS
        if self.speculative_num_steps is None:
            self.speculative_num_steps = steps
        if self.speculative_eagle_topk is None:
            self.speculative_eagle_topk = topk
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = drafts
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("speculative_num_draft_tokens must be >= 2 (one draft token and the target's)")
        if not 0.0 <= self.speculative_accept_rate <= 1.0:
            raise ValueError("speculative_accept_rate must be in [0, 1]")

    @property
    def profile(self) -> VersionProfile:
        return profile(self.sglang_version)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def max_req_input_len(self) -> int:
        """The scheduler's input limit: ``min(context_len - 1, pool - 1) - 5`` (tp_worker)."""
        return max(1, min(self.context_length - 1, self.max_total_num_tokens - 1) - 5)


@dataclass
class SimConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    content: ContentConfig = field(default_factory=ContentConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    @classmethod
    def from_flat(cls, **kwargs: Any) -> SimConfig:
        """Build from flat field names (``time_scale=1000, tool_call_share=0.2, no_think_end=True``)."""
        if "no_think_end" in kwargs:
            kwargs["think_end"] = not kwargs.pop("no_think_end")
        if "slow_start_s" in kwargs:  # the old name of warmup_s
            kwargs.setdefault("warmup_s", kwargs.pop("slow_start_s"))
        if kwargs.get("kv_capacity_tokens") is not None:  # the enforced pool is the one reported
            kwargs.setdefault("max_total_num_tokens", kwargs["kv_capacity_tokens"])
        family = kwargs.get("model_family")
        if family and family != "kimi":  # --model-family: the served model's vocabulary, name and parsers
            for key, value in FAMILY_SERVER_DEFAULTS.get(family, {}).items():
                kwargs.setdefault(key, value)
        parts: dict[str, dict[str, Any]] = {name: {} for name in ("server", "engine", "content", "faults")}
        owners = {
            f.name: part
            for part, klass in (
                ("server", ServerConfig),
                ("engine", EngineConfig),
                ("content", ContentConfig),
                ("faults", FaultConfig),
            )
            for f in dataclasses.fields(klass)
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown simulator option {key!r}")
            parts[owners[key]][key] = value
        return cls(
            server=ServerConfig(**parts["server"]),
            engine=EngineConfig(**parts["engine"]),
            content=ContentConfig(**parts["content"]),
            faults=FaultConfig(**parts["faults"]),
        )
