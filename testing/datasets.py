"""Synthetic chat datasets for tests and benchmarks (deterministic, any size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testing.corpus import synthetic_text
from thinkfleet import kimi


def chat_rows(
    n: int, words: int = 60, seed: int = 0, with_ids: bool = True, answer: bool = True
) -> list[dict[str, Any]]:
    """``n`` OpenAI-messages rows: system + user (+ an assistant answer that submit drops)."""
    rows = []
    for i in range(n):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": synthetic_text(words, seed * 1_000_003 + i)},
        ]
        if answer:
            messages.append({"role": "assistant", "content": "An old answer.", "reasoning_content": "old"})
        row: dict[str, Any] = {"messages": messages}
        if with_ids:
            row = {"id": f"r{i}", **row}
        rows.append(row)
    return rows


def conversation_rows(
    conversations: int, turns: int, words: int, system: str, reasoning: str | None = None, seed_step: int = 100
) -> list[dict[str, Any]]:
    """``conversations`` chats of ``turns`` user turns each (``id`` c0, c1, …), every user turn answered by the
    dataset's own assistant message (with ``reasoning_content`` when given): multi-turn regeneration input."""
    rows = []
    for c in range(conversations):
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for t in range(turns):
            messages.append({"role": "user", "content": synthetic_text(words, c * seed_step + t)})
            answer: dict[str, Any] = {"role": "assistant", "content": f"the dataset's answer {t}"}
            if reasoning is not None:
                answer["reasoning_content"] = reasoning
            messages.append(answer)
        rows.append({"id": f"c{c}", "messages": messages})
    return rows


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def kimi_id_prompt(body: list[int]) -> list[int]:
    """Token ids of a rendered Kimi thinking-mode prompt around ``body`` (system and user turns, then the
    assistant header and ``<think>``), for tests and benchmarks that skip the tokenizer."""
    return [
        kimi.IM_SYSTEM, 1, kimi.IM_MIDDLE, 2, kimi.IM_END,
        kimi.IM_USER, 3, kimi.IM_MIDDLE, *body, kimi.IM_END,
        kimi.IM_ASSISTANT, 4, kimi.IM_MIDDLE, kimi.THINK_START,
    ]  # fmt: skip


def tool_call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style tool call in Kimi's id form (``functions.{name}:{i}``)."""
    return {
        "id": f"functions.{name}:{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def agentic_rows(conversations: int, turns: int) -> list[dict[str, Any]]:
    """Agentic conversations (``--tool-results``): each user turn calls the calculator → its result → a lookup and a
    calculator call → two results → the dataset's answer."""
    rows = []
    for c in range(conversations):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant with tools."}]
        for t in range(turns):
            msgs += [
                {"role": "user", "content": f"Question {t} of chat {c}: how long is the trip, and the bridge?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    tool_call(0, "calculator", {"expression": "240/80"}),
                ]},
                {"role": "tool", "tool_call_id": "functions.calculator:0", "content": f"recorded 3 ({c}.{t})"},
                {"role": "assistant", "content": "", "tool_calls": [
                    tool_call(1, "lookup", {"key": "bridge"}),
                    tool_call(2, "calculator", {"expression": "100 * 101 / 2"}),
                ]},
                {"role": "tool", "tool_call_id": "functions.lookup:1", "content": f"recorded 1887 ({c}.{t})"},
                {"role": "tool", "tool_call_id": "functions.calculator:2", "content": f"recorded 5050 ({c}.{t})"},
                {"role": "assistant", "content": f"the dataset's answer {t}"},
            ]  # fmt: skip
        rows.append({"id": f"c{c}", "messages": msgs})
    return rows
