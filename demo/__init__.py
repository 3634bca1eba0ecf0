"""The demo: the README's first command (``python -m demo``: :mod:`demo.app`), the worker processes it runs
(:mod:`demo.fleet`) and the Kimi-shaped test tokenizer it builds (:mod:`demo.tokenizer`).

An application, not foundation: it stands on the foundation (thinkfleet/) and runs the producer, workers and
simulator as processes; test support (testing/) stands on it (its worker processes and tokenizer are the tests' too).
"""
