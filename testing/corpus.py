"""A deterministic text generator over the built-in text the test tokenizer is trained on.

The corpus itself (:data:`CORPUS`, written for this project) lives with the tokenizer builder in the foundation
(``demo/tokenizer.py``: the demo builds a tokenizer from it at run time); it is re-exported here.
The generator reuses the corpus' words so synthetic prompts tokenize at a realistic ~1 token per word.
"""

from __future__ import annotations

import random

from demo.tokenizer import CORPUS

__all__ = ["CORPUS", "synthetic_text"]

_WORDS = sorted(set(CORPUS.split()))


def synthetic_text(n_words: int, seed: int) -> str:
    """``n_words`` corpus words in a deterministic random order (lines every ~14 words)."""
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=n_words)
    for i in range(13, n_words, 14):
        words[i] += "\n"
    return " ".join(words)
