"""``--format messages``: OpenAI/TRL chat JSONL, the chat under ``messages`` (:mod:`storage.exports.text`)."""

from __future__ import annotations

from storage.exports.text import TextFormat


class Messages(TextFormat):
    name = "messages"
    key = "messages"
