"""Token ids → chat messages with text, for tools that need text (SpecForge's conversations format).

The prompt is split on Kimi's role tokens (``<|im_system|>``/``<|im_user|>``/``<|im_assistant|>``
name ``<|im_middle|>`` content ``<|im_end|>``, reference §4.2); the output is cut by its stored spans
into ``reasoning_content``, ``content`` and ``tool_calls``. Each piece is decoded on its own, so the
reasoning text comes straight from the reasoning ids — never from a chat-template re-render, which
for Kimi drops the last assistant turn's reasoning (reference §5.2).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from thinkfleet import kimi


class Decoder(Protocol):
    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


_HEADERS = {kimi.IM_SYSTEM: "system", kimi.IM_USER: "user", kimi.IM_ASSISTANT: "assistant"}
_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+?)(?::(?P<idx>\d+))?\s*$")


def decode(tok: Decoder, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def prompt_messages(tok: Decoder, input_ids: Sequence[int]) -> tuple[list[dict[str, Any]], str | None]:
    """The prompt's messages, and the tool declaration text if the prompt declares tools.

    The trailing generation prompt (``<|im_assistant|>assistant<|im_middle|><think>``, no
    ``<|im_end|>``) is not a message and is dropped.
    """
    messages: list[dict[str, Any]] = []
    tools: str | None = None
    ids = list(input_ids)
    i = 0
    while i < len(ids):
        header = _HEADERS.get(ids[i])
        if header is None:
            i += 1
            continue
        try:
            middle = ids.index(kimi.IM_MIDDLE, i + 1)
            end = ids.index(kimi.IM_END, middle + 1)
        except ValueError:
            break  # the open generation prompt
        name = decode(tok, ids[i + 1 : middle]).strip()
        body = ids[middle + 1 : end]
        i = end + 1
        if header == "system" and name == "tool_declare":
            tools = decode(tok, body)
            continue
        role = header if header != "system" or name == "system" else "tool"
        message = _assistant_message(tok, body) if role == "assistant" else {"content": decode(tok, body)}
        messages.append({"role": role, **message} if role != "tool" else {"role": role, "name": name, **message})
    return messages, tools


def output_message(
    tok: Decoder,
    output_ids: Sequence[int],
    reasoning: tuple[int, int],
    answer: tuple[int, int],
    tool_calls: Sequence[tuple[int, int]],
    include_reasoning: bool = True,
) -> dict[str, Any]:
    """The generated assistant message, cut by the stored spans."""
    ids = list(output_ids)
    message: dict[str, Any] = {"role": "assistant", "content": decode(tok, ids[answer[0] : answer[1]])}
    if include_reasoning:
        message["reasoning_content"] = decode(tok, ids[reasoning[0] : reasoning[1]])
    calls = [_tool_call(tok, ids[s:e]) for s, e in tool_calls]
    if calls:
        message["tool_calls"] = calls
    return message


def _assistant_message(tok: Decoder, body: list[int]) -> dict[str, Any]:
    """A history assistant turn: ``<think>…</think>content`` plus an optional tool-call section."""
    message: dict[str, Any] = {}
    if kimi.THINK_START in body and kimi.THINK_END in body:
        start, end = body.index(kimi.THINK_START), body.index(kimi.THINK_END)
        message["reasoning_content"] = decode(tok, body[start + 1 : end])
        body = body[end + 1 :]
    section = body.index(kimi.TOOL_CALLS_SECTION_BEGIN) if kimi.TOOL_CALLS_SECTION_BEGIN in body else len(body)
    message["content"] = decode(tok, body[:section])
    calls: list[dict[str, Any]] = []
    rest = body[section:]
    while kimi.TOOL_CALL_BEGIN in rest:
        start = rest.index(kimi.TOOL_CALL_BEGIN)
        end = rest.index(kimi.TOOL_CALL_END, start) + 1 if kimi.TOOL_CALL_END in rest[start:] else len(rest)
        calls.append(_tool_call(tok, rest[start:end]))
        rest = rest[end:]
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(tok: Decoder, ids: list[int]) -> dict[str, Any]:
    """``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``."""
    body = ids[1:] if ids and ids[0] == kimi.TOOL_CALL_BEGIN else ids
    complete = bool(body) and body[-1] == kimi.TOOL_CALL_END
    if complete:
        body = body[:-1]
    if kimi.TOOL_CALL_ARGUMENT_BEGIN in body:
        split = body.index(kimi.TOOL_CALL_ARGUMENT_BEGIN)
        head, args = body[:split], body[split + 1 :]
    else:
        head, args = body, []
    call_id = decode(tok, head).strip()
    match = _CALL_ID.match(call_id)
    name = match.group("name") if match else call_id
    call: dict[str, Any] = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": decode(tok, args)},
    }
    if not complete:
        call["truncated"] = True
    return call
