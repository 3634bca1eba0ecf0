"""Test support for tests and benchmarks: services, fleet processes, the worker harness, tokenizers, rows, datasets.

It stands above every package it drives (thinkfleet, producer, workers, storage, sglang_sim) and none of them
imports it (tests/test_architecture.py); only tests/, bench/ and scripts/ do. ``testing.services`` imports
pytest. What the product's own demo needs at run time — the worker subprocess and the offline test tokenizer —
lives in the demo package (``demo/fleet.py``, ``demo/tokenizer.py``) and is re-exported by ``testing.fleet`` and
``testing.tokenizer``.
"""
