"""``--format messages``: OpenAI/TRL chat JSONL, the chat under ``messages`` (:mod:`storage.exports.text`).

Read by chat-format SFT stacks that render the conversation with a template of their own (a student model's, say).
TRL trains such a record on every token, the user's and the system's included, unless the template marks the
assistant's part (``{% generation %}``, for ``assistant_only_loss=True``): Kimi's does not. For TRL on the stored
ids, with the loss on the generated tokens only, export ``--format hf`` (docs/exports.md).

An image prompt keeps its content parts where the conversation had them, each image an OpenAI ``image_url`` part
pointing at the stored image (``--image-urls``: storage/exports/images.py).
"""

from __future__ import annotations

from typing import Any

from storage.exports.base import TRL_MAX_LENGTH
from storage.exports.images import ImageBytes, openai_messages
from storage.exports.text import TextFormat


class Messages(TextFormat):
    name = "messages"
    key = "messages"
    length_limit = TRL_MAX_LENGTH
    length_advice = (
        f"TRL's SFTTrainer cuts rows at SFTConfig.max_length (default {TRL_MAX_LENGTH}) without a warning: set "
        "max_length={longest} (or None), or these rows lose their tail (counted in stored ids; TRL counts the "
        "re-rendered text's)"
    )

    def with_images(self, record: dict[str, Any], images: ImageBytes) -> str | None:
        record[self.key] = openai_messages(record[self.key], self.options.image_urls, images, record["id"])
        return None
