"""``--format conversations``: the ``messages`` records with the chat under ``conversations``.

That is SpecForge's raw-data key (``data.train_data_path``, its text route: re-rendered with its chat template and
re-tokenized, which loses what docs/exports.md says); :mod:`storage.exports.text` builds the records.
"""

from __future__ import annotations

from storage.exports.base import SPECFORGE_MAX_LENGTH
from storage.exports.text import TextFormat


class Conversations(TextFormat):
    name = "conversations"
    key = "conversations"
    length_limit = SPECFORGE_MAX_LENGTH
    length_advice = (
        f"SpecForge cuts rows at data.max_length (default {SPECFORGE_MAX_LENGTH}) without a warning: set "
        "data.max_length={longest}, or these rows lose their tail (counted in stored ids; SpecForge counts the "
        "re-rendered text's)"
    )
