"""What the simulated model "says": deterministic outputs of one model family from (input_ids, sampling_seed).

This is a pure library function so tests can compute the exact ids a simulator returned and check stored
Parquet rows byte for byte: ``expected_generation(input_ids, sampling_params, ContentConfig(...))`` is
what the server itself calls.

How an output is built:

1. One RNG (numpy PCG64) is seeded from ``blake2b(uint32-LE input ids ‖ sampling_seed)``
   (``sampling_seed`` None → 0), so the same prompt and seed always give the same ids.
2. The *natural* length is lognormal (median 646, σ 1.25 → mean ≈ 1416 tokens), the seed run's measured
   distribution. Reasoning takes 60–80 % of it.
3. Normal output: ``[reasoning…, </think> 163607, answer…, <|im_end|> 163586]``.
   Tool call (``tool_call_share``): ``[reasoning…, (163607, short answer…)?, 163595, (163597, name ids,
   163598, JSON-arg ids, 163599)+, 163596, 163586]``; some go from reasoning straight into 163595, as
   Kimi's parser allows. ``think_end=False`` (``--no-think-end``) never emits 163607 — the seed bug.
4. Filler ids come from the normal vocabulary [0, 163584), one draw per position, so an output cut by
   ``max_new_tokens`` is a prefix of the uncut one (like a real model with a fixed seed).
5. ``model_family`` (``--model-family``) picks the marker ids, from the real tokenizers' tables in
   :mod:`thinkfleet.profiles` (the simulator has no tokenizer). ``kimi`` (the default) is exactly the
   output above. ``qwen3``: ``[<think> 151667, reasoning…, </think> 151668, answer…, <|im_end|> 151645]``
   (no ``<think>`` when the prompt already ends with it, or with it and a newline); a tool call is
   ``…</think>, preamble?, (<tool_call> 151657, JSON ids, </tool_call> 151658)+, <|im_end|>``.
   ``deepseek`` (R1-0528, whose prompt ends ``<think>\\n``): ``[reasoning…, </think> 128799, answer…,
   <｜end▁of▁sentence｜> 1]``; a tool call is ``…</think>, preamble?, <｜tool▁calls▁begin｜> 128806,
   (<｜tool▁call▁begin｜> 128808, "function" ids, <｜tool▁sep｜> 128814, name + fenced JSON ids,
   <｜tool▁call▁end｜> 128809)+, <｜tool▁calls▁end｜> 128807, <｜end▁of▁sentence｜>``; fillers avoid ids 0–2.
   ``glm45`` (GLM-4.5, the model opens ``<think>`` itself): ``[<think> 151350, reasoning…, </think> 151351,
   answer…, <|user|> 151336]``; a tool call is ``…</think>, preamble?, (<tool_call> 151352, name ids,
   <arg_key> 151356, key/value ids, </tool_call> 151353)+, <|observation|> 151338``. For these three a
   prompt that already closed reasoning (thinking off: it ends with ``</think>`` and at most two ordinary
   ids) gets no reasoning and no think markers, only the answer or the calls.
   ``harmony`` (gpt-oss): ``[<|channel|> 200005, analysis 35644, <|message|> 200008, reasoning…,
   <|end|> 200007, <|start|> 200006, assistant 173781, <|channel|>, final 17196, <|message|>, answer…,
   <|return|> 200002]``; a tool call replaces the final message with
   ``<|start|> assistant <|channel|> commentary( 12606 815) to=functions(316 28 44580) NAME…
   ␠<|constrain|> json<|message|> ARGS… <|call|> 200012``. ``think_end=False`` never closes the reasoning
   (no ``</think>``; harmony: the analysis message runs to ``<|return|>``). Filler ids come from
   [0, the family's first special id).
   With ``tool_catalogue`` (:mod:`sglang_sim.tools`) each call's ids between its markers are a catalogue call
   drawn by the same RNG — a real name and JSON arguments in the family's native form, a share of them malformed
   (``malformed_tool_call_share``) — instead of filler; several calls per turn as above (harmony: one, its
   ``commentary to=functions.NAME <|constrain|>json<|message|>ARGS`` after ``<|channel|>``).
   Degenerate outputs (Kimi only; none by default, and a share of 0 draws nothing, so other outputs are unchanged):
   ``loop_share`` of outputs fall, a few dozen reasoning ids in, into a cycle of 2–8 ids repeated to
   ``max_new_tokens`` (no ``</think>``, no stop: a length finish); ``empty_answer_share`` close their reasoning
   and stop at once (``[reasoning…, </think>, <|im_end|>]``). Quality flags (storage/quality.py) count both.
6. SGLang's finish rules are then applied in its order (``schedule_batch.Req.check_finished``): length
   first (``len == max_new_tokens`` → ``{"type":"length"}``), then a token in ``stop_token_ids`` ∪ the
   model's EOS set → ``{"type":"stop","matched":id}`` with the id *included*; ``ignore_eos`` disables
   every token-based stop and decodes on to ``max_new_tokens``.

One file because the outputs are one deterministic draw: every family's plan takes its random numbers from the same
generator in one order, which tests reproduce id for id; split, that order would live in two places.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sglang_sim.tools import ToolCatalogue, load_catalogue
from thinkfleet import kimi, profiles

#: SGLang's default when a request sends no ``max_new_tokens`` (sampling_params.py).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class FamilyVocabulary:
    """The ids a simulated model of one family emits (its real tokenizer's, :mod:`thinkfleet.profiles`)."""

    family: str
    first_special_id: int  # filler ids are drawn below it
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # the model's own stop set (config/generation_config eos)
    think_start: int | None
    think_end: int
    # -- think-scheme families other than Kimi (qwen3, deepseek, glm45): :func:`_plan_think` ------------
    end_of_turn: int | None = None  # ends an answer
    call_end_of_turn: int | None = None  # ends a tool-calling turn (GLM-4.5: <|observation|>)
    tool_section: tuple[int, int] | None = None  # DeepSeek's <｜tool▁calls▁begin｜> … end
    tool_call: tuple[int, int] | None = None  # one call's begin … end
    tool_sep: int | None = None  # inside a call, after its header (DeepSeek's <｜tool▁sep｜>, GLM's <arg_key>)
    #: filler ids are drawn from [filler_low, first_special_id): DeepSeek's 0–2 are BOS, EOS and pad.
    filler_low: int = 0


def _ref(family: str) -> dict[str, int]:
    return dict(profiles.PROFILES[family].reference_ids)


def _think_family(family: str, first_special_id: int, eos: tuple[str, ...], **extra: Any) -> FamilyVocabulary:
    """A think-scheme family's vocabulary, every id from its profile (markers by role, so no id is written twice)."""
    profile = profiles.PROFILES[family]
    ref, role = _ref(family), profile.markers

    def id_of(name: str | None) -> int | None:
        return ref[name] if name is not None else None

    section = (id_of(role["tool_section_begin_id"]), id_of(role["tool_section_end_id"]))
    return FamilyVocabulary(
        family,
        first_special_id,
        profile.reference_vocab_size or 0,
        tuple(ref[t] for t in eos),
        id_of(role["think_start_id"]),
        ref[role["think_end_id"] or ""],
        end_of_turn=ref[profile.stop_tokens[0]],
        call_end_of_turn=ref[profile.stop_tokens[-1]],
        tool_section=section if None not in section else None,  # type: ignore[arg-type]
        tool_call=(ref[role["tool_call_begin_id"] or ""], ref[role["tool_call_end_id"] or ""]),
        tool_sep=id_of(role["tool_call_argument_begin_id"]),
        **extra,
    )


_H = _ref("harmony")
#: ``--model-family`` choices of the simulator.
VOCABULARIES: dict[str, FamilyVocabulary] = {
    "kimi": FamilyVocabulary(
        "kimi", kimi.FIRST_SPECIAL_ID, kimi.VOCAB_SIZE, kimi.DEFAULT_STOP_TOKEN_IDS, kimi.THINK_START, kimi.THINK_END
    ),
    # Qwen3 has no argument marker of its own: its calls are JSON between <tool_call> and </tool_call>.
    "qwen3": replace(_think_family("qwen3", 151_643, ("<|im_end|>", "<|endoftext|>")), tool_sep=None),
    # DeepSeek-R1-0528: EOS is <｜end▁of▁sentence｜> (id 1), so fillers start at 3.
    "deepseek": _think_family("deepseek", 128_000, ("<｜end▁of▁sentence｜>",), filler_low=3),
    # GLM-4.5 (generation_config eos: <|endoftext|>, <|user|>, <|observation|>): an answer ends with <|user|>,
    # a tool call with <|observation|> (the turn the tool's result fills).
    "glm45": replace(
        _think_family("glm45", 151_329, ("<|endoftext|>", "<|user|>", "<|observation|>")),
        end_of_turn=_ref("glm45")["<|user|>"],
    ),
    "harmony": FamilyVocabulary(
        "harmony", 199_998, 201_088, (_H["<|return|>"], _H["<|endoftext|>"], _H["<|call|>"]), None, _H["<|end|>"]
    ),
}
SIM_FAMILIES: tuple[str, ...] = tuple(VOCABULARIES)
# Ordinary o200k ids of a harmony tool-call header (" to", "=", "functions", " ", "json", "comment", "ary").
_TO, _EQ, _FUNCTIONS, _SPACE, _JSON, _COMMENT, _ARY = 316, 28, 44580, 220, 4108, 12606, 815


@dataclass(frozen=True)
class ContentConfig:
    """Shape of the simulated outputs; the server's CLI flags map onto these fields."""

    # -- length: lognormal fitted to the seed run (median 646, mean ≈ 1416, tail past 10k) ----------
    length_median_tokens: float = 646.0
    length_sigma: float = 1.25
    min_length_tokens: int = 8
    #: Natural lengths are clipped here so one unlucky draw cannot allocate a huge array.
    max_length_tokens: int = 262_144

    # -- structure ----------------------------------------------------------------------------------
    reasoning_share_min: float = 0.6
    reasoning_share_max: float = 0.8
    #: False reproduces the seed's silent failure: 163607 is never emitted.
    think_end: bool = True
    #: Share of outputs that end in a native Kimi tool call.
    tool_call_share: float = 0.1
    #: Share of tool calls that go from reasoning straight into 163595, without 163607.
    tool_call_direct_share: float = 0.25
    max_tool_calls: int = 3
    #: A JSON file of calls pre-tokenized in the family's native form (:mod:`sglang_sim.tools`): calls then decode
    #: to a real name and arguments (agentic jobs match them by name). None: filler between real markers.
    tool_catalogue: str | None = None
    #: Share of catalogue calls whose arguments are cut in half (not JSON).
    malformed_tool_call_share: float = 0.0
    #: Share of outputs (Kimi) that loop: a cycle of 2–8 ids repeated from early in the reasoning to the limit.
    loop_share: float = 0.0
    #: Share of outputs (Kimi) that close their reasoning and say nothing: ``</think>`` then the stop.
    empty_answer_share: float = 0.0

    #: Every request draws its own output (as sampling at temperature > 0 without a fixed seed does): two runs of
    #: one prompt differ. Off: the output depends on (input ids, seed) only, so tests check rows byte for byte.
    sample_per_request: bool = False

    # -- vocabulary -----------------------------------------------------------------------------------
    #: Whose marker ids the outputs carry (:data:`SIM_FAMILIES`): kimi, qwen3, deepseek, glm45, harmony.
    model_family: str = "kimi"
    #: The model's own stop set (config/generation_config eos ids); requests add ``stop_token_ids``.
    #: None: the family's.
    eos_token_ids: tuple[int, ...] | None = None
    #: Filler ids are drawn from [0, normal_vocab_size): never a special token by accident. None: the
    #: family's first special id.
    normal_vocab_size: int | None = None

    @property
    def vocabulary(self) -> FamilyVocabulary:
        return VOCABULARIES[self.model_family]

    @property
    def catalogue(self) -> ToolCatalogue | None:
        """The loaded :attr:`tool_catalogue` (None without one)."""
        return load_catalogue(self.tool_catalogue) if self.tool_catalogue else None

    @property
    def think_end_id(self) -> int:
        """The id SGLang's ``reasoning_tokens`` counts up to (the family's reasoning end)."""
        return self.vocabulary.think_end

    def __post_init__(self) -> None:
        if self.model_family not in VOCABULARIES:
            raise ValueError(f"model_family must be one of {', '.join(SIM_FAMILIES)}")
        vocab = VOCABULARIES[self.model_family]
        if self.eos_token_ids is None:
            object.__setattr__(self, "eos_token_ids", vocab.eos_token_ids)
        if self.normal_vocab_size is None:
            object.__setattr__(self, "normal_vocab_size", vocab.first_special_id)
        if self.length_median_tokens <= 0 or self.length_sigma < 0:
            raise ValueError("length_median_tokens must be > 0 and length_sigma >= 0")
        if not 4 <= self.min_length_tokens <= self.max_length_tokens:
            raise ValueError("need 4 <= min_length_tokens <= max_length_tokens")
        if not 0.0 < self.reasoning_share_min <= self.reasoning_share_max <= 0.9:
            raise ValueError("need 0 < reasoning_share_min <= reasoning_share_max <= 0.9")
        if self.tool_catalogue and self.catalogue is not None and self.catalogue.family != self.model_family:
            found = self.catalogue.family
            raise ValueError(f"tool_catalogue {self.tool_catalogue} is for {found}, not {self.model_family}")
        shares = ("tool_call_share", "tool_call_direct_share", "malformed_tool_call_share", "loop_share")
        for name in (*shares, "empty_answer_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.max_tool_calls < 1:
            raise ValueError("max_tool_calls must be >= 1")
        if not 0 < self.normal_vocab_size <= vocab.first_special_id:
            raise ValueError(f"normal_vocab_size must be in (0, {vocab.first_special_id}]")


@dataclass(frozen=True)
class Generation:
    """One request's result as the server reports it."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    #: SGLang's count: output tokens up to and including the first 163607, else all of them.
    reasoning_tokens: int
    #: Whether the natural output was a tool call (it may have been cut before the call).
    tool_call: bool = False
    #: A degenerate output drawn by ``loop_share`` / ``empty_answer_share``: "loop", "empty_answer", else None
    #: (an empty answer cut by ``max_new_tokens`` before its ``</think>`` is still "empty_answer" here).
    degenerate: str | None = None


@dataclass(frozen=True)
class _Plan:
    """The natural output: its length and the special ids at fixed positions."""

    length: int
    specials: list[tuple[int, int]]  # (position, token id)
    tool_call: bool
    #: The id that ends the natural output (without a stop on it the model decodes on).
    end_token: int = kimi.IM_END
    #: A degenerate loop: from ``loop_start`` on, the ids repeat with this period to the end (0: no loop).
    loop_start: int = 0
    loop_period: int = 0
    empty_answer: bool = False


#: How far from the prompt's end a ``<think>`` still opens reasoning (``<think>`` then at most two ordinary ids).
PROMPT_OPEN_WINDOW = 3


def prompt_opens_reasoning(input_ids: Sequence[int], config: ContentConfig) -> bool:
    """The prompt leaves the model inside reasoning: it ends with ``<think>`` and at most two ordinary ids after it
    (Qwen3-Thinking-2507's ``<think>\\n``). The simulator has no tokenizer to know which ids are whitespace, so
    any ordinary id counts; storage reads the job's own whitespace ids (``storage.spans.prompt_opens_reasoning``)."""
    start = config.vocabulary.think_start
    if start is None:
        return False
    for token in reversed([int(t) for t in input_ids[-PROMPT_OPEN_WINDOW:]]):
        if token == start:
            return True
        if token >= config.vocabulary.first_special_id:
            return False
    return False


def prompt_closes_reasoning(input_ids: Sequence[int], config: ContentConfig) -> bool:
    """The prompt already holds an empty, closed reasoning block (thinking off: Qwen3's ``<think>\\n\\n</think>\\n\\n``,
    DeepSeek's ``</think>``, GLM-4.5's ``<think></think>``): it ends with the think-end id and at most two ordinary
    ids. Such a model answers at once: no reasoning, no think markers."""
    vocab = config.vocabulary
    if vocab.think_start is None:
        return False
    for token in reversed([int(t) for t in input_ids[-PROMPT_OPEN_WINDOW:]]):
        if token == vocab.think_end:
            return True
        if token >= vocab.first_special_id:
            return False
    return False


def seed_bytes(input_ids: Sequence[int], sampling_seed: int | None) -> bytes:
    """32 bytes that fix an output: blake2b over the uint32-LE ids and the seed."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(np.asarray(input_ids, dtype="<u4").tobytes())
    digest.update(b"|seed=" + str(0 if sampling_seed is None else int(sampling_seed)).encode())
    return digest.digest()


def expected_generation(
    input_ids: Sequence[int],
    sampling_params: Mapping[str, Any] | None = None,
    config: ContentConfig | None = None,
) -> Generation:
    """The exact output a simulator with ``config`` returns for this prompt and these sampling params.

    Reads ``max_new_tokens`` (default 128), ``stop_token_ids``, ``ignore_eos`` and ``sampling_seed``;
    other params (temperature, top_p, …) do not change the ids.
    """
    config = config or ContentConfig()
    params = sampling_params or {}
    max_new_tokens = params.get("max_new_tokens")
    limit = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else int(max_new_tokens)
    ignore_eos = bool(params.get("ignore_eos") or False)
    stop_ids = {int(t) for t in (params.get("stop_token_ids") or []) if t is not None}
    stop_set = stop_ids | set(config.eos_token_ids)

    rng = np.random.default_rng(int.from_bytes(seed_bytes(input_ids, params.get("sampling_seed")), "little"))
    # Its draws depend on (ids, seed) only: the filler is the same for any cap.
    if config.model_family == "kimi":
        plan = _plan(rng, config)
    elif config.model_family == "harmony":
        plan = _plan_harmony(rng, config)
    else:
        plan = _plan_think(
            rng, config, prompt_opens_reasoning(input_ids, config), prompt_closes_reasoning(input_ids, config)
        )
    if limit <= 0:
        return Generation([], {"type": "length", "length": limit}, 0, plan.tool_call)

    # Without a stop on the natural end token the model decodes on (as ignore_eos does).
    ends_naturally = not ignore_eos and plan.end_token in stop_set
    needed = min(plan.length, limit) if ends_naturally else limit
    seq = rng.integers(config.vocabulary.filler_low, config.normal_vocab_size, size=needed, dtype=np.int64)
    for position, token in plan.specials:
        if position < needed:
            seq[position] = token
    if plan.loop_period and needed > plan.loop_start:  # the cycle repeats to the end (a prefix of a longer cap's)
        cycle = seq[plan.loop_start : plan.loop_start + plan.loop_period].copy()
        seq[plan.loop_start :] = np.resize(cycle, needed - plan.loop_start)

    output = seq.tolist()
    if not ignore_eos:
        first_stop = min((_index(output, token) for token in stop_set), default=len(output))
        if first_stop < len(output):
            output = output[: first_stop + 1]
    if len(output) >= limit:
        # SGLang checks length before stop tokens: a stop id in the last allowed slot is a length finish.
        finish: dict[str, Any] = {"type": "length", "length": limit}
    else:
        finish = {"type": "stop", "matched": output[-1]}
    degenerate = "loop" if plan.loop_period else ("empty_answer" if plan.empty_answer else None)
    return Generation(
        output, finish, reasoning_token_count(output, config.think_end_id), plan.tool_call, degenerate=degenerate
    )


#: ``finish_reason.matched`` of SGLang's NaN / out-of-vocabulary path.
NAN_MATCHED = "NaN happened"


def nan_overwrite_id(stop_token_ids: Sequence[int], eos_token_ids: Sequence[int], vocab_size: int) -> int:
    """The id SGLang writes over the bad sample (``Req._check_vocab_boundary_finish``, 0.5.9 and 0.5.23).

    It first writes ``next(iter(sampling_params.stop_token_ids))`` if the request has stop ids, then
    ``next(iter(eos_token_ids))`` if the model has an EOS set — so the model's EOS wins whenever it has
    one (Python set order: 163585 ``[EOS]`` for Kimi's ``{163586, 163585}``). With neither, the
    out-of-vocabulary sample itself stays (the simulator reports ``vocab_size``).
    """
    overwrite = vocab_size
    if stop_token_ids:
        overwrite = next(iter(set(stop_token_ids)))
    if eos_token_ids:
        overwrite = next(iter(set(eos_token_ids)))
    return overwrite


def nan_generation(generation: Generation, position: int, overwrite_id: int) -> Generation:
    """``generation`` as the NaN path ends it: the sample at ``position`` was out of vocabulary.

    ``output_ids == generation.output_ids[:position] + [overwrite_id]`` — every id but the last is the
    normal output, so a test recognizes a NaN row by ``finish_reason.matched == "NaN happened"`` and
    checks ``output_ids[:-1]`` against :func:`expected_generation`. ``position`` must be below
    ``len(generation.output_ids) - 1`` (the NaN stop comes before the natural end).
    """
    if not 0 <= position < len(generation.output_ids) - 1:
        raise ValueError(f"position {position} is not before the last of {len(generation.output_ids)} ids")
    ids = [*generation.output_ids[:position], overwrite_id]
    finish = {"type": "stop", "matched": NAN_MATCHED}
    return Generation(ids, finish, reasoning_token_count(ids), generation.tool_call)


def _index(ids: list[int], token: int) -> int:
    """Position of ``token`` in ``ids``, or ``len(ids)`` (C-speed ``list.index``)."""
    try:
        return ids.index(token)
    except ValueError:
        return len(ids)


def reasoning_token_count(output_ids: Sequence[int], think_end_id: int = kimi.THINK_END) -> int:
    """SGLang's ``reasoning_tokens``: tokens up to and including the first think-end, else all."""
    try:
        return list(output_ids).index(think_end_id) + 1
    except ValueError:
        return len(output_ids)


def _plan(rng: np.random.Generator, config: ContentConfig) -> _Plan:
    """Draw the natural length and where the special tokens go (independent of max_new_tokens)."""
    drawn = rng.lognormal(np.log(config.length_median_tokens), config.length_sigma)
    length = int(min(max(round(drawn), config.min_length_tokens), config.max_length_tokens))
    share = rng.uniform(config.reasoning_share_min, config.reasoning_share_max)
    reasoning = max(1, min(round(length * share), length - 2))
    # Drawn only when asked for, so the outputs of a simulator without them are the same as before they existed.
    if config.loop_share and rng.random() < config.loop_share:
        start, period = int(rng.integers(8, 48)), int(rng.integers(2, 9))
        return _Plan(config.max_length_tokens, [], tool_call=False, end_token=-1, loop_start=start, loop_period=period)
    if config.empty_answer_share and rng.random() < config.empty_answer_share:
        specials = [(reasoning, kimi.THINK_END), (reasoning + 1, kimi.IM_END)]
        return _Plan(reasoning + 2, specials, tool_call=False, empty_answer=True)
    if rng.random() < config.tool_call_share:
        return _plan_tool_call(rng, config, reasoning)

    specials = [(length - 1, kimi.IM_END)]
    if config.think_end:
        specials.append((reasoning, kimi.THINK_END))
    return _Plan(length, specials, tool_call=False)


def _plan_tool_call(rng: np.random.Generator, config: ContentConfig, reasoning: int) -> _Plan:
    """``reasoning, (163607, short answer)?, 163595, (163597 name 163598 args 163599)+, 163596, 163586``."""
    specials: list[tuple[int, int]] = []
    position = reasoning
    direct = rng.random() < config.tool_call_direct_share
    if not direct:
        if config.think_end:
            specials.append((position, kimi.THINK_END))
            position += 1
        position += int(rng.integers(0, 31))  # a short preamble such as "Let me check the weather."
    specials.append((position, kimi.TOOL_CALLS_SECTION_BEGIN))
    position += 1
    calls = 1 + int(rng.binomial(config.max_tool_calls - 1, 0.2))
    catalogue = config.catalogue
    for k in range(calls):
        specials.append((position, kimi.TOOL_CALL_BEGIN))
        if catalogue is not None:  # "functions.NAME:k" <|tool_call_argument_begin|> ARGS, decodable
            position = _place(specials, position + 1, catalogue.draw(rng, k, config.malformed_tool_call_share))
        else:
            position += 1 + int(rng.integers(4, 10))  # ids of "functions.get_weather:0"
            specials.append((position, kimi.TOOL_CALL_ARGUMENT_BEGIN))
            position += 1 + int(rng.integers(8, 81))  # ids of the JSON arguments
        specials.append((position, kimi.TOOL_CALL_END))
        position += 1
    specials.append((position, kimi.TOOL_CALLS_SECTION_END))
    specials.append((position + 1, kimi.IM_END))
    return _Plan(position + 2, specials, tool_call=True)


def _place(specials: list[tuple[int, int]], position: int, body: list[int]) -> int:
    """Put a catalogue call's ids at ``position`` onward; the position after them."""
    specials.extend((position + j, token) for j, token in enumerate(body))
    return position + len(body)


def _natural(rng: np.random.Generator, config: ContentConfig, least_reasoning: int) -> tuple[int, int]:
    """The natural length and where reasoning ends (the draws of :func:`_plan`)."""
    drawn = rng.lognormal(np.log(config.length_median_tokens), config.length_sigma)
    length = int(min(max(round(drawn), config.min_length_tokens), config.max_length_tokens))
    share = rng.uniform(config.reasoning_share_min, config.reasoning_share_max)
    reasoning = max(least_reasoning, min(round(length * share), length - 2))
    return max(length, reasoning + 2), reasoning


def _plan_think(rng: np.random.Generator, config: ContentConfig, opened: bool, closed: bool) -> _Plan:
    """Qwen3, DeepSeek, GLM-4.5: ``<think>`` (unless the prompt opened it), reasoning, ``</think>`` (none of the
    three when the prompt closed reasoning: thinking off), then an answer and the end of turn, or tool calls —
    optionally inside the family's section (DeepSeek), each ``begin, header, (sep, arguments)?, end`` — and the
    tool-calling turn's end (GLM-4.5: ``<|observation|>``)."""
    v = config.vocabulary
    assert v.tool_call is not None and v.end_of_turn is not None and v.call_end_of_turn is not None
    length, reasoning = _natural(rng, config, least_reasoning=2)
    thinks = not closed
    specials: list[tuple[int, int]] = [] if opened or closed else [(0, v.think_start or 0)]
    if rng.random() < config.tool_call_share and (config.think_end or closed):
        position = reasoning if thinks else 0
        if thinks:
            specials.append((position, v.think_end))
            position += 1
        position += int(rng.integers(0, 31))  # "\n\n" and a short preamble
        if v.tool_section is not None:
            specials.append((position, v.tool_section[0]))
            position += 1
        calls = 1 + int(rng.binomial(config.max_tool_calls - 1, 0.2))
        catalogue = config.catalogue
        for k in range(calls):
            specials.append((position, v.tool_call[0]))
            if catalogue is not None:  # Qwen3: '\n{"name": NAME, "arguments": ARGS}\n', decodable
                position = _place(specials, position + 1, catalogue.draw(rng, k, config.malformed_tool_call_share))
            else:
                if v.tool_sep is not None:  # "function" / "get_weather\n", then the separator
                    position += 1 + int(rng.integers(1, 6))
                    specials.append((position, v.tool_sep))
                position += 1 + int(rng.integers(12, 90))  # the arguments (Qwen3: '\n{"name": …, "arguments": {…}}\n')
            specials.append((position, v.tool_call[1]))
            position += 1 + (k < calls - 1 and v.tool_section is None)  # a "\n" between bare calls
        if v.tool_section is not None:
            specials.append((position, v.tool_section[1]))
            position += 1
        specials.append((position, v.call_end_of_turn))
        return _Plan(position + 1, specials, tool_call=True, end_token=v.call_end_of_turn)
    if config.think_end and thinks:
        specials.append((reasoning, v.think_end))
    specials.append((length - 1, v.end_of_turn))
    return _Plan(length, specials, tool_call=False, end_token=v.end_of_turn)


def _plan_harmony(rng: np.random.Generator, config: ContentConfig) -> _Plan:
    """gpt-oss: an ``analysis`` message, then a ``final`` message or a ``commentary`` call to a function."""
    h = _ref("harmony")
    channel, message, end, start = h["<|channel|>"], h["<|message|>"], h["<|end|>"], h["<|start|>"]
    length, reasoning = _natural(rng, config, least_reasoning=4)
    specials = [(0, channel), (1, h["analysis"]), (2, message)]
    if not config.think_end:  # the analysis message is never closed: the seed's bug, harmony-style
        specials.append((length - 1, h["<|return|>"]))
        return _Plan(length, specials, tool_call=False, end_token=h["<|return|>"])
    position = reasoning
    header = [end, start, h["assistant"], channel]
    if rng.random() < config.tool_call_share:
        catalogue = config.catalogue
        if catalogue is not None:  # "commentary to=functions.NAME <|constrain|>json<|message|>ARGS", decodable
            specials += [(position + i, t) for i, t in enumerate(header)]
            body = catalogue.draw(rng, 0, config.malformed_tool_call_share)
            position = _place(specials, position + len(header), body)
            specials.append((position, h["<|call|>"]))
            return _Plan(position + 1, specials, tool_call=True, end_token=h["<|call|>"])
        name = [int(t) for t in rng.integers(1000, 30000, size=int(rng.integers(1, 4)))]
        header += [_COMMENT, _ARY, _TO, _EQ, _FUNCTIONS, *name, _SPACE, h["<|constrain|>"], _JSON, message]
        specials += [(position + i, t) for i, t in enumerate(header)]
        position += len(header) + int(rng.integers(8, 81))  # the JSON arguments
        specials.append((position, h["<|call|>"]))
        return _Plan(position + 1, specials, tool_call=True, end_token=h["<|call|>"])
    header += [h["final"], message]
    specials += [(position + i, t) for i, t in enumerate(header)]
    length = max(length, position + len(header) + 1)
    specials.append((length - 1, h["<|return|>"]))
    return _Plan(length, specials, tool_call=False, end_token=h["<|return|>"])


# -- logprobs (return_logprob / top_logprobs_num) ------------------------------------------------------
#: Ranks the sampled id can take in the synthetic ladder (rank 0 = the top alternative).
_MAX_RANK = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 → uint64)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK64


def _uniform(base: int, n: int, column: int, salt: int) -> np.ndarray:
    """A [0, 1) draw per position that depends on (base, position, column, salt) only — never on the output
    length or on how many columns are asked for (so top-5 is a prefix of top-20, a cut output a prefix)."""
    pos = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = np.uint64(base) ^ (np.uint64((column * 1_000_003 + salt * 7919) & 0xFFFFFFFF) << np.uint64(32))
        h = _mix(_mix(pos * np.uint64(0x9E3779B97F4A7C15) + key))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def logprob_arrays(
    input_ids: Sequence[int], sampling_seed: int | None, output_ids: Sequence[int], top_k: int, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`expected_logprobs` as arrays: (sampled logprobs float32 [n], top logprobs float32 [n, top_k],
    top ids int64 [n, top_k])."""
    n = len(output_ids)
    base = int.from_bytes(seed_bytes(input_ids, sampling_seed)[:8], "little")
    width = max(top_k, _MAX_RANK + 1)
    top = 0.4 * np.log1p(-_uniform(base, n, 0, 1))
    ladder = np.empty((n, width), dtype=np.float64)
    ladder[:, 0] = top
    for j in range(1, width):
        ladder[:, j] = 0.05 - np.log1p(-_uniform(base, n, j, 2))
    ladder[:, 1:] = top[:, None] - np.cumsum(ladder[:, 1:], axis=1)
    ladder32 = ladder.astype(np.float32)
    u = _uniform(base, n, 0, 3)
    rank = np.where(u < 0.75, 0, 1 + np.minimum(((u - 0.75) * 16).astype(np.int64), _MAX_RANK - 1))
    chosen = ladder32[np.arange(n), rank]
    out = np.asarray(output_ids, dtype=np.int64).reshape(n)
    step = max(1, min(997, (vocab_size - 1) // (width + 1)))
    offsets = np.empty((n, width), dtype=np.int64)
    for j in range(width):
        offsets[:, j] = 1 + (_uniform(base, n, j, 4) * step).astype(np.int64)
    ids = (out[:, None] + np.cumsum(offsets, axis=1)) % vocab_size
    ids[np.arange(n), rank] = out
    return chosen, ladder32[:, :top_k], ids[:, :top_k]


def expected_logprobs(
    input_ids: Sequence[int],
    sampling_seed: int | None,
    output_ids: Sequence[int],
    top_k: int,
    vocab_size: int,
) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """The logprobs a simulator returns for ``output_ids`` (``return_logprob``): the sampled id's logprob per
    position and, when ``top_k`` > 0, the top-``top_k`` alternatives per position as (logprob, id), best first.

    Synthetic but shaped like a model's: per position a descending ladder of logprobs (the top one
    ``0.4·ln U``, then gaps of ``0.05 + Exp(1)``); the sampled id sits at rank 0 three times in four, else at
    rank 1–4, and its logprob is its rung. The other rungs hold distinct ids near it. Every value is a
    float32 (what the Parquet column stores) and depends on (input ids, seed, position, rank) only, so
    top-5 is a prefix of top-20 and a cut output's logprobs a prefix of the uncut one's.
    """
    chosen, values, ids = logprob_arrays(input_ids, sampling_seed, output_ids, top_k, vocab_size)
    if top_k <= 0:
        return chosen.tolist(), None
    return chosen.tolist(), [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
