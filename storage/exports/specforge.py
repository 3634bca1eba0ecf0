"""``--format specforge``: JSONL ``{"id", "input_ids", "loss_mask"}``, the ids and mask of ``eagle3``.

SpecForge 0.2.0's pre-tokenized loader (``data.prompts_path``) and speculators 0.9.0's ``prepare-data --data``
read it as it is (``len(input_ids) == len(loss_mask)``). Rows with no trainable token (everything masked under
``--exclude-reasoning``) are skipped and counted — the consumers would drop them anyway.

Image prompts are left out, counted and warned about: this loader sends the ids to the target server with no
image, so its hidden states would be those of a prompt whose images are bare placeholders — a drafter trained on
them learns the wrong thing, silently. SpecForge's VLM path reads ``{image, conversations}``: ``--format
conversations`` writes image prompts in that shape (storage/exports/conversations.py, docs/vision.md).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage import layout
from storage.exports.base import ExportResult, Rows
from storage.exports.eagle3 import Eagle3
from storage.schema import IMAGE_SHA256

#: The skip reason of an image prompt.
IMAGE_ROWS = "image_prompts"


class SpecForge(Eagle3):
    name = "specforge"
    suffix = ".jsonl"
    jsonl_fields = ("id", "input_ids", "loss_mask")

    def writes_parquet(self, loc: layout.Location) -> bool:
        return False  # SpecForge does not read Parquet

    row_columns = (IMAGE_SHA256,)

    def keep_rows(self, table: pa.Table, skipped: dict[str, int]) -> pa.Table:
        """Leave out (and count) the image prompts: this loader would send their ids without their images."""
        images = table[IMAGE_SHA256]
        if images.null_count == len(images):
            return table
        skipped[IMAGE_ROWS] = skipped.get(IMAGE_ROWS, 0) + len(images) - images.null_count
        return table.filter(pc.is_null(images))

    def keep(self, records: pa.Table, skipped: dict[str, int]) -> pa.Table:
        """Drop (and count) records whose loss mask has no 1: SpecForge and speculators drop them anyway."""
        mask = records["loss_mask"]
        ends = np.cumsum(pc.list_value_length(mask).to_numpy(zero_copy_only=False))
        ones = np.concatenate([[0], np.cumsum(pc.list_flatten(mask).to_numpy(zero_copy_only=False), dtype=np.int64)])
        empty = ones[ends] == ones[np.concatenate([[0], ends[:-1]])]
        if not empty.any():
            return records
        skipped["no_trainable_tokens"] = skipped.get("no_trainable_tokens", 0) + int(empty.sum())
        return records.filter(pa.array(~empty))

    def write(self, result: ExportResult, loc: layout.Location, rows: Rows) -> None:
        super().write(result, loc, rows)
        if result.skipped.get(IMAGE_ROWS):
            result.warnings.append(
                f"left out {result.skipped[IMAGE_ROWS]} image prompts: SpecForge's pre-tokenized loader sends ids "
                "with no image, so the target would see bare placeholders. Export them with --format conversations "
                "(SpecForge's VLM shape, {image, conversations}) or --format hf"
            )
        if result.skipped.get("no_trainable_tokens"):
            result.warnings.append(
                f"skipped {result.skipped['no_trainable_tokens']} rows with no trainable token left (all of their "
                "output is reasoning, which --exclude-reasoning masks out)"
            )
