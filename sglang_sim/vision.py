"""``image_data`` on ``/generate``: each image's one placeholder expanded into the tokens its image processor makes.

A real SGLang server loads its model directory's image processor at start; the simulator loads the same
``preprocessor_config.json`` from ``--tokenizer``'s directory and counts with the processor's own arithmetic
(thinkfleet/vision.py: Kimi-K2.5's navit resize, Qwen-VL's ``smart_resize``) on each decoded image's size. Without
that file (or without ``--tokenizer``) the simulator is a text-only model: ``/model_info`` says
``has_image_understanding: false`` and ``image_data`` is ignored, as a real text-only server ignores it
(0.5.9 ``managers/tokenizer_manager.py`` ``_tokenize_one_request``: the multimodal path runs only
``if self.mm_processor and obj.contains_mm_input()``).

What an answer shows: ``meta_info.prompt_tokens`` is the expanded length, and the prefill is charged for the
expanded tokens (the caller replaces the item's ids with :meth:`SimVision.expand`'s). In the 0.5.23 profile,
``return_prompt_token_ids`` returns those ids: the caller's ids kept, each placeholder repeated
(``SGLANG_MM_AVOID_RETOKENIZE``, 0.5.23 ``multimodal/processors/base_processor.py`` ``_expand_input_ids``).

Refused as the real server refuses them (a client that sends already-expanded placeholders is the known trap):
more placeholder ids than images — 0.5.23 answers 400 with ``_placeholder_mismatch_error``'s message
(``multimodal/processors/base_processor.py``: "Prompt has N image placeholders but M image inputs were
provided"), 0.5.9 a 500 (the same file's ``legacy_load_mm_data`` raises ``RuntimeError("An exception occurred
while loading multimodal data: ")`` from the StopIteration, which the HTTP layer does not map to 400). The real
processors count placeholder *runs* (Kimi's regex ``(?:<|media_pad|>)+``, Qwen's
``<|vision_start|>(?:<|image_pad|>)+<|vision_end|>``), so a pre-expanded run is taken there as one image and
expanded again; the simulator counts ids and refuses it, rather than imitate a silent double expansion. More images
than placeholders: the extra images are ignored (both releases log "More image data items provided than
corresponding tokens found in the prompt"). An image that cannot be decoded: 0.5.23 400 / 0.5.9 500
("An exception occurred while loading IMAGE data at index i: …", the same file's ``fast_load_mm_data``).
The simulator decodes ``data:`` URIs, raw base64 and local paths; it never fetches a URL (a 400 says so).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from sglang_sim.errors import BadRequest, InternalError
from thinkfleet.vision import QWEN_MAX_ASPECT, ImageRule, Placeholder, VisionError, load_rule, placeholder


class SimVision:
    """The served model's image processor: its token-count rule and placeholder id."""

    def __init__(self, rule: ImageRule, token: Placeholder, refuse_with_400: bool) -> None:
        self.rule, self.placeholder = rule, token
        #: 0.5.23 refuses a mismatch with a 400 (ValueError); 0.5.9 fails it with a 500 (RuntimeError).
        self.refuse_with_400 = refuse_with_400

    @classmethod
    def load(cls, tokenizer_dir: str | None, tokenizer: Any, refuse_with_400: bool) -> SimVision | None:
        """The vision of ``--tokenizer``'s directory; None (a text-only model) without its preprocessor config."""
        if not tokenizer_dir or tokenizer is None or not Path(tokenizer_dir).is_dir():
            return None
        try:
            rule = load_rule(tokenizer_dir)
            return cls(rule, placeholder(tokenizer, rule, tokenizer_dir), refuse_with_400)
        except VisionError:
            return None

    def expand(self, input_ids: list[int], image_data: list[Any], skew: int = 0) -> list[int]:
        """``input_ids`` with the i-th placeholder repeated as many times as image i makes tokens (+ ``skew``: the
        ``image_token_skew`` fault, a server whose processor counts otherwise)."""
        pid = self.placeholder.token_id
        placeholders = sum(1 for t in input_ids if t == pid)
        if placeholders > len(image_data):
            given = len(image_data)
            self._refuse(f"Prompt has {placeholders} image placeholders but {given} image inputs were provided")
        counts = [max(1, self._tokens(value, i) + skew) for i, value in enumerate(image_data[:placeholders])]
        out: list[int] = []
        k = 0
        for t in input_ids:
            if t == pid:
                out.extend([pid] * counts[k])
                k += 1
            else:
                out.append(t)
        return out

    def _tokens(self, value: Any, index: int) -> int:
        try:
            width, height = image_size(value)
        except (ValueError, OSError) as exc:
            self._refuse(f"An exception occurred while loading IMAGE data at index {index}: {exc}")
            raise AssertionError("unreachable") from exc
        try:
            return self.rule.tokens(width, height)
        except VisionError:
            # The processor's own refusal is a ValueError both releases answer 400 (measured against a real 0.5.9:
            # docs/sglang-versions.md), in the words of 0.5.9 multimodal/processors/qwen_vl.py ``smart_resize``.
            ratio = max(width, height) / min(width, height)
            raise BadRequest(f"absolute aspect ratio must be smaller than {QWEN_MAX_ASPECT}, got {ratio}") from None

    def _refuse(self, message: str) -> None:
        if self.refuse_with_400:
            raise BadRequest(message)
        raise InternalError(message)


def image_size(value: Any) -> tuple[int, int]:
    """(width, height) of one ``image_data`` entry: a ``data:`` URI, raw base64 or a local path."""
    from PIL import Image

    if not isinstance(value, str):
        raise ValueError(f"sglang-sim takes image_data entries as strings, got {type(value).__name__}")
    if value.startswith(("http://", "https://", "s3://", "gs://")):
        raise ValueError("sglang-sim does not fetch image URLs; send a data: URI")
    if value.startswith("data:"):
        data = _b64(value.partition(",")[2])
    elif Path(value).is_file():
        data = Path(value).read_bytes()
    else:
        data = _b64(value)
    with Image.open(io.BytesIO(data)) as image:
        image.load()  # a truncated file fails here, as the server's loader would
        return image.size


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 image data ({exc})") from None
