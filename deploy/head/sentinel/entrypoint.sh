#!/bin/sh
# A Sentinel of a head that fails over (deploy/head/docker-compose.sentinel.yml, deploy/k8s/components/sentinel-head):
# writes sentinel.conf into $SENTINEL_DIR (a volume: Sentinel rewrites the file with what it learns — the current
# primary, the replicas, the other Sentinels, the epochs — so it is written only when absent, and a restarted
# Sentinel resumes from it), then runs `redis-server sentinel.conf --sentinel` through the official image's entrypoint.
#
# Environment:
#   SENTINEL_PRIMARY_HOST (required)   the Redis that is primary at the first start (a host name or address)
#   SENTINEL_PRIMARY_PORT (6379), SENTINEL_MASTER (thinkfleet: the name in THINKFLEET_REDIS_URL's ?master=)
#   SENTINEL_QUORUM (2)                Sentinels that must agree the primary is down (3 Sentinels: 2)
#   SENTINEL_DOWN_AFTER_MS (5000), SENTINEL_FAILOVER_TIMEOUT_MS (60000)
#   SENTINEL_ANNOUNCE_IP               the address the other Sentinels and the clients reach this one at
#                                      (behind Docker's NAT the container's own address is no use to them)
#   SENTINEL_ANNOUNCE_HOSTNAMES (no)   "yes": announce names, not addresses (Kubernetes: pods' DNS names outlive
#                                      their addresses); SENTINEL_ANNOUNCE_IP is then this Sentinel's name
#   SENTINEL_PEERS                     "HOST:PORT …" of the Sentinels (this one's own is skipped): a first start (no
#                                      sentinel.conf yet: a new volume) asks them for the primary, which may not be
#                                      SENTINEL_PRIMARY_HOST any more after a failover
#   SENTINEL_PORT (26379), SENTINEL_DIR (/data), REDIS_SECRETS_DIR (/run/secrets)
#
# Passwords, each from a file of $REDIS_SECRETS_DIR (deploy/make-secrets.sh), never on a command line:
#   redis_sentinel_password   the Redis user `sentinel` (users.ha.acl.template) this Sentinel logs in to the Redis
#                             servers as; where clients need a password, the Sentinels log in to each other as their
#                             own user `sentinel` with it
#   sentinel_client_password  what the Sentinels require of their clients (THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE):
#                             the default user, allowed only to ask who the primary is — a client cannot fail the
#                             head over, re-point it or read its passwords. Without the file the Sentinels answer
#                             anyone who reaches them (a warning says so).
# Both are written at every start (a rotated file takes effect on restart); sentinel.conf is 0600.
set -eu

secrets=${REDIS_SECRETS_DIR:-/run/secrets}
dir=${SENTINEL_DIR:-/data}
conf=$dir/sentinel.conf
master=${SENTINEL_MASTER:-thinkfleet}
primary=${SENTINEL_PRIMARY_HOST:?set SENTINEL_PRIMARY_HOST to the Redis that is primary at the first start}
primary_port=${SENTINEL_PRIMARY_PORT:-6379}

die() {
    echo "thinkfleet sentinel: $*" >&2
    exit 1
}

password() { # file → $pw, after the checks the Redis entrypoint applies
    [ -r "$1" ] || die "$1 is missing or unreadable; run deploy/make-secrets.sh"
    pw=$(cat "$1")
    case "$pw" in "" | *[[:space:]]* | *'"'*) die "the password in $1 is empty or holds whitespace or quotes" ;; esac
    [ "${#pw}" -ge 16 ] || die "the password in $1 has ${#pw} characters, fewer than 16"
}

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        printf '%s' "$1" | sha256sum | cut -d' ' -f1
    else
        printf '%s' "$1" | openssl dgst -sha256 -r | cut -d' ' -f1
    fi
}

case "$master" in "" | *[!A-Za-z0-9_.-]*) die "SENTINEL_MASTER must be letters, digits and _.- only, got '$master'" ;; esac
password "$secrets/redis_sentinel_password"
peer_pw=$pw
client_pw=""
if [ -e "$secrets/sentinel_client_password" ]; then
    password "$secrets/sentinel_client_password"
    client_pw=$pw
fi

# A first start in a cluster that already failed over: the primary is whoever the other Sentinels name now.
named() { # the words a peer answered → primary, primary_port when they are "HOST PORT"
    [ "$#" -eq 2 ] || return 1
    case "$2" in "" | *[!0-9]*) return 1 ;; esac
    primary=$1 primary_port=$2
}
if [ ! -s "$conf" ] && [ -n "${SENTINEL_PEERS:-}" ]; then
    # (in redis-cli's environment, never its argv; an empty REDISCLI_AUTH would send an empty AUTH)
    [ -z "$client_pw" ] || export REDISCLI_AUTH="$client_pw"
    for peer in $SENTINEL_PEERS; do
        [ "$peer" != "${SENTINEL_ANNOUNCE_IP:-}:${SENTINEL_PORT:-26379}" ] || continue # ourselves (one list for all)
        found=$(redis-cli -h "${peer%:*}" -p "${peer##*:}" sentinel get-master-addr-by-name "$master" 2>/dev/null) ||
            continue
        if named $found; then
            echo "thinkfleet sentinel: $peer names $primary:$primary_port the primary of $master" >&2
            break
        fi
    done
    unset REDISCLI_AUTH
fi
# Sentinel refuses to start on a name that does not resolve (yet: a pod's DNS record follows its start).
if command -v getent >/dev/null 2>&1; then
    i=0
    until getent hosts "$primary" >/dev/null 2>&1 || [ "$i" -ge 120 ]; do
        i=$((i + 1))
        sleep 1
    done
fi

mkdir -p "$dir"
umask 077
if [ ! -s "$conf" ]; then
    tmp="$conf.tmp.$$"
    {
        echo "port ${SENTINEL_PORT:-26379}"
        echo "dir $dir"
        echo "sentinel resolve-hostnames yes"
        [ "${SENTINEL_ANNOUNCE_HOSTNAMES:-no}" != yes ] || echo "sentinel announce-hostnames yes"
        [ -z "${SENTINEL_ANNOUNCE_IP:-}" ] || echo "sentinel announce-ip ${SENTINEL_ANNOUNCE_IP}"
        echo "sentinel monitor $master $primary $primary_port ${SENTINEL_QUORUM:-2}"
        echo "sentinel down-after-milliseconds $master ${SENTINEL_DOWN_AFTER_MS:-5000}"
        echo "sentinel failover-timeout $master ${SENTINEL_FAILOVER_TIMEOUT_MS:-60000}"
        echo "sentinel parallel-syncs $master 1"
    } >"$tmp"
    mv -f "$tmp" "$conf"
    echo "thinkfleet sentinel: $conf written (monitoring $master at $primary:$primary_port)" >&2
else
    echo "thinkfleet sentinel: resuming from $conf" >&2
fi
# The credentials, from the files as they are now: whatever an earlier start (or Sentinel's rewrite) left goes.
tmp="$conf.tmp.$$"
grep -v -e '^user ' -e '^sentinel auth-user ' -e '^sentinel auth-pass ' \
    -e '^sentinel sentinel-user ' -e '^sentinel sentinel-pass ' "$conf" >"$tmp" || true
{
    echo "sentinel auth-user $master sentinel"
    echo "sentinel auth-pass $master \"$peer_pw\""
    if [ -n "$client_pw" ]; then
        # Clients (redis-py's Sentinel, kombu's, redis-cli) ask who the primary is and nothing else.
        echo "user default on #$(sha256 "$client_pw") resetchannels -@all +ping +auth +hello" \
            "+sentinel|get-master-addr-by-name +sentinel|masters +sentinel|master +sentinel|sentinels" \
            "+sentinel|replicas +sentinel|slaves"
        echo "user sentinel on #$(sha256 "$peer_pw") allcommands allchannels"
        echo "sentinel sentinel-user sentinel"
        echo "sentinel sentinel-pass \"$peer_pw\""
    fi
} >>"$tmp"
mv -f "$tmp" "$conf"
[ -n "$client_pw" ] || echo "thinkfleet sentinel: WARNING: no $secrets/sentinel_client_password:" \
    "this Sentinel answers every client that reaches it (make one with deploy/make-secrets.sh)" >&2
if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
    chown -R redis "$dir"  # the image's entrypoint runs redis-server as "redis": it rewrites the file
fi
set -- redis-server "$conf" --sentinel "$@"
if command -v docker-entrypoint.sh >/dev/null 2>&1; then
    exec docker-entrypoint.sh "$@"
fi
exec "$@"
