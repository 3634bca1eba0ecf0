"""The generated assistant turn as a chat message, decoded from ``output_ids`` by its stored spans.

Used by ``producer export --format messages|conversations``. The conversation before the turn is the
SOURCE conversation the producer rendered (kept in the submit manifest, :mod:`storage.manifest`), not
a re-parse of the prompt ids, so this works for any model family. The generated turn is cut by the
row's span columns — never by parsing text — and each piece is decoded on its own:

- ``reasoning_content`` = ``output_ids[reasoning_start:reasoning_end]`` (markers excluded),
- ``content`` = ``output_ids[answer_start:answer_end]``,
- ``tool_calls``: one per ``tool_call_spans`` entry, its markers taken from the job record
  (``tool_call_begin_id``/``tool_call_argument_begin_id``/``tool_call_end_id``, :class:`ToolMarkers`).
  With an argument-begin marker the call is split there and the family's header is read by
  ``thinkfleet.profiles.parse_tool_call`` (Kimi ``functions.NAME:IDX``, DeepSeek, GLM-4.5, harmony
  ``commentary to=functions.NAME``); Kimi's header is also the call's ``id``, other families get
  ``call_N``. Without one (Qwen's ``<tool_call>{"name": …, "arguments": …}</tool_call>``) the body is read
  as a JSON object with ``name`` and ``arguments``/``parameters``.

Arguments are text (OpenAI's convention): as the model emitted them when they follow an argument marker,
even when they are not valid JSON; re-serialized from the JSON object otherwise. Ids outside the spans (a
stop token, the tool-section markers) are in no field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from thinkfleet.state.job import JobRecord

try:  # the per-family header readers (thinkfleet/profiles.py); Kimi's rule alone without them
    from thinkfleet.profiles import parse_tool_call as _parse_family_call
except ImportError:  # pragma: no cover - a tree without model profiles
    _parse_family_call = None


class Decoder(Protocol):
    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class ToolMarkers:
    """The tool-call marker ids of a job (None: the tokenizer has no such token)."""

    begin_id: int | None = None
    argument_begin_id: int | None = None
    end_id: int | None = None
    family: str = "kimi"  # the job's model family (a record from before profiles: Kimi)

    @classmethod
    def of(cls, record: JobRecord) -> ToolMarkers:
        tokens = record.span_tokens()
        family = str(getattr(record, "model_family", "") or "kimi")
        return cls(tokens.tool_call_begin_id, record.tool_call_argument_begin_id, tokens.tool_call_end_id, family)


_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+?)(?::(?P<idx>\d+))?\s*$")


def decode(tok: Decoder, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def output_message(
    tok: Decoder,
    output_ids: Sequence[int],
    reasoning: tuple[int, int],
    answer: tuple[int, int],
    tool_calls: Sequence[tuple[int, int]],
    markers: ToolMarkers,
    include_reasoning: bool = True,
) -> dict[str, Any]:
    """``{"role": "assistant", "reasoning_content", "content", "tool_calls"}``, cut by the stored spans."""
    ids = list(output_ids)
    message: dict[str, Any] = {"role": "assistant"}
    if include_reasoning:
        message["reasoning_content"] = decode(tok, ids[reasoning[0] : reasoning[1]])
    message["content"] = decode(tok, ids[answer[0] : answer[1]])
    calls = [tool_call(tok, ids[s:e], markers, i) for i, (s, e) in enumerate(tool_calls)]
    if calls:
        message["tool_calls"] = calls
    return message


def tool_call(tok: Decoder, ids: Sequence[int], markers: ToolMarkers, index: int = 0) -> dict[str, Any]:
    """One tool-call span (its markers included) → an OpenAI ``tool_calls`` entry."""
    body = list(ids)
    if body and markers.begin_id is not None and body[0] == markers.begin_id:
        body = body[1:]
    if body and markers.end_id is not None and body[-1] == markers.end_id:
        body = body[:-1]
    if markers.argument_begin_id is not None and markers.argument_begin_id in body:
        split = body.index(markers.argument_begin_id)
        header, arguments = decode(tok, body[:split]), decode(tok, body[split + 1 :])
        if _parse_family_call is not None:
            name, arguments = _parse_family_call(markers.family, header, arguments)
        else:
            match = _CALL_ID.match(header)
            name = match.group("name") if match else header.strip()
        call_id = header.strip() if markers.family == "kimi" else f"call_{index}"
    else:
        call_id = f"call_{index}"
        name, arguments = _json_call(decode(tok, body))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_call(text: str) -> tuple[str, str]:
    """``{"name": …, "arguments"|"parameters": …}`` → (name, arguments as text); else ("", the text)."""
    try:
        value = json.loads(text)
    except ValueError:
        return "", text
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "", text
    args = value.get("arguments", value.get("parameters", {}))
    return value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
