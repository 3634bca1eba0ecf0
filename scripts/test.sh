#!/usr/bin/env bash
# Install thinkfleet with its dev extra into .venv (if needed), make sure a Redis answers, run the tests.
# Usage: bash scripts/test.sh [pytest args…]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
ensure_venv dev
ensure_redis
# -rs: every skip is listed with its reason. -n: most tests wait on their own subprocesses (workers, simulators,
# redis-servers), so three processes share the 2-core CI machine well; --dist loadfile keeps a module's tests
# (and its module fixtures) in one process. THINKFLEET_TEST_PROCESSES=0 runs them all in this one.
# --durations: the slowest tests, so a run that nears CI's 20-minute budget says where the time went.
exec .venv/bin/python -m pytest -q -rs --durations=15 -n "${THINKFLEET_TEST_PROCESSES:-3}" --dist loadfile "$@"
