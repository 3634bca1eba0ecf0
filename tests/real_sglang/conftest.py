"""The real-SGLang tier's one server: built and started once for the whole tier (start-up is a minute or more),
or the server ``THINKFLEET_REAL_SGLANG_URL`` names. A venv, a model or a server that cannot be made **fails**
the tier with the build's output: this tier exists so that CI talks to the real thing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_server import RealServer, ensure_environment, ensure_model

from testing.tokenizer import build_test_tokenizer, default_test_tokenizer_dir

URL_ENV = "THINKFLEET_REAL_SGLANG_URL"


@pytest.fixture(scope="session")
def real_tok_dir() -> Path:
    return build_test_tokenizer(default_test_tokenizer_dir())


@pytest.fixture(scope="session")
def real_sglang(real_tok_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    log = tmp_path_factory.mktemp("real-sglang") / "server.log"
    external = os.environ.get(URL_ENV)
    if external:
        server = RealServer(model=None, log_path=log, external=external.rstrip("/"))
        server.wait_healthy()
        yield server
        return
    ensure_environment()
    model = ensure_model(real_tok_dir, default_test_tokenizer_dir().parent)
    server = RealServer(model=model, log_path=log).start()
    try:
        yield server
    finally:
        server.stop()
