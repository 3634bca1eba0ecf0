"""Reasoning-model profiles: what thinkfleet must know about a model family to find reasoning and tool calls.

A profile names, per family, the chat-template kwargs that turn thinking on, the marker *strings* of
reasoning and tool calls, the end-of-turn tokens, and how reasoning is delimited (``scheme``):

- ``think``: reasoning sits between ``think_start`` and ``think_end`` (the prompt may already end with
  ``think_start``); tool calls are ``tool_call_begin`` … ``tool_call_end`` pairs, optionally inside a
  ``tool_section_begin`` … ``tool_section_end`` section (see :mod:`storage.spans`);
- ``harmony`` (gpt-oss): every message is ``[<|start|>role]<|channel|>CHANNEL[ to=RECIPIENT]
  [<|constrain|>TYPE]<|message|>CONTENT`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``; reasoning
  is the ``analysis`` message, the answer the ``final`` message, a tool call a message ended by
  ``<|call|>`` (a ``commentary`` message addressed ``to=functions.NAME``).

**Every marker id comes from the job's tokenizer**, never from this module: :func:`resolve` looks each
marker string up in the tokenizer (``get_vocab``) and checks that encoding the string gives exactly that
one id. The ids in the table below are what the families' *real* tokenizers hold — documentation, the
simulator's vocabulary (it has no tokenizer) and the test tokenizers' layouts, nothing else:

============== ===================================== ================================================================
profile        markers                                ids in the real tokenizer
============== ===================================== ================================================================
``kimi``       ``<think>`` ``</think>``               163606 163607 (K2/K2.5 tokenizer_config.json)
(Kimi K2/K2.5) ``<|tool_calls_section_begin|>``/end   163595 / 163596
               ``<|tool_call_begin|>``/argument/end   163597 / 163598 / 163599
               ``<|im_end|>`` (stop), ``[EOS]``       163586, 163585; vocab 163,840
``qwen3``      ``<think>`` ``</think>``               151667 151668
(Qwen3)        ``<tool_call>`` ``</tool_call>``       151657 151658
               ``<|im_start|>`` ``<|im_end|>`` (stop) 151644 151645; ``<|endoftext|>`` 151643; config vocab 151,936
``deepseek``   ``<think>`` ``</think>``               128798 128799
(DeepSeek-R1,  ``<｜tool▁calls▁begin｜>``/end          128806 / 128807
V3.1)          ``<｜tool▁call▁begin｜>``/end           128808 / 128809; ``<｜tool▁sep｜>`` 128814
               ``<｜end▁of▁sentence｜>`` (stop)       1; ``<｜User｜>`` 128803 ``<｜Assistant｜>`` 128804; vocab 129,280
``glm45``      ``<think>`` ``</think>``               151350 151351
(GLM-4.5)      ``<tool_call>`` ``</tool_call>``       151352 151353 [verify]; ``<arg_key>`` 151356 [verify]
               stops ``<|endoftext|>`` ``<|user|>``   151329 151336; ``<|observation|>`` 151338; ``<|assistant|>``
               ``<|observation|>``                    151337; ``[gMASK]`` 151331 ``<|system|>`` 151335; vocab 151,552
``harmony``    ``<|start|>`` ``<|channel|>``          200006 200005
(gpt-oss,      ``<|message|>`` ``<|end|>``            200008 200007
o200k_harmony) ``<|return|>`` ``<|call|>`` (stops)    200002 200012; ``<|constrain|>`` 200003; ``<|endoftext|>`` 199999
               channel words ``analysis`` ``final``   35644, 17196 (one token each); ``commentary`` = 12606 815
               ``assistant``                          173781; vocab 201,088
============== ===================================== ================================================================

Sources: Kimi — the project's reference notes (§4.1); Qwen3 — ``added_tokens.json`` of the Qwen3 checkpoints
(cross-checked in several public copies); DeepSeek — the V3/R1 ``tokenizer.json`` ids as vendored in
tool-parser tests (DeepSeek-R1-*Distill* checkpoints reuse the strings on Qwen/Llama ids: one more reason
ids are read from the tokenizer); GLM-4.5 — GLM-4's special block 151329–151338 from its tokenizer code
(``[gMASK]`` 151331, ``<|system|>`` … ``<|assistant|>`` 151335–151337 cross-checked in a public GLM-4.5 tokenizer
test), ``<think>``/``</think>`` from a vendored copy, the tool ids from memory (marked [verify]); harmony — the
``o200k_harmony`` special-token table of openai/gpt-oss and published token dumps
(``<|channel|>analysis<|message|>`` = 200005 35644 200008).

Profiles are chosen with ``producer submit --model-family`` (job file ``model_family``) or detected from
the tokenizer (:func:`detect`: the first profile whose ``detect_tokens`` are all in the vocabulary). A
tokenizer that lacks the profile's *required* (reasoning) markers is refused at submit, naming the
missing strings, unless the job runs with ``--no-reasoning-spans`` (null reasoning spans: not recorded; no alarm).

One file because a profile is a row of one table: a new family is written by reading its neighbours' markers,
template kwargs and scheme side by side, and :func:`resolve` checks every row against the tokenizer the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from thinkfleet.tokens import SpanTokens

#: Job-record fields of the think-scheme markers, in :class:`thinkfleet.state.job.JobRecord` order.
MARKER_ROLES: tuple[str, ...] = (
    "think_start_id",
    "think_end_id",
    "tool_section_begin_id",
    "tool_section_end_id",
    "tool_call_begin_id",
    "tool_call_argument_begin_id",
    "tool_call_end_id",
)
#: Roles of the tool-call markers (optional: a tokenizer without them is warned about, not refused).
TOOL_ROLES: tuple[str, ...] = MARKER_ROLES[2:]
#: Whitespace a chat template may write after ``think_start`` at the end of the generation prompt
#: (Qwen3-Thinking-2507 and DeepSeek-R1-0528 end it with ``<think>\n``). :func:`resolve` records the id of each
#: that encodes to one token next to the markers, so spans know such a prompt opens reasoning
#: (``SpanTokens.prompt_trailing_ids``, :func:`storage.spans.prompt_opens_reasoning`).
PROMPT_TRAILING_TEXTS: tuple[str, ...] = ("\n", "\n\n")


class ProfileError(Exception):
    """The tokenizer does not fit the model profile (or no profile fits it); the message says the fix."""


@dataclass(frozen=True)
class HarmonyMarkers:
    """The harmony format's control tokens and channel names (strings; ids come from the tokenizer)."""

    start: str = "<|start|>"
    channel: str = "<|channel|>"
    message: str = "<|message|>"
    end: str = "<|end|>"
    return_: str = "<|return|>"
    call: str = "<|call|>"
    constrain: str = "<|constrain|>"
    analysis: str = "analysis"
    final: str = "final"
    commentary: str = "commentary"

    @property
    def control(self) -> tuple[str, ...]:
        return (self.start, self.channel, self.message, self.end, self.return_, self.call, self.constrain)

    @property
    def channels(self) -> tuple[str, ...]:
        return (self.analysis, self.final, self.commentary)


@dataclass(frozen=True)
class ModelProfile:
    """One model family's reasoning and tool-call conventions (marker *strings*; see the module docstring)."""

    family: str
    title: str
    #: ``think`` (marker-delimited reasoning) or ``harmony`` (channel-delimited), or ``none``.
    scheme: str
    #: Chat-template kwargs that turn thinking on; ``--chat-template-kwargs`` is merged over them.
    thinking_kwargs: Mapping[str, Any]
    #: All present in a tokenizer's vocabulary → this family (checked in :data:`DETECTION_ORDER`).
    detect_tokens: tuple[str, ...]
    #: Job-record marker role → token string (None: the family has no such marker).
    markers: Mapping[str, str | None]
    #: End-of-turn / stop token strings (added to the tokenizer's and generation_config's EOS ids).
    stop_tokens: tuple[str, ...]
    #: The chat template's generation prompt ends with ``think_start`` in thinking mode (Kimi-K2.5,
    #: DeepSeek-V3.1; ``<think>\n`` in DeepSeek-R1-0528 and Qwen3-Thinking-2507); otherwise the model opens
    #: reasoning itself (Qwen3, GLM-4.5). Documentation: rows decide per prompt from its ids.
    prompt_opens_reasoning: bool = False
    harmony: HarmonyMarkers | None = None
    #: What the real tokenizer holds (documentation, simulator, test tokenizers; never the pipeline).
    reference_ids: Mapping[str, int] = field(default_factory=dict)
    reference_vocab_size: int | None = None

    @property
    def model_opens_reasoning(self) -> bool:
        """In thinking mode the model itself opens reasoning (Qwen3's and GLM-4.5's ``<think>``, gpt-oss's
        analysis message): the prompt says nothing, so only the job's kwargs tell that rows should reason."""
        return self.scheme != "none" and not self.prompt_opens_reasoning

    def thinking_on(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        """The job's template kwargs leave thinking on: none of the profile's thinking kwargs is ``false``
        (an absent one is the template's default, on — the rule ``producer submit`` warns by)."""
        return all(chat_template_kwargs.get(k, True) is not False for k in self.thinking_kwargs)

    @property
    def required_tokens(self) -> tuple[str, ...]:
        """Marker strings reasoning spans cannot be found without (refused at submit when missing)."""
        if self.scheme == "harmony":
            assert self.harmony is not None
            h = self.harmony
            return (h.start, h.channel, h.message, h.end, h.return_, h.call)
        return tuple(t for role in ("think_start_id", "think_end_id") if (t := self.markers.get(role)) is not None)

    @property
    def tool_tokens(self) -> tuple[str, ...]:
        """Tool-call marker strings (a tokenizer without them gets no tool-call spans, and a warning)."""
        return tuple(t for role in TOOL_ROLES if (t := self.markers.get(role)) is not None)

    @property
    def all_tokens(self) -> tuple[str, ...]:
        """Every special string the profile names (what :func:`resolve` looks up)."""
        names: list[str] = [t for t in self.markers.values() if t is not None]
        names += list(self.stop_tokens)
        if self.harmony is not None:
            names += list(self.harmony.control)
        return tuple(dict.fromkeys(names))


KIMI = ModelProfile(
    family="kimi",
    title="Kimi K2 / K2.5",
    scheme="think",
    thinking_kwargs={"thinking": True},
    detect_tokens=("<|im_assistant|>", "<|im_middle|>"),
    markers={
        "think_start_id": "<think>",
        "think_end_id": "</think>",
        "tool_section_begin_id": "<|tool_calls_section_begin|>",
        "tool_section_end_id": "<|tool_calls_section_end|>",
        "tool_call_begin_id": "<|tool_call_begin|>",
        "tool_call_argument_begin_id": "<|tool_call_argument_begin|>",
        "tool_call_end_id": "<|tool_call_end|>",
    },
    stop_tokens=("<|im_end|>",),
    prompt_opens_reasoning=True,
    reference_ids={
        "<think>": 163606,
        "</think>": 163607,
        "<|tool_calls_section_begin|>": 163595,
        "<|tool_calls_section_end|>": 163596,
        "<|tool_call_begin|>": 163597,
        "<|tool_call_argument_begin|>": 163598,
        "<|tool_call_end|>": 163599,
        "<|im_end|>": 163586,
        "[EOS]": 163585,
        "<|im_assistant|>": 163588,
        "<|im_middle|>": 163601,
    },
    reference_vocab_size=163_840,
)

QWEN3 = ModelProfile(
    family="qwen3",
    title="Qwen3",
    scheme="think",
    thinking_kwargs={"enable_thinking": True},
    detect_tokens=("<|im_start|>", "<|im_end|>"),
    markers={
        "think_start_id": "<think>",
        "think_end_id": "</think>",
        "tool_section_begin_id": None,
        "tool_section_end_id": None,
        "tool_call_begin_id": "<tool_call>",
        "tool_call_argument_begin_id": None,
        "tool_call_end_id": "</tool_call>",
    },
    stop_tokens=("<|im_end|>",),
    prompt_opens_reasoning=False,
    reference_ids={
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
        "<think>": 151667,
        "</think>": 151668,
    },
    reference_vocab_size=151_936,
)

DEEPSEEK = ModelProfile(
    family="deepseek",
    title="DeepSeek-R1 / V3.1",
    scheme="think",
    thinking_kwargs={"thinking": True},
    detect_tokens=("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    markers={
        "think_start_id": "<think>",
        "think_end_id": "</think>",
        "tool_section_begin_id": "<｜tool▁calls▁begin｜>",
        "tool_section_end_id": "<｜tool▁calls▁end｜>",
        "tool_call_begin_id": "<｜tool▁call▁begin｜>",
        "tool_call_argument_begin_id": "<｜tool▁sep｜>",
        "tool_call_end_id": "<｜tool▁call▁end｜>",
    },
    stop_tokens=("<｜end▁of▁sentence｜>",),
    prompt_opens_reasoning=True,
    reference_ids={
        "<｜end▁of▁sentence｜>": 1,
        "<think>": 128798,
        "</think>": 128799,
        "<｜User｜>": 128803,
        "<｜Assistant｜>": 128804,
        "<｜tool▁calls▁begin｜>": 128806,
        "<｜tool▁calls▁end｜>": 128807,
        "<｜tool▁call▁begin｜>": 128808,
        "<｜tool▁call▁end｜>": 128809,
        "<｜tool▁sep｜>": 128814,
    },
    reference_vocab_size=129_280,
)

GLM45 = ModelProfile(
    family="glm45",
    title="GLM-4.5",
    scheme="think",
    thinking_kwargs={"enable_thinking": True},
    detect_tokens=("<|assistant|>", "<|observation|>"),
    markers={
        "think_start_id": "<think>",
        "think_end_id": "</think>",
        "tool_section_begin_id": None,
        "tool_section_end_id": None,
        "tool_call_begin_id": "<tool_call>",
        "tool_call_argument_begin_id": "<arg_key>",
        "tool_call_end_id": "</tool_call>",
    },
    stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
    prompt_opens_reasoning=False,
    reference_ids={
        "<|endoftext|>": 151329,
        "<|user|>": 151336,
        "<|assistant|>": 151337,
        "<|observation|>": 151338,
        "<think>": 151350,
        "</think>": 151351,
        "<tool_call>": 151352,
        "</tool_call>": 151353,
        "<arg_key>": 151356,
    },
    reference_vocab_size=151_552,
)

_HARMONY = HarmonyMarkers()
HARMONY = ModelProfile(
    family="harmony",
    title="gpt-oss (harmony)",
    scheme="harmony",
    # gpt-oss always reasons; the template's switch is the effort (its own default is "medium").
    thinking_kwargs={"reasoning_effort": "medium"},
    detect_tokens=("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"),
    # The think-scheme roles as harmony fills them, so generic readers (verify's row checks, exports)
    # see the right ids: reasoning is closed by <|end|>, a call starts at its message's <|channel|>, its
    # arguments follow <|message|> and it ends with <|call|>.
    markers={
        "think_start_id": None,
        "think_end_id": _HARMONY.end,
        "tool_section_begin_id": None,
        "tool_section_end_id": None,
        "tool_call_begin_id": _HARMONY.channel,
        "tool_call_argument_begin_id": _HARMONY.message,
        "tool_call_end_id": _HARMONY.call,
    },
    stop_tokens=(_HARMONY.return_, _HARMONY.call),
    harmony=_HARMONY,
    reference_ids={
        "<|endoftext|>": 199999,
        "<|return|>": 200002,
        "<|constrain|>": 200003,
        "<|channel|>": 200005,
        "<|start|>": 200006,
        "<|end|>": 200007,
        "<|message|>": 200008,
        "<|call|>": 200012,
        "analysis": 35644,
        "final": 17196,
        "assistant": 173781,
    },
    reference_vocab_size=201_088,
)

#: No reasoning markers at all: only with ``--no-reasoning-spans`` (a model thinkfleet has no profile for).
NONE = ModelProfile(
    family="none",
    title="no reasoning markers",
    scheme="none",
    thinking_kwargs={},
    detect_tokens=(),
    markers=dict.fromkeys(MARKER_ROLES),
    stop_tokens=(),
)

PROFILES: dict[str, ModelProfile] = {p.family: p for p in (KIMI, QWEN3, DEEPSEEK, GLM45, HARMONY, NONE)}
#: ``--model-family`` choices.
FAMILIES: tuple[str, ...] = tuple(PROFILES)
#: Detection order: the most specific token sets first (Kimi also has ``<|im_end|>``, GLM ``<tool_call>``).
DETECTION_ORDER: tuple[str, ...] = ("harmony", "kimi", "deepseek", "glm45", "qwen3")
#: Family of a job record written before profiles existed (those were Kimi jobs).
LEGACY_FAMILY = "kimi"


def expects_reasoning(family: str, chat_template_kwargs: Mapping[str, Any], reasoning_spans: bool = True) -> bool:
    """Every row of the job is expected to reason whatever its prompt: its family's model opens reasoning itself
    and the job's kwargs leave thinking on (a Qwen3 or GLM-4.5 job with ``enable_thinking``, every gpt-oss job).
    With the rows whose prompt opens reasoning (:func:`storage.spans.prompt_opens_reasoning`), these are the rows
    the reasoning alarm counts: a thinking job whose outputs never close reasoning is the loss it exists to catch."""
    profile = PROFILES.get(family)
    if profile is None or not reasoning_spans:
        return False
    return profile.model_opens_reasoning and profile.thinking_on(chat_template_kwargs)


def get_profile(family: str) -> ModelProfile:
    """The profile of ``family``; :class:`ProfileError` naming the choices for an unknown one."""
    try:
        return PROFILES[family]
    except KeyError:
        raise ProfileError(f"unknown model family {family!r}: use one of {', '.join(FAMILIES)}") from None


def detect(vocab: Mapping[str, int]) -> ModelProfile | None:
    """The first profile (in :data:`DETECTION_ORDER`) whose ``detect_tokens`` are all in ``vocab``."""
    for family in DETECTION_ORDER:
        profile = PROFILES[family]
        if all(t in vocab for t in profile.detect_tokens):
            return profile
    return None


@dataclass(frozen=True)
class Resolution:
    """A profile applied to one tokenizer: every id below was read from it (and checked)."""

    profile: ModelProfile
    detected: bool  # True: from the tokenizer; False: ``--model-family``
    reasoning_spans: bool
    #: Every profile string the tokenizer has, → its id (stored in the job record as ``markers``).
    token_ids: dict[str, int]
    #: Job-record marker role → id (None: no such marker, or reasoning spans off).
    marker_ids: dict[str, int | None]
    #: Harmony channel name → its ids (``encode(name)``), else {}.
    channel_ids: dict[str, list[int]]
    #: Stop ids the profile adds (its end-of-turn tokens present in the tokenizer).
    stop_ids: list[int]
    #: Tool-call marker strings the profile names but the tokenizer lacks (→ no tool-call spans).
    missing_tool_tokens: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return self.profile.family


def _encode(tok: Any, text: str) -> list[int] | None:
    """``text``'s ids as the producer tokenizes rendered prompts (``tok(text, add_special_tokens=False)``)."""
    try:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    except Exception:
        try:
            ids = tok.encode(text, add_special_tokens=False)
        except Exception:  # a tokenizer that cannot encode a bare string: the vocabulary lookup stands
            return None
    return [int(i) for i in ids]


def token_ids(tok: Any, strings: Sequence[str]) -> tuple[dict[str, int], list[str]]:
    """``{string: id}`` for the strings the tokenizer has as one token, and problems with the others.

    A string counts only if it is in the vocabulary *and* encoding it gives exactly that id: a
    ``<think>`` that is not an added token would be split into ``<``, ``think``, ``>`` in rendered
    prompts and model output, so its vocabulary id would never be seen.
    """
    vocab = tok.get_vocab()
    found: dict[str, int] = {}
    problems: list[str] = []
    for text in strings:
        if text not in vocab:
            continue
        token_id = int(vocab[text])
        encoded = _encode(tok, text)
        if encoded is not None and encoded != [token_id]:
            problems.append(f"{text!r} is in the vocabulary (id {token_id}) but encodes to {encoded}: not one token")
            continue
        found[text] = token_id
    return found, problems


def resolve(
    tok: Any,
    family: str | None = None,
    reasoning_spans: bool = True,
    source: str = "the tokenizer",
    given_ids: Mapping[str, int] | None = None,
) -> Resolution:
    """The profile of ``tok`` (``family`` or detected) with every marker id read from ``tok``.

    ``given_ids`` (role → id: ``--think-start-id``/``--think-end-id``) are the user's own and stand in
    for the tokenizer's. Raises :class:`ProfileError` naming the missing token strings when reasoning
    spans are on and the tokenizer lacks a required marker, or when no profile can be detected.
    """
    given = {role: int(v) for role, v in (given_ids or {}).items() if v is not None}
    vocab = tok.get_vocab()
    detected = family is None
    if family is None:
        profile = detect(vocab)
        if profile is None:
            if not reasoning_spans:
                profile = NONE
            else:
                wanted = "; ".join(f"{f}: {' '.join(PROFILES[f].detect_tokens)}" for f in DETECTION_ORDER)
                raise ProfileError(
                    f"cannot tell the model family of {source}: it has none of the families' tokens ({wanted})\n"
                    f"  → pass --model-family ({', '.join(FAMILIES)}), or --no-reasoning-spans to run without "
                    "reasoning spans (null reasoning spans, no reasoning alarm)"
                )
    else:
        profile = get_profile(family)
    if profile.scheme == "none":
        reasoning_spans = False

    found, problems = token_ids(tok, profile.all_tokens)
    covered = {profile.markers.get(role) for role in given}
    missing = [t for t in profile.required_tokens if t not in found and t not in covered]
    if missing and reasoning_spans:
        how = "detected from its tokens" if detected else "--model-family"
        detail = "".join(f"\n  · {p}" for p in problems)
        raise ProfileError(
            f"{source} has no {', '.join(repr(t) for t in missing)} token"
            f"{'s' if len(missing) > 1 else ''}, which the {profile.family} profile ({profile.title}; {how}) "
            f"needs to find reasoning{detail}\n"
            "  → use the served model's own tokenizer, pick another --model-family, or pass "
            "--no-reasoning-spans to run without reasoning spans (null reasoning spans, reasoning alarm off)"
        )

    marker_ids: dict[str, int | None] = {}
    for role in MARKER_ROLES:
        text = profile.markers.get(role)
        marker_ids[role] = found.get(text) if text is not None else None
    if profile.scheme == "think":
        marker_ids.update({role: v for role, v in given.items() if role in marker_ids})
    warnings: list[str] = list(problems)
    missing_tools = tuple(t for t in profile.tool_tokens if t not in found)
    channel_ids: dict[str, list[int]] = {}
    if not reasoning_spans:
        # Reasoning spans off: no reasoning marker is recorded, and harmony's roles (reasoning closed by
        # <|end|>, calls opened by <|channel|>) mean nothing outside its own span scheme.
        marker_ids["think_start_id"] = marker_ids["think_end_id"] = None
        if profile.scheme == "harmony":
            marker_ids = dict.fromkeys(MARKER_ROLES)
        warnings.append(
            f"reasoning spans are off ({'--no-reasoning-spans' if profile.scheme != 'none' else 'no profile'}): "
            "rows get null (not recorded) reasoning and answer spans, and the reasoning alarm is disabled "
            "for this job"
        )
    elif missing_tools:
        warnings.append(
            f"the tokenizer has no {', '.join(repr(t) for t in missing_tools)} ({profile.family} tool-call "
            "markers): rows will carry no tool-call spans"
        )
    if profile.harmony is not None and reasoning_spans:
        for name in profile.harmony.channels:
            ids = _encode(tok, name)
            if not ids:
                raise ProfileError(f"{source} cannot encode the harmony channel name {name!r}")
            channel_ids[name] = ids
    stop_ids = [found[t] for t in profile.stop_tokens if t in found]
    if marker_ids["think_start_id"] is not None:
        for text in PROMPT_TRAILING_TEXTS:
            ids = _encode(tok, text)
            if ids is not None and len(ids) == 1:
                found[text] = ids[0]
    return Resolution(
        profile=profile,
        detected=detected,
        reasoning_spans=reasoning_spans,
        token_ids=found,
        marker_ids=marker_ids,
        channel_ids=channel_ids,
        stop_ids=stop_ids,
        missing_tool_tokens=missing_tools,
        warnings=tuple(warnings),
    )


def span_tokens(
    family: str,
    marker_ids: Mapping[str, int | None],
    stop_token_ids: Sequence[int],
    *,
    reasoning_spans: bool = True,
    token_ids: Mapping[str, int] | None = None,
    channel_ids: Mapping[str, Sequence[int]] | None = None,
) -> SpanTokens:
    """The :class:`SpanTokens` of a job: its family's scheme with the ids its record holds.

    ``marker_ids``: the job record's marker fields (role → id); ``token_ids``/``channel_ids``: its
    ``markers``/``channel_ids`` (harmony reads ``<|start|>``, ``<|message|>``, ``<|return|>`` and the
    channel names from them). With reasoning spans off the think markers are None whatever the record
    says, and harmony falls back to the plain scheme with no markers.
    """
    profile = PROFILES.get(family)
    roles = {role: marker_ids.get(role) for role in MARKER_ROLES}
    if not reasoning_spans:
        roles["think_start_id"] = roles["think_end_id"] = None
    harmony = profile is not None and profile.scheme == "harmony"
    if harmony and not reasoning_spans:
        roles = dict.fromkeys(MARKER_ROLES)
    found = token_ids or {}
    base = SpanTokens(
        think_start_id=roles["think_start_id"],
        think_end_id=roles["think_end_id"],
        tool_section_begin_id=roles["tool_section_begin_id"],
        tool_section_end_id=roles["tool_section_end_id"],
        tool_call_begin_id=roles["tool_call_begin_id"],
        tool_call_end_id=roles["tool_call_end_id"],
        stop_token_ids=tuple(int(t) for t in stop_token_ids),
        reasoning_spans=reasoning_spans,
        prompt_trailing_ids=tuple(int(found[t]) for t in PROMPT_TRAILING_TEXTS if t in found),
    )
    if not (harmony and reasoning_spans):
        return base
    assert profile is not None and profile.harmony is not None
    h = profile.harmony
    channels = channel_ids or {}
    return replace(
        base,
        scheme="harmony",
        message_start_id=found.get(h.start),
        message_id=found.get(h.message),
        return_id=found.get(h.return_),
        analysis_channel=tuple(int(i) for i in channels.get(h.analysis, ())),
        final_channel=tuple(int(i) for i in channels.get(h.final, ())),
    )


# -- tool-call text: a hook for exports ------------------------------------------------------------------
_HARMONY_RECIPIENT = re.compile(r"to=(?:functions\.)?(?P<name>[^\s<]+)")
_KIMI_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+?)(?::(?P<idx>\d+))?\s*$")
_GLM_ARG = re.compile(r"(?:<arg_key>)?(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S)


def parse_tool_call(family: str, header: str, arguments: str) -> tuple[str, str]:
    """(function name, arguments text) of one tool call, from the text on either side of its
    ``tool_call_argument_begin`` marker (decoded with special tokens kept).

    For exports: ``storage/conversations.py`` splits a call span at the job's argument-begin id; this
    reads each family's header: Kimi ``functions.NAME:IDX``; DeepSeek-V3.1 ``NAME`` and R1/V3
    ``function`` + ``NAME\\n```json\\n{…}\\n```" (the name leads the arguments); GLM-4.5 ``NAME`` with
    ``<arg_key>k</arg_key><arg_value>v</arg_value>`` pairs (→ a JSON object); harmony
    ``commentary to=functions.NAME <|constrain|>json``. Arguments stay as emitted otherwise.
    """
    header = header.strip()
    if family == "harmony":
        match = _HARMONY_RECIPIENT.search(header)
        return (match.group("name") if match else header), arguments
    if family == "deepseek":
        if header == "function":  # R1 / V3: the name, then a ```json fenced block
            name, _, rest = arguments.partition("\n")
            body = rest.strip()
            if body.startswith("```"):
                body = body.split("\n", 1)[1] if "\n" in body else ""
                body = body.rsplit("```", 1)[0].strip()
            return name.strip(), body
        return header, arguments
    if family == "glm45":
        pairs = {m.group("key").strip(): m.group("value") for m in _GLM_ARG.finditer("<arg_key>" + arguments)}
        values: dict[str, Any] = {}
        for key, value in pairs.items():
            try:
                values[key] = json.loads(value)
            except ValueError:
                values[key] = value
        return header, json.dumps(values, ensure_ascii=False) if pairs else arguments
    match = _KIMI_CALL_ID.match(header)
    return (match.group("name") if match else header), arguments
