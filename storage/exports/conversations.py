"""``--format conversations``: the ``messages`` records with the chat under ``conversations``.

That is SpecForge's raw-data key (``data.train_data_path``); :mod:`storage.exports.text` builds the records.
"""

from __future__ import annotations

from storage.exports.text import TextFormat


class Conversations(TextFormat):
    name = "conversations"
    key = "conversations"
