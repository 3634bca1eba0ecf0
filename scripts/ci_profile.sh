#!/usr/bin/env bash
# Where the suite's CPU goes: run the test command (scripts/test.sh) with the CPU profile plugin
# (testing/cpu_profile.py) and write the 20 most expensive test files to docs/ci-profile.md.
#
#   bash scripts/ci_profile.sh                      the whole suite (what CI runs)
#   bash scripts/ci_profile.sh tests/test_x.py …    a subset (any pytest arguments)
#   bash scripts/ci_profile.sh --report             only the page, from the rows already in $THINKFLEET_CPU_PROFILE
#                                                   (a run that was cut short: each test's row is written as it ends)
#
# CPU-seconds, not wall time: the 2-core CI box is CPU-bound for the whole run, so a test's cost is the CPU it and
# every process it starts use. The raw rows (one JSON line per test) stay in $THINKFLEET_CPU_PROFILE
# (default /tmp/thinkfleet-cpu-profile.jsonl); OUT= writes the table elsewhere. THINKFLEET_TEST_PROCESSES=0 runs
# the tests in one process (the CPU figures are the same; only the wall time differs).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${THINKFLEET_CPU_PROFILE:-/tmp/thinkfleet-cpu-profile.jsonl}
out=${OUT:-docs/ci-profile.md}
rc=0
if [ "${1:-}" = --report ]; then
  measured="from the rows of a run that may have been cut short"
else
  rm -f "$profile"
  started=$(date +%s)
  THINKFLEET_CPU_PROFILE="$profile" bash scripts/test.sh -p testing.cpu_profile "$@" || rc=$?
  measured="pytest rc $rc, $(($(date +%s) - started)) s of wall time"
fi
{
  cat <<'EOF'
# Where the suite's CPU goes

Written by `scripts/ci_profile.sh` (rerun it rather than editing this page). CPU-seconds per test file: the CPU of
the pytest process that ran the file's tests **and of every process those tests started** (redis-servers,
simulators, Celery workers and their pool children, `producer`/`storage` subprocesses), read from a cgroup each
pytest process moves itself into (`testing/cpu_profile.py`): exact, whether a child is waited for, daemonized or
orphaned; where no cgroup is writable, /proc accounting with the limits its docstring names. Set-up and teardown
count: a module fixture's start lands on the file's first test, its stop on the last. Wall time is shown but
means little on a loaded box. CPU that a test causes in processes it did not start (the shared Redis on 6379) is
not counted.

EOF
  echo "## Measured $(date -u +%F) ($(nproc) cores, $measured)"
  echo
  [ "${1:-}" = --report ] || echo "Command: \`bash scripts/ci_profile.sh${*:+ $*}\`"
  echo
  .venv/bin/python -m testing.cpu_profile report "$profile"
} >"$out"
echo "wrote $out (rows: $profile)" >&2
exit "$rc"
