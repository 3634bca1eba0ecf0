#!/bin/sh
# The head node's Redis healthcheck: PING as the exporter user (the default user is off), over TLS when
# the entrypoint serves TLS. The password travels in REDISCLI_AUTH, never on redis-cli's command line.
set -eu
REDISCLI_AUTH=$(cat "${REDIS_SECRETS_DIR:-/run/secrets}/redis_exporter_password")
export REDISCLI_AUTH
set -- redis-cli --no-auth-warning --user exporter -h 127.0.0.1 -p "${REDIS_LISTEN_PORT:-6379}"
if [ -n "${REDIS_TLS_CERT_FILE:-}" ]; then
    set -- "$@" --tls --cacert "$REDIS_TLS_CA_FILE"
    if [ "${REDIS_TLS_AUTH_CLIENTS:-no}" = yes ]; then
        set -- "$@" --cert "$REDIS_TLS_CERT_FILE" --key "${REDIS_TLS_KEY_COPY:-/run/thinkfleet-redis/tls.key}"
    fi
fi
[ "$("$@" ping)" = PONG ]
