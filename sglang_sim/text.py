"""The ``text`` field: a real tokenizer when one is configured, a cheap built-in rendering otherwise.

Clients of this project read ``output_ids``, never ``text``, so without ``--tokenizer`` the simulator
renders ids with a built-in mapping instead of loading a 160k-entry vocabulary:

- Kimi special/reserved ids (>= 163584) by their token names from :mod:`thinkfleet.kimi`
  (``</think>``, ``<|im_end|>``, …; unnamed reserved ids as ``<|reserved_N|>``);
- every other id as 3 base-64 digits of its value (``[A-Za-z0-9-_]``, most significant first: id 0 is
  ``AAA``, id 64 is ``ABA``), so ``len(text) == 3 × normal tokens`` and rendering is vectorized —
  at time-scale 1000 the server renders hundreds of responses per second.

``skip_special_tokens`` (SGLang's default True) drops the ids Kimi's tokenizer_config marks
``special: true`` (BOS/EOS, role markers, ``<|im_end|>``, media, reserved). The think and tool-call
markers stay, since Kimi's reasoning and tool-call parsers read them from the text. As in SGLang's
detokenizer, a matched stop *token* is trimmed from the text (not from ``output_ids``) unless
``no_stop_trim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from thinkfleet import kimi

_NAMES: dict[int, str] = {token_id: name for name, token_id in kimi.SPECIAL_TOKENS.items()}
#: Ids that survive skip_special_tokens: Kimi's reasoning and tool-call markers.
_KEPT_SPECIALS = frozenset(
    {
        kimi.THINK_START,
        kimi.THINK_END,
        kimi.TOOL_CALLS_SECTION_BEGIN,
        kimi.TOOL_CALLS_SECTION_END,
        kimi.TOOL_CALL_BEGIN,
        kimi.TOOL_CALL_ARGUMENT_BEGIN,
        kimi.TOOL_CALL_END,
    }
)


#: 64 URL-safe digits: a normal id renders as 3 of them (64**3 = 262,144 > the vocabulary).
_DIGITS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", dtype=np.uint8)


def placeholder_text(output_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Render ids without a tokenizer (see the module docstring); vectorized, ~40 ns per id."""
    ids = np.asarray(output_ids, dtype=np.int64)
    if ids.size == 0:
        return ""
    if ids.min() < 0 or ids.max() >= 64**3:  # 3 digits cover every family's vocabulary (gpt-oss: 201,088)
        raise ValueError("token ids must be in [0, 262144)")
    digits = np.empty((ids.size, 3), dtype=np.uint8)
    digits[:, 0] = _DIGITS[(ids >> 12) & 63]
    digits[:, 1] = _DIGITS[(ids >> 6) & 63]
    digits[:, 2] = _DIGITS[ids & 63]
    encoded = digits.tobytes().decode("ascii")
    special_positions = np.flatnonzero(ids >= kimi.FIRST_SPECIAL_ID).tolist()
    if not special_positions:
        return encoded
    pieces = []
    previous = 0
    for position in special_positions:
        pieces.append(encoded[3 * previous : 3 * position])
        token = int(ids[position])
        if not skip_special_tokens or token in _KEPT_SPECIALS:
            pieces.append(placeholder_token(token))
        previous = position + 1
    pieces.append(encoded[3 * previous :])
    return "".join(pieces)


def placeholder_token(token_id: int) -> str:
    """The built-in rendering of one id."""
    if token_id >= kimi.FIRST_SPECIAL_ID:
        return _NAMES.get(token_id, f"<|reserved_{token_id}|>")
    digits = _DIGITS[[(token_id >> 12) & 63, (token_id >> 6) & 63, token_id & 63]]
    return digits.tobytes().decode("ascii")


class TextCodec:
    """Turns ``text`` prompts into ids and ``output_ids`` into ``text``."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self.tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        if tokenizer_path:
            # Imported lazily: transformers takes seconds to import and most runs never need it.
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=True)

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> Any:
        """The loaded tokenizer (None without ``--tokenizer``): the image placeholder's id comes from it."""
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Prompt text → ids, as SGLang's tokenizer manager does (``tokenizer(text)["input_ids"]``)."""
        if self._tokenizer is None:
            raise ValueError(
                "Tokenizer is not initialized but input_text requires tokenization. "
                "sglang-sim renders text without a tokenizer; send input_ids, or start it with "
                "--tokenizer PATH to send text."
            )
        return list(self._tokenizer(text)["input_ids"])

    def decode(
        self,
        output_ids: Sequence[int],
        finish_reason: dict[str, Any] | None,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> str:
        """The response ``text`` for these ids (stop token trimmed unless ``no_stop_trim``)."""
        ids = list(output_ids)
        if (
            not no_stop_trim
            and finish_reason is not None
            and finish_reason.get("type") == "stop"
            and isinstance(finish_reason.get("matched"), int)
            and ids
        ):
            ids = ids[:-1]
        if self._tokenizer is None:
            return placeholder_text(ids, skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
