#!/usr/bin/env bash
# A real SGLang server on this CPU-only machine, for the real-SGLang test tier (tests/real_sglang/).
#
#   bash scripts/real_sglang.sh env [VERSION]          build (or reuse) the venv; print its python
#   bash scripts/real_sglang.sh model TOKDIR OUT [ARCH [VOCAB]]   a tiny random-weight model around TOKDIR
#   bash scripts/real_sglang.sh serve MODEL PORT [VERSION]        run the server in the foreground
#
# VERSION: 0.5.9 (the deployed release, the default) or 0.5.23 (the current release); the default also comes
# from THINKFLEET_REAL_SGLANG_VERSION, which `model` reads too (the model is built by that version's venv).
#
# The venv is built from scripts/real_sglang/sglang-VERSION.lock (every package pinned, --no-deps: SGLang's
# own requirements pull CUDA builds) under ${THINKFLEET_CACHE:-~/.cache/thinkfleet}/real-sglang-<hash of the
# lock and the stubs>, so a second run reuses it, and an edited lock builds a new one. Two CUDA-only packages
# SGLang imports unconditionally are stand-ins (scripts/real_sglang/stubs). Facts and flags:
# ../shared/reference/real-sglang-cpu.md; what the tier proves: docs/real-sglang.md.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
PYTHON=${PYTHON:-python3}
cache=${THINKFLEET_CACHE:-$HOME/.cache/thinkfleet}

venv_dir() {  # venv_dir VERSION — where the venv for that lock lives
  local lock="$here/real_sglang/sglang-$1.lock"
  [ -f "$lock" ] || { echo "no lock file $lock (known: $(ls "$here"/real_sglang/*.lock | xargs -n1 basename))" >&2; exit 2; }
  local digest
  # stubs-VERSION/ (if any) overrides stubs/ for that version only; 0.5.9 has none, so its key is the lock and stubs/
  digest=$( (cat "$lock" "$here"/real_sglang/stubs/_cpu_stub.py "$here"/real_sglang/stubs/*/__init__.py
    [ ! -d "$here/real_sglang/stubs-$1" ] || find "$here/real_sglang/stubs-$1" -type f -name '*.py' | sort | xargs cat
  ) | sha256sum | cut -c1-16)
  echo "$cache/real-sglang-$1-$digest"
}

ensure_env() {  # ensure_env VERSION — prints the venv's python once the venv is complete
  local version=$1 dir
  dir=$(venv_dir "$version")
  if [ ! -f "$dir/.complete" ]; then
    echo "building the SGLang $version CPU venv in $dir (≈ 3–5 min, ≈ 3 GB)…" >&2
    rm -rf "$dir" && mkdir -p "$(dirname "$dir")"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip >&2
    # --no-deps: the lock is the whole environment. A wrong or missing pin fails here, not at import.
    "$dir/bin/python" -m pip install -q --no-deps -r "$here/real_sglang/sglang-$version.lock" >&2
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp -r "$here"/real_sglang/stubs/. "$site/"
    [ ! -d "$here/real_sglang/stubs-$version" ] || cp -r "$here/real_sglang/stubs-$version/." "$site/"
    # The import that fails first when something is missing: the server's whole module graph.
    SGLANG_USE_CPU_ENGINE=1 "$dir/bin/python" -W ignore -c 'import sglang.srt.entrypoints.http_server' >&2
    "$dir/bin/python" -m pip check >&2 || true  # informative: the stand-ins and the newer torch differ from pins
    date -u +%FT%TZ > "$dir/.complete"
  fi
  echo "$dir/bin/python"
}

default_version=${THINKFLEET_REAL_SGLANG_VERSION:-0.5.9}
cmd=${1:-env}
case "$cmd" in
  env)
    ensure_env "${2:-$default_version}"
    ;;
  model)
    [ $# -ge 3 ] || { echo "usage: $0 model TOKDIR OUT [qwen2|qwen3 [VOCAB]]" >&2; exit 2; }
    py=$(ensure_env "$default_version")
    args=(--tokenizer "$2" --out "$3" --arch "${4:-qwen2}")
    [ -n "${5:-}" ] && args+=(--vocab-size "$5")
    "$py" -W ignore "$here/real_sglang/make_model.py" "${args[@]}"
    ;;
  serve)
    [ $# -ge 3 ] || { echo "usage: $0 serve MODEL PORT [VERSION]" >&2; exit 2; }
    py=$(ensure_env "${4:-$default_version}")
    # torch_native attention, no CUDA graphs, a 64k-token KV pool (else it takes 2 GB). Keep the warm-up:
    # without it the first forward takes ~28 s and /health answers 503 meanwhile.
    # A guest on a shared test box: one OpenMP thread, below the other tests' priority (THINKFLEET_REAL_SGLANG_NICE).
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SGLANG_USE_CPU_ENGINE=1 exec nice -n "${THINKFLEET_REAL_SGLANG_NICE:-10}" \
      "$py" -m sglang.launch_server --model-path "$2" --device cpu \
      --attention-backend torch_native --disable-cuda-graph --host 127.0.0.1 --port "$3" \
      --mem-fraction-static 0.1 --max-total-tokens 65536 ${THINKFLEET_REAL_SGLANG_ARGS:-}
    ;;
  *)
    echo "usage: $0 env|model|serve …" >&2
    exit 2
    ;;
esac
