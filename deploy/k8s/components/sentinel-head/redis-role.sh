#!/bin/sh
# One Redis of the head that fails over on Kubernetes (components/sentinel-head): decides at every start whether
# this Redis is the primary or a replica, then runs deploy/head/redis/entrypoint.sh with REDIS_HA=yes (the ACL users,
# masteruser/masterauth, min-replicas-to-write).
#
#   - The Sentinels name a primary (every start after the head's first): replicate it, or be it when they name us.
#     So a restarted old primary comes back as a replica of the Redis promoted meanwhile, never as a second
#     primary with older data (the rollback a blind "pod 0 is the primary" would cause).
#   - No Sentinel answers (the head's very first start; or every Sentinel down): REDIS_FIRST_PRIMARY is the
#     primary, the others replicate it. Should that ever be stale, the Sentinels, once back, demote it to a
#     replica of the primary they know, and no client reaches it meanwhile: clients ask the Sentinels.
#
# Environment:
#   REDIS_SELF (required)            this Redis's name as the others reach it (the pod's DNS name: redis-1.redis)
#   REDIS_FIRST_PRIMARY (required)   the primary when no Sentinel answers, HOST[:PORT] (redis-0.redis)
#   REDIS_PORT (6379)                the port this Redis serves and announces (and the first primary's by default)
#   HEAD_SENTINELS                   the Sentinels, HOST:PORT comma-separated (as in THINKFLEET_REDIS_URL)
#   SENTINEL_MASTER (thinkfleet), REDIS_SECRETS_DIR (/run/secrets: sentinel_client_password, when the
#   Sentinels require it), REDIS_ENTRYPOINT (entrypoint.sh next to this script)
set -eu

here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
self=${REDIS_SELF:?set REDIS_SELF to the name the other Redis servers and the Sentinels reach this one at}
first=${REDIS_FIRST_PRIMARY:?set REDIS_FIRST_PRIMARY to the Redis that is primary at the head first start}
port=${REDIS_PORT:-6379}
master=${SENTINEL_MASTER:-thinkfleet}
secrets=${REDIS_SECRETS_DIR:-/run/secrets}

named() { # the words a Sentinel answered → primary, primary_port when they are "HOST PORT"
    [ "$#" -eq 2 ] || return 1
    case "$2" in "" | *[!0-9]*) return 1 ;; esac
    primary=$1 primary_port=$2
}

primary=""
primary_port=""
if [ -r "$secrets/sentinel_client_password" ]; then
    REDISCLI_AUTH=$(cat "$secrets/sentinel_client_password") # in redis-cli's environment, never its argv
    export REDISCLI_AUTH
fi
for sentinel in $(printf '%s' "${HEAD_SENTINELS:-}" | tr ',' ' '); do
    found=$(redis-cli -h "${sentinel%:*}" -p "${sentinel##*:}" sentinel get-master-addr-by-name "$master" \
        2>/dev/null) || continue
    if named $found; then
        echo "thinkfleet redis: Sentinel $sentinel names $primary:$primary_port the primary" >&2
        break
    fi
done
unset REDISCLI_AUTH
if [ -z "$primary" ]; then
    primary=${first%:*} primary_port=$port
    case "$first" in *:*) primary_port=${first##*:} ;; esac
    echo "thinkfleet redis: no Sentinel answers: $first is the primary (the head's first start)" >&2
fi

export REDIS_HA=yes REDIS_ANNOUNCE_IP="$self"
if [ "$primary" = "$self" ] && [ "$primary_port" = "$port" ]; then
    unset REDIS_REPLICAOF
    echo "thinkfleet redis: $self:$port starts as the primary" >&2
else
    export REDIS_REPLICAOF="$primary $primary_port"
    echo "thinkfleet redis: $self:$port starts as a replica of $primary:$primary_port" >&2
fi
exec sh "${REDIS_ENTRYPOINT:-$here/entrypoint.sh}" "$@"
