#!/usr/bin/env bash
# Install thinkfleet with its dev extra into .venv (if needed), make sure a Redis answers, run the tests.
# Usage: bash scripts/test.sh [pytest args…]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
ensure_venv dev
ensure_redis
exec .venv/bin/python -m pytest -q -rs "$@"  # -rs: every skip is listed with its reason
