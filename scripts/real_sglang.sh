#!/usr/bin/env bash
# A real SGLang server on this CPU-only machine, for the real-SGLang test tier (tests/real_sglang/).
#
#   bash scripts/real_sglang.sh env [VERSION]          build (or reuse) the venv; print its python
#   bash scripts/real_sglang.sh vision-env [VERSION]   …and its vision overlay (real torchvision); print its python
#   bash scripts/real_sglang.sh model TOKDIR OUT [ARCH [VOCAB]]   a tiny random-weight model around TOKDIR
#                                                      (ARCH qwen2, qwen3 or qwen2vl: a vision model)
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
#
# A vision model (a config.json with a vision_config) runs from the venv's *vision overlay*: a second small venv
# that sees the first through a .pth line and adds the real torchvision (patched to import beside the CPU torch),
# a decord stand-in and the sgl_kernel op names 0.5.23 looks up at import (scripts/real_sglang/vision/). It is keyed
# on the base venv and its own files, so the text tier's venv and key do not change when it does. Builds take a
# lock per venv, overlay and model: the tier's test files run in parallel processes (pytest -n).
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

site_packages() {  # site_packages PYTHON
  "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

build_env() {  # build_env VERSION DIR
  local version=$1 dir=$2 site
  echo "building the SGLang $version CPU venv in $dir (≈ 3–5 min, ≈ 3 GB)…" >&2
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >&2
  # --no-deps: the lock is the whole environment. A wrong or missing pin fails here, not at import.
  "$dir/bin/python" -m pip install -q --no-deps -r "$here/real_sglang/sglang-$version.lock" >&2
  site=$(site_packages "$dir/bin/python")
  cp -r "$here"/real_sglang/stubs/. "$site/"
  [ ! -d "$here/real_sglang/stubs-$version" ] || cp -r "$here/real_sglang/stubs-$version/." "$site/"
  # The import that fails first when something is missing: the server's whole module graph.
  SGLANG_USE_CPU_ENGINE=1 "$dir/bin/python" -W ignore -c 'import sglang.srt.entrypoints.http_server' >&2
  "$dir/bin/python" -m pip check >&2 || true  # informative: the stand-ins and the newer torch differ from pins
  date -u +%FT%TZ > "$dir/.complete"
}

ensure_env() {  # ensure_env VERSION — prints the venv's python once the venv is complete
  local version=$1 dir
  dir=$(venv_dir "$version")
  if [ ! -f "$dir/.complete" ]; then
    mkdir -p "$(dirname "$dir")"
    exec 9>"$dir.lock"
    flock 9  # another build of the same venv (the tier's test files run in parallel processes): wait, then reuse it
    [ -f "$dir/.complete" ] || build_env "$version" "$dir"
    exec 9>&-
  fi
  echo "$dir/bin/python"
}

vision_dir() {  # vision_dir VERSION — where the vision overlay of that version's venv lives
  local base digest
  base=$(venv_dir "$1")
  digest=$( (echo "$base"; cat "$here"/real_sglang/vision/overlay.lock "$here"/real_sglang/vision/patch_torchvision.py
    find "$here/real_sglang/vision/stubs" -type f -name '*.py' | sort | xargs cat
  ) | sha256sum | cut -c1-16)
  echo "$base-vision-$digest"
}

build_vision() {  # build_vision DIR BASE_PYTHON
  local dir=$1 base_py=$2 site
  echo "building the vision overlay of $(dirname "$(dirname "$base_py")") in $dir (≈ 30 s, ≈ 60 MB)…" >&2
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  site=$(site_packages "$dir/bin/python")
  # The base venv's packages after the overlay's own (its stand-in torchvision is shadowed by the real one).
  echo "import site; site.addsitedir('$(site_packages "$base_py")')" > "$site/zz-real-sglang-base.pth"
  "$dir/bin/python" -m pip install -q --no-deps -r "$here/real_sglang/vision/overlay.lock" >&2
  "$dir/bin/python" "$here/real_sglang/vision/patch_torchvision.py" "$site" >&2
  cp -r "$here"/real_sglang/vision/stubs/. "$site/"
  # What a Qwen-VL server loads: the processor module (torchvision, decord) and transformers' video processor.
  SGLANG_USE_CPU_ENGINE=1 "$dir/bin/python" -W ignore -c '
import sys, sglang.srt.entrypoints.http_server, sglang.srt.multimodal.processors.qwen_vl, torchvision
from transformers.utils import is_torchvision_available
assert is_torchvision_available() and torchvision.__file__.startswith(sys.prefix), torchvision.__file__
' >&2
  date -u +%FT%TZ > "$dir/.complete"
}

ensure_vision_env() {  # ensure_vision_env VERSION — prints the overlay's python once it is complete
  local version=$1 base_py dir
  base_py=$(ensure_env "$version")
  dir=$(vision_dir "$version")
  if [ ! -f "$dir/.complete" ]; then
    exec 8>"$dir.lock"
    flock 8  # as ensure_env
    [ -f "$dir/.complete" ] || build_vision "$dir" "$base_py"
    exec 8>&-
  fi
  echo "$dir/bin/python"
}

is_vision_model() {  # is_vision_model MODELDIR
  grep -q '"vision_config"' "$1/config.json" 2>/dev/null
}

default_version=${THINKFLEET_REAL_SGLANG_VERSION:-0.5.9}
cmd=${1:-env}
case "$cmd" in
  env)
    ensure_env "${2:-$default_version}"
    ;;
  vision-env)
    ensure_vision_env "${2:-$default_version}"
    ;;
  model)
    [ $# -ge 3 ] || { echo "usage: $0 model TOKDIR OUT [qwen2|qwen3|qwen2vl [VOCAB]]" >&2; exit 2; }
    if [ "${4:-}" = qwen2vl ]; then
      py=$(ensure_vision_env "$default_version")  # it also checks that the processor loads
    else
      py=$(ensure_env "$default_version")
    fi
    args=(--tokenizer "$2" --out "$3" --arch "${4:-qwen2}")
    [ -n "${5:-}" ] && args+=(--vocab-size "$5")
    mkdir -p "$(dirname "$3")"
    exec 7>"$3.lock"
    flock 7  # another process building the same model: wait, then reuse it
    if [ -f "$3/.complete" ]; then echo "$3"; else "$py" -W ignore "$here/real_sglang/make_model.py" "${args[@]}"; fi
    ;;
  serve)
    [ $# -ge 3 ] || { echo "usage: $0 serve MODEL PORT [VERSION]" >&2; exit 2; }
    vision=()
    if is_vision_model "$2"; then
      py=$(ensure_vision_env "${4:-$default_version}")
      # The vision tower's attention: sdpa (0.5.9 picks it on a CPU anyway: layers/attention/vision.py; named so a
      # CUDA-only default in a later release cannot slip in). Not --disable-fast-image-processor: it makes the
      # processor load the slow Qwen2Tokenizer, which needs vocab.json/merges.txt (our tokenizers are
      # tokenizer.json only); the fast image processor runs on the CPU (base_processor.process_mm_data: device cpu).
      vision=(--mm-attention-backend sdpa)
    else
      py=$(ensure_env "${4:-$default_version}")
    fi
    # torch_native attention, no CUDA graphs, a 64k-token KV pool (else it takes 2 GB). Keep the warm-up:
    # without it the first forward takes ~28 s and /health answers 503 meanwhile.
    # A guest on a shared test box: one OpenMP thread, below the other tests' priority (THINKFLEET_REAL_SGLANG_NICE).
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} SGLANG_USE_CPU_ENGINE=1 exec nice -n "${THINKFLEET_REAL_SGLANG_NICE:-10}" \
      "$py" -m sglang.launch_server --model-path "$2" --device cpu \
      --attention-backend torch_native --disable-cuda-graph --host 127.0.0.1 --port "$3" \
      --mem-fraction-static 0.1 --max-total-tokens 65536 "${vision[@]}" ${THINKFLEET_REAL_SGLANG_ARGS:-}
    ;;
  *)
    echo "usage: $0 env|vision-env|model|serve …" >&2
    exit 2
    ;;
esac
