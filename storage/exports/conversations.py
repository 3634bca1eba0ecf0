"""``--format conversations``: the ``messages`` records with the chat under ``conversations``.

That is SpecForge's raw-data key (``data.train_data_path``, its text route: re-rendered with its chat template and
re-tokenized, which loses what docs/exports.md says); :mod:`storage.exports.text` builds the records.

An image prompt is written in SpecForge's VLM shape, ``{"image", "conversations"}`` with string contents (open PR
sgl-project/SpecForge#730 ``specforge/data/vlm_preprocessing.py``, and ``preprocess_vlm_conversations`` before the
2026 rewrite; SpecForge 0.2.0 itself reads no images: docs/vision.md). That shape holds one image, in the first user
turn: other image prompts are left out, counted by reason.
"""

from __future__ import annotations

from typing import Any

from storage import layout
from storage.exports.base import SPECFORGE_MAX_LENGTH, ExportResult, Rows
from storage.exports.images import ImageBytes, specforge_vlm
from storage.exports.text import TextFormat

#: Why an image prompt is left out (the skip reason) → how the warning says it.
VLM_SKIPS = {
    "images_over_one_per_sample": "with more than one image",
    "image_outside_first_user_turn": "with their image after the first user turn",
}


class Conversations(TextFormat):
    name = "conversations"
    key = "conversations"
    length_limit = SPECFORGE_MAX_LENGTH
    length_advice = (
        f"SpecForge cuts rows at data.max_length (default {SPECFORGE_MAX_LENGTH}) without a warning: set "
        "data.max_length={longest}, or these rows lose their tail (counted in stored ids; SpecForge counts the "
        "re-rendered text's)"
    )

    def with_images(self, record: dict[str, Any], images: ImageBytes) -> str | None:
        shaped = specforge_vlm(record[self.key], self.options.image_urls, images, record["id"])
        if isinstance(shaped, str):
            return shaped
        record[self.key], record["image"] = shaped  # where SpecForge reads it (or image_path, a one-element images)
        self.remote_images += record["image"].startswith("s3://")
        return None

    #: Images written as s3:// URIs, which SpecForge cannot open (it reads a local path or base64).
    remote_images = 0

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        super().write(result, loc, rows)
        if self.remote_images:
            result.warnings.append(
                f"{self.remote_images} records name their image by an s3:// URI, which SpecForge does not read (a "
                "local path or base64): export with --image-urls data"
            )
        left_out = {why: n for why, n in result.skipped.items() if why in VLM_SKIPS}
        if left_out:
            counts = ", ".join(f"{n} {VLM_SKIPS[why]}" for why, n in left_out.items())
            result.warnings.append(
                f"left out image prompts SpecForge's VLM shape cannot hold ({counts}): it takes one image, in the "
                "first user turn. `--format messages` or `--format hf` keep them"
            )
