#!/usr/bin/env bash
# The whole job on embedded defaults: install, start what is missing (Redis, the SGLang simulator),
# run two workers, submit the bundled sample datasets, wait, verify, report.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
ensure_venv demo
exec .venv/bin/python -m demo "$@"
