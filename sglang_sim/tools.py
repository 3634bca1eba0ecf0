"""Decodable tool calls for the simulator: a *tool catalogue* of calls pre-tokenized in a family's native form.

The simulator has no tokenizer, so without a catalogue the ids inside a tool call are filler: the markers are
real (spans, parsers and chaining see a call), but the name and arguments decode to noise. An agentic job
(``tool_results: replay|executor``) matches calls by function name and feeds back results, so it needs calls a
tokenizer decodes to a real name and JSON arguments. :func:`build_catalogue` encodes a few tools with the job's
tokenizer, once, into a JSON file; ``sglang-sim --tool-catalogue FILE`` (``ContentConfig.tool_catalogue``) then
draws each call from it (which tool, by the output's own RNG: still a pure function of the prompt and seed).

What one call's body is (the ids between the family's call-begin and call-end markers, both excluded):

- ``kimi``: ``functions.NAME:IDX`` ``<|tool_call_argument_begin|>`` ``ARGS`` (IDX: the call's index in its turn);
- ``qwen3``: ``\\n{"name": NAME, "arguments": ARGS}\\n`` (Qwen3's call is a JSON object, no argument marker);
- ``deepseek``: ``function`` ``<｜tool▁sep｜>`` ``NAME\\n```json\\nARGS\\n``` `` (R1-0528's form);
- ``glm45``: ``NAME\\n`` then per argument ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n``;
- ``harmony`` (gpt-oss): ``commentary to=functions.NAME <|constrain|>json<|message|>ARGS`` (between the call's
  ``<|channel|>`` and ``<|call|>``; one call per message, so the index is not in it).

The body is the text encoded with the job's tokenizer, its markers included (they are added tokens: the tokenizer
gives their ids), so it is what the family's template renders and its parser reads.

``python -m sglang_sim.tool_catalogue --tokenizer DIR --family kimi --out FILE`` writes one from the command line.

A *malformed* call (``ContentConfig.malformed_tool_call_share``) has its arguments cut in half: not JSON, as a
model that loses its way mid-call emits. A call cut by ``max_new_tokens`` needs nothing here (the output is a
prefix of the uncut one).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Families whose calls a catalogue can hold (the others' calls stay filler between real markers).
CATALOGUE_FAMILIES = ("kimi", "qwen3", "deepseek", "glm45", "harmony")
#: Calls per turn a catalogue is built for (Kimi's header carries the index).
MAX_CALLS_PER_TURN = 8

#: The demo's and tests' tools: a calculator and a lookup over a local file (docs/examples/agentic/).
DEFAULT_TOOLS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("calculator", {"expression": "240 / 80"}),
    ("lookup", {"key": "bridge"}),
    ("calculator", {"expression": "100 * 101 / 2"}),
)


@dataclass(frozen=True)
class ToolCatalogue:
    """Per tool variant: its name, its arguments and its bodies (well-formed and malformed) per call index."""

    family: str
    names: tuple[str, ...]
    arguments: tuple[str, ...]
    bodies: tuple[tuple[tuple[int, ...], ...], ...]  # [variant][call index] → ids
    malformed: tuple[tuple[tuple[int, ...], ...], ...]

    def draw(self, rng: np.random.Generator, index: int, malformed_share: float) -> list[int]:
        """One call's body: a variant drawn by ``rng``, malformed with probability ``malformed_share``."""
        variant = int(rng.integers(len(self.names)))
        broken = rng.random() < malformed_share
        table = self.malformed if broken else self.bodies
        return list(table[variant][min(index, MAX_CALLS_PER_TURN - 1)])


def call_body_text(family: str, name: str, arguments: str, index: int) -> str:
    """One call's body text (between the family's call-begin and call-end markers), markers inside it included."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:  # malformed: the cut arguments as text
        args = None
    if family == "kimi":
        return f"functions.{name}:{index}<|tool_call_argument_begin|>{arguments}"
    if family == "qwen3":
        if args is None:  # the object left unclosed
            return '\n{"name": "' + name + '", "arguments": ' + arguments + "\n"
        return "\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n"
    if family == "deepseek":
        return f"function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
    if family == "glm45":
        if not isinstance(args, dict):  # malformed: a key without its value
            return f"{name}\n<arg_key>{arguments}</arg_key>\n"
        pairs = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
            for k, v in args.items()
        )
        return f"{name}\n{pairs}"
    if family == "harmony":  # the recipient in the channel header, the arguments after <|message|>
        return f"commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"
    raise ValueError(f"a tool catalogue holds calls of {', '.join(CATALOGUE_FAMILIES)}, not {family!r}")


def build_catalogue(
    tok: Any, family: str, tools: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_TOOLS
) -> dict[str, Any]:
    """The catalogue of ``tools`` (name, arguments) encoded with ``tok`` (the job's tokenizer), as JSON data."""
    if family not in CATALOGUE_FAMILIES:
        raise ValueError(f"a tool catalogue holds calls of {', '.join(CATALOGUE_FAMILIES)}, not {family!r}")

    def body(name: str, arguments: str, index: int) -> list[int]:
        return list(tok(call_body_text(family, name, arguments, index), add_special_tokens=False)["input_ids"])

    entries = []
    for name, args in tools:
        text = json.dumps(args, ensure_ascii=False)
        cut = text[: max(1, len(text) // 2)]
        entries.append(
            {
                "name": name,
                "arguments": text,
                "bodies": [body(name, text, i) for i in range(MAX_CALLS_PER_TURN)],
                "malformed": [body(name, cut, i) for i in range(MAX_CALLS_PER_TURN)],
            }
        )
    return {"family": family, "tools": entries}


def write_catalogue(
    path: str | Path, tok: Any, family: str, tools: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_TOOLS
) -> Path:
    """:func:`build_catalogue` written to ``path`` (what ``sglang-sim --tool-catalogue`` reads)."""
    out = Path(path)
    out.write_text(json.dumps(build_catalogue(tok, family, tools)))
    return out


@functools.lru_cache(maxsize=8)
def load_catalogue(path: str) -> ToolCatalogue:
    """The catalogue at ``path`` (cached: every generation of a server reads the same one)."""
    data = json.loads(Path(path).read_text())
    tools = data.get("tools") or []
    if not tools:
        raise ValueError(f"tool catalogue {path}: no tools")

    def table(key: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return tuple(tuple(tuple(int(t) for t in ids) for ids in entry[key]) for entry in tools)

    return ToolCatalogue(
        str(data.get("family") or "kimi"),
        tuple(str(e["name"]) for e in tools),
        tuple(str(e["arguments"]) for e in tools),
        table("bodies"),
        table("malformed"),
    )
