"""The offline model-shaped test tokenizers, for tests and benchmarks (re-exported from the foundation).

The builder lives whole in ``demo/tokenizer.py``: ``python -m demo`` builds the ``kimi``
tokenizer at run time, and the foundation imports nothing above it, so the builder cannot live in this package
(which stands above every package it drives). It imports nothing but the foundation, so keeping it there costs
nothing; tests import it from here, beside the rest of the test support. See that module for the families.
"""

from __future__ import annotations

from demo.tokenizer import (
    CORPUS,
    FAMILIES,
    MARKER,
    Layout,
    build_test_tokenizer,
    content_hash,
    default_test_tokenizer_dir,
    is_built,
    layout,
    special_token_layout,
)

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
