#!/bin/sh
# A Sentinel of a head that fails over (deploy/head/docker-compose.sentinel.yml): writes sentinel.conf into
# $SENTINEL_DIR (a volume: Sentinel rewrites the file with what it learns — the current primary, the replicas, the
# other Sentinels, the epochs — so it is written only when absent, and a restarted Sentinel resumes from it), then
# runs `redis-server sentinel.conf --sentinel` through the official image's entrypoint.
#
# Environment:
#   SENTINEL_PRIMARY_HOST (required)   the Redis that is primary at the first start (a host name or address)
#   SENTINEL_PRIMARY_PORT (6379), SENTINEL_MASTER (thinkfleet: the name in THINKFLEET_REDIS_URL's ?master=)
#   SENTINEL_QUORUM (2)                Sentinels that must agree the primary is down (3 Sentinels: 2)
#   SENTINEL_DOWN_AFTER_MS (5000), SENTINEL_FAILOVER_TIMEOUT_MS (60000)
#   SENTINEL_ANNOUNCE_IP               the address the other Sentinels and the clients reach this one at
#                                      (behind Docker's NAT the container's own address is no use to them)
#   SENTINEL_PORT (26379), SENTINEL_DIR (/data), REDIS_SECRETS_DIR (/run/secrets)
# The Redis user `sentinel` (users.ha.acl.template) authenticates it to the Redis servers, with the password of
# $REDIS_SECRETS_DIR/redis_sentinel_password; the password never reaches a command line.
set -eu

secrets=${REDIS_SECRETS_DIR:-/run/secrets}
dir=${SENTINEL_DIR:-/data}
conf=$dir/sentinel.conf
master=${SENTINEL_MASTER:-thinkfleet}
primary=${SENTINEL_PRIMARY_HOST:?set SENTINEL_PRIMARY_HOST to the Redis that is primary at the first start}

die() {
    echo "thinkfleet sentinel: $*" >&2
    exit 1
}

case "$master" in "" | *[!A-Za-z0-9_.-]*) die "SENTINEL_MASTER must be letters, digits and _.- only, got '$master'" ;; esac
file=$secrets/redis_sentinel_password
[ -r "$file" ] || die "no password for the Redis user 'sentinel': $file is missing or unreadable; run deploy/make-secrets.sh"
pw=$(cat "$file")
case "$pw" in "" | *[[:space:]]* | *'"'*) die "the password in $file is empty or holds whitespace or quotes" ;; esac
[ "${#pw}" -ge 16 ] || die "the password in $file has ${#pw} characters, fewer than 16"

mkdir -p "$dir"
if [ ! -s "$conf" ]; then
    umask 077
    tmp="$conf.tmp.$$"
    {
        echo "port ${SENTINEL_PORT:-26379}"
        echo "dir $dir"
        echo "sentinel resolve-hostnames yes"
        [ -z "${SENTINEL_ANNOUNCE_IP:-}" ] || echo "sentinel announce-ip ${SENTINEL_ANNOUNCE_IP}"
        echo "sentinel monitor $master $primary ${SENTINEL_PRIMARY_PORT:-6379} ${SENTINEL_QUORUM:-2}"
        echo "sentinel down-after-milliseconds $master ${SENTINEL_DOWN_AFTER_MS:-5000}"
        echo "sentinel failover-timeout $master ${SENTINEL_FAILOVER_TIMEOUT_MS:-60000}"
        echo "sentinel parallel-syncs $master 1"
        echo "sentinel auth-user $master sentinel"
        echo "sentinel auth-pass $master \"$pw\""
    } >"$tmp"
    mv -f "$tmp" "$conf"
    echo "thinkfleet sentinel: $conf written (monitoring $master at $primary)" >&2
else
    echo "thinkfleet sentinel: resuming from $conf" >&2
fi
if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
    chown -R redis "$dir"  # the image's entrypoint runs redis-server as "redis": it rewrites the file
fi
set -- redis-server "$conf" --sentinel "$@"
if command -v docker-entrypoint.sh >/dev/null 2>&1; then
    exec docker-entrypoint.sh "$@"
fi
exec "$@"
