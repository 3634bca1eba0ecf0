#!/usr/bin/env bash
# Where the suite's CPU goes, by kind of process (workers, simulators, producer CLIs, servers, pytest itself):
# run the test command (scripts/test.sh) under the kernel's process accounting and a /proc command-line sampler
# (testing/process_profile.py), and write the table to docs/ci-processes.md. Needs root and the acct package
# (apt-get install acct). scripts/ci_profile.sh gives the same run's cost by test file instead.
#
#   bash scripts/ci_processes.sh                 the whole suite
#   bash scripts/ci_processes.sh tests/test_x.py any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
command -v accton >/dev/null || { echo "accton not found: apt-get install acct" >&2; exit 1; }
work=$(mktemp -d)
out=${OUT:-docs/ci-processes.md}
source scripts/_env.sh
ensure_venv dev
: >"$work/pacct"
accton "$work/pacct" >/dev/null
.venv/bin/python -m testing.process_profile sample "$work/cmdlines.json" "$work/stop" &
sampler=$!
stop() { touch "$work/stop"; wait "$sampler" || true; accton off >/dev/null || true; }
trap stop EXIT
started=$(date +%s)
rc=0
bash scripts/test.sh "$@" || rc=$?
wall=$(($(date +%s) - started))
stop
trap - EXIT
{
  echo "# Where the suite's CPU goes, by kind of process"
  echo
  echo "Written by \`scripts/ci_processes.sh\` (rerun it rather than editing this page): the kernel's process"
  echo "accounting (every process's CPU when it exits, however it ends) joined with the command lines a sampler read"
  echo "from /proc (testing/process_profile.py). A process that lived less than the sampler's 0.2 s has no command"
  echo "line and is named by its \`comm\` in parentheses. CPU-s per test file: docs/ci-profile.md."
  echo
  echo "## Measured $(date -u +%F) on $(git rev-parse --short HEAD) ($(nproc) cores, pytest rc $rc, $wall s of wall time)"
  echo
  echo "Command: \`bash scripts/ci_processes.sh${*:+ $*}\`"
  echo
  .venv/bin/python -m testing.process_profile report "$work/pacct" "$work/cmdlines.json"
} >"$out"
echo "wrote $out (raw: $work)" >&2
exit "$rc"
