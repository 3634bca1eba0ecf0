#!/usr/bin/env bash
# Install thinkfleet with its dev extra into .venv (if needed), make sure a Redis answers, run the tests.
# Usage: bash scripts/test.sh [pytest args…]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
ensure_venv dev
ensure_redis
# Bytecode: where PYTHONDONTWRITEBYTECODE is set (the CI box sets it) no .pyc is ever written, and uv installs none,
# so each of the ~2,000 Python processes the suite starts (workers, simulators, CLIs, servers) compiled celery,
# redis, pydantic, aiohttp, pyarrow … and our own modules from source: a worker's imports took 1.8 CPU-s instead
# of 0.75. The first process to import a module writes its .pyc (atomically); every later one reads it.
unset PYTHONDONTWRITEBYTECODE
# -rs: every skip is listed with its reason. -n: most tests wait on their own subprocesses (workers, simulators,
# redis-servers), so three processes share the 2-core CI machine well; --dist loadfile keeps a module's tests
# (and its module fixtures) in one process. THINKFLEET_TEST_PROCESSES=0 runs them all in this one.
# --durations: the slowest tests, so a run that nears CI's 20-minute budget says where the time went.
exec .venv/bin/python -m pytest -q -rs --durations=15 -n "${THINKFLEET_TEST_PROCESSES:-3}" --dist loadfile "$@"
