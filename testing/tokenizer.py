"""The offline model-shaped test tokenizers, for tests and benchmarks (re-exported from the foundation).

The builder lives in ``demo/tokenizer.py`` (the families' layouts in ``demo/families.py``): ``python -m demo``
builds the ``kimi`` tokenizer at run time, and the foundation imports nothing above it, so the builder cannot live
in this package (which stands above every package it drives). It imports nothing but the foundation, so keeping it
there costs nothing; tests import it from here, beside the rest of the test support.
"""

from __future__ import annotations

from demo.families import FAMILIES, Layout, layout, special_token_layout
from demo.tokenizer import CORPUS, MARKER, build_test_tokenizer, content_hash, default_test_tokenizer_dir, is_built

__all__ = [
    "CORPUS",
    "FAMILIES",
    "MARKER",
    "Layout",
    "build_test_tokenizer",
    "content_hash",
    "default_test_tokenizer_dir",
    "is_built",
    "layout",
    "special_token_layout",
]
