#!/usr/bin/env bash
# The trainers that read thinkfleet's exports — SpecForge, speculators, TRL, Hugging Face datasets — in a
# CPU-only venv of their own, for the consumer tests (tests/test_consumers.py) and for trying an export by hand.
#
#   bash scripts/consumers.sh env        build (or reuse) the venv; print its python
#
# The venv is built from scripts/consumers/consumers.lock (every package pinned, installed with --no-deps: the
# consumers' own requirements pull CUDA builds, SGLang and torchvision, none of which reading data needs) under
# ${THINKFLEET_CACHE:-~/.cache/thinkfleet}/consumers-<hash of the lock's pins>, so a second run reuses it and a
# changed pin builds a new one. Two builds at once (CI's, a test's) wait for each other. What each export is read by,
# with which settings: docs/exports.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON=${PYTHON:-python3}
cache=${THINKFLEET_CACHE:-$HOME/.cache/thinkfleet}
lock="$here/consumers/consumers.lock"

venv_dir() {  # where the venv for this lock lives: its pins name it (an edited comment builds nothing new)
  echo "$cache/consumers-$(grep -v '^#' "$lock" | sha256sum | cut -c1-16)"
}

build() {  # build DIR — a fresh venv from the lock, marked complete only once it imports
  local dir=$1
  echo "building the consumers' CPU venv in $dir (≈ 2–4 min, ≈ 1.5 GB)…" >&2
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  # --no-deps: the lock is the whole environment; --only-binary: nothing compiles, a missing wheel fails here.
  "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: -r "$lock" >&2
  # The imports that fail first when a pin is missing: each consumer's data path, and speculators' CLI.
  "$dir/bin/python" -W ignore -c 'import specforge.data.prompt_builder, specforge.config.schema, trl, datasets' >&2
  "$dir/bin/speculators" prepare-data --help >/dev/null
  date -u +%FT%TZ > "$dir/.complete"
}

ensure_env() {  # prints the venv's python once the venv is complete
  local dir
  dir=$(venv_dir)
  if [ ! -f "$dir/.complete" ]; then
    mkdir -p "$cache"
    exec 9>"$dir.lock"
    flock 9  # another build of the same lock (CI's, a parallel test process): wait for it, then reuse it
    [ -f "$dir/.complete" ] || build "$dir"
    exec 9>&-
  fi
  echo "$dir/bin/python"
}

cmd=${1:-env}
case "$cmd" in
  env)
    ensure_env
    ;;
  *)
    echo "usage: $0 env" >&2
    exit 2
    ;;
esac
