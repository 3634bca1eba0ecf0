"""The simulator's configuration: one dataclass per concern, gathered in :class:`SimConfig`.

Every field has a flat name that is also its CLI flag (``max_running_requests`` ↔
``--max-running-requests``); :meth:`SimConfig.from_flat` routes flat keyword arguments to the right
part, which is how ``sglang_sim.testing.run_simulator(**kwargs)`` and the CLI build a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sglang_sim.content import ContentConfig
from sglang_sim.engine import EngineConfig
from sglang_sim.faults import FaultConfig
from thinkfleet import kimi

#: The SGLang release whose wire format this simulator mirrors (reference §0, §1.4–1.5).
SGLANG_VERSION = "0.5.15"


@dataclass
class ServerConfig:
    # -- network ------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 30000

    # -- model --------------------------------------------------------------------------------------
    model_path: str = "moonshotai/Kimi-K2.5"
    #: /v1/models id; defaults to model_path, as in SGLang.
    served_model_name: str | None = None
    #: Loaded with transformers.AutoTokenizer; without it ``text`` prompts are refused (400).
    tokenizer: str | None = None
    context_length: int = 262_144
    vocab_size: int = kimi.VOCAB_SIZE
    weight_version: str = "default"
    tp_size: int = 8
    #: KV-cache capacity reported by /server_info (not enforced).
    max_total_num_tokens: int = 1_200_000
    reasoning_parser: str | None = "kimi_k2"
    tool_call_parser: str | None = "kimi_k2"

    # -- simulation ---------------------------------------------------------------------------------
    #: Simulated time runs this many times faster than wall time (1000: the 57-hour job in minutes).
    #: One core serves ~400–700 responses/s; beyond that the clock slows (see max_tick_lag_ms), so
    #: at 1000 on a small box the effective scale may be lower (/control/stats reports paused_wall_s).
    time_scale: float = 1.0
    #: Wall milliseconds between engine ticks.
    tick_ms: float = 5.0
    #: A tick woken later than this (the simulator's process was overloaded) does not count the excess
    #: as simulated time; None charges every wall second (see server.SimClock).
    max_tick_lag_ms: float | None = 20.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.tick_ms <= 0:
            raise ValueError("time_scale and tick_ms must be > 0")
        if self.context_length < 2:
            raise ValueError("context_length must be >= 2")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def max_req_input_len(self) -> int:
        """The scheduler's input limit (SGLang reserves a few tokens: context_len - 5 in practice)."""
        return max(1, min(self.context_length, self.max_total_num_tokens) - 5)


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
