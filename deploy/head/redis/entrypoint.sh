#!/bin/sh
# The head node's Redis entrypoint: render the ACL file from users.acl.template and the role passwords,
# then start redis-server with it (through the official image's docker-entrypoint.sh, which drops root).
#
#   entrypoint.sh redis-server [FLAGS…]        → redis-server [FLAGS…] --aclfile $REDIS_ACL_FILE [TLS flags]
#
# Environment (compose sets the first three; the rest have the defaults shown):
#   THINKFLEET_KEY_PREFIX (tf), THINKFLEET_QUEUE (thinkfleet), REDIS_DB (0)   substituted into the template
#   REDIS_SECRETS_DIR (/run/secrets)      redis_<user>_password for every user of the template but default
#   REDIS_ACL_TEMPLATE (next to this script), REDIS_ACL_FILE (/run/thinkfleet-redis/users.acl, a tmpfs)
#   REDIS_TLS_CERT_FILE, REDIS_TLS_KEY_FILE, REDIS_TLS_CA_FILE   set all three to serve TLS only
#   REDIS_LISTEN_PORT (6379)              the TLS port (plain TCP is then off)
#   REDIS_TLS_AUTH_CLIENTS (no)           "yes" to require client certificates as well as passwords
#   REDIS_HA (no)                         "yes": one Redis of a head that fails over (docker-compose.sentinel.yml):
#                                         the users of users.ha.acl.template too (replica, sentinel), and a config
#                                         file on the tmpfs with masteruser/masterauth (any Redis of the head may be a
#                                         replica after a failover), REDIS_REPLICAOF ("HOST PORT": start as a
#                                         replica of it), REDIS_ANNOUNCE_IP (the address replicas and Sentinels
#                                         reach it at), min-replicas-to-write REDIS_MIN_REPLICAS_TO_WRITE (1) with
#                                         min-replicas-max-lag REDIS_MIN_REPLICAS_MAX_LAG (10): a primary cut off
#                                         from every replica refuses writes a failover would discard
#
# It refuses to start (exit 1, naming the file and the fix) on a missing, empty, placeholder
# ("change-me…"), short (< 16 characters) or whitespace-containing password: the same rule the producer
# and the workers apply to their own (thinkfleet/settings.py).
set -eu

here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
template=${REDIS_ACL_TEMPLATE:-$here/users.acl.template}
secrets=${REDIS_SECRETS_DIR:-/run/secrets}
out=${REDIS_ACL_FILE:-/run/thinkfleet-redis/users.acl}
prefix=${THINKFLEET_KEY_PREFIX:-tf}
queue=${THINKFLEET_QUEUE:-thinkfleet}
db=${REDIS_DB:-0}

die() {
    echo "thinkfleet redis: $*" >&2
    [ -z "${tmp:-}" ] || rm -f "$tmp"
    exit 1
}

# Names go into glob patterns and a sed expression: plain characters only.
for pair in "THINKFLEET_KEY_PREFIX=$prefix" "THINKFLEET_QUEUE=$queue"; do
    case "${pair#*=}" in
        "" | *[!A-Za-z0-9_.:-]*) die "${pair%%=*} must be letters, digits and _.:- only, got '${pair#*=}'" ;;
    esac
done
case "$db" in "" | *[!0-9]*) die "REDIS_DB must be a number, got '$db'" ;; esac
[ -r "$template" ] || die "cannot read the ACL template $template"

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        printf '%s' "$1" | sha256sum | cut -d' ' -f1
    else
        printf '%s' "$1" | openssl dgst -sha256 -r | cut -d' ' -f1
    fi
}

password_hash() { # user → $hash: "#<sha256>" of its password file, after the same checks the clients apply
    # (not called in $(…): die must end the script, not a subshell)
    file="$secrets/redis_$1_password"
    fix="generate one with 'openssl rand -hex 24 > $file' (or run deploy/make-secrets.sh)"
    [ -r "$file" ] || die "no password for Redis user '$1': $file is missing or unreadable; $fix"
    pw=$(cat "$file")
    case "$pw" in
        "") die "the password in $file is empty; $fix" ;;
        *[[:space:]]*) die "the password in $file contains whitespace; $fix" ;;
    esac
    case "$(printf '%s' "$pw" | tr 'A-Z' 'a-z')" in
        *change-me*) die "the password in $file is the .env.example placeholder; $fix" ;;
    esac
    [ "${#pw}" -ge 16 ] || die "the password in $file has ${#pw} characters, fewer than 16; $fix"
    hash="#$(sha256 "$pw")"
}

emit() { # one logical rule → the ACL file
    [ -n "$1" ] || return 0
    set -- $1 # split on whitespace (no globbing of * below: set -f)
    [ "$1" = user ] || die "ACL template: a rule must start with 'user', got '$1'"
    name=$2
    rule=$(printf '%s' "$*" | sed -e "s/@PREFIX@/$prefix/g" -e "s/@QUEUE@/$queue/g" -e "s/@DB@/$db/g")
    if [ "$name" = default ]; then
        printf '%s\n' "$rule" >>"$tmp"
    else
        password_hash "$name"
        printf '%s on %s\n' "$rule" "$hash" >>"$tmp"
    fi
}

set -f
umask 077
mkdir -p "$(dirname -- "$out")"
tmp="$out.tmp.$$"
: >"$tmp"
render() { # a template file → its rules, one per line, into the ACL file
    rule=""
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in
            "" | "#"*) continue ;;
            " "* | "	"*) rule="$rule $line" ;;
            *)
                emit "$rule"
                rule=$line
                ;;
        esac
    done <"$1"
    emit "$rule"
}

render "$template"
if [ "${REDIS_HA:-no}" = yes ]; then
    render "${REDIS_HA_ACL_TEMPLATE:-$here/users.ha.acl.template}"
fi
set +f
mv -f "$tmp" "$out"
if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
    # The official image's entrypoint runs redis-server as "redis": it must be able to read the file.
    chown redis "$out" "$(dirname -- "$out")"
fi

[ "$#" -gt 0 ] || set -- redis-server
if [ "${REDIS_HA:-no}" = yes ]; then
    # masterauth must be the password itself: it goes into a config file on the tmpfs (0600), never argv.
    password_hash replica
    replication=$(dirname -- "$out")/replication.conf
    {
        echo "masteruser replica"
        echo "masterauth \"$pw\""
        [ -z "${REDIS_REPLICAOF:-}" ] || echo "replicaof ${REDIS_REPLICAOF}"
        [ -z "${REDIS_ANNOUNCE_IP:-}" ] || echo "replica-announce-ip ${REDIS_ANNOUNCE_IP}"
        echo "min-replicas-to-write ${REDIS_MIN_REPLICAS_TO_WRITE:-1}"
        echo "min-replicas-max-lag ${REDIS_MIN_REPLICAS_MAX_LAG:-10}"
    } >"$replication"
    if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
        chown redis "$replication"  # Sentinel's CONFIG REWRITE writes its role changes into it
    fi
    if [ "$1" = redis-server ]; then
        shift
        set -- redis-server "$replication" "$@"
    fi
fi
set -- "$@" --aclfile "$out"
if [ -n "${REDIS_TLS_CERT_FILE:-}" ]; then
    : "${REDIS_TLS_KEY_FILE:?set REDIS_TLS_KEY_FILE with REDIS_TLS_CERT_FILE}"
    : "${REDIS_TLS_CA_FILE:?set REDIS_TLS_CA_FILE with REDIS_TLS_CERT_FILE}"
    key=$REDIS_TLS_KEY_FILE
    if [ "$(id -u)" = 0 ] && id redis >/dev/null 2>&1; then
        # The key may be 0600 root on the host: hand redis-server its own copy on the tmpfs.
        key=$(dirname -- "$out")/tls.key
        cp "$REDIS_TLS_KEY_FILE" "$key"
        chown redis "$key"
        chmod 600 "$key"
    fi
    set -- "$@" --tls-port "${REDIS_LISTEN_PORT:-6379}" --port 0 \
        --tls-cert-file "$REDIS_TLS_CERT_FILE" --tls-key-file "$key" \
        --tls-ca-cert-file "$REDIS_TLS_CA_FILE" --tls-auth-clients "${REDIS_TLS_AUTH_CLIENTS:-no}"
fi
echo "thinkfleet redis: ACL for prefix '$prefix', queue '$queue', db $db written to $out" >&2
if [ "$1" = redis-server ] && command -v docker-entrypoint.sh >/dev/null 2>&1; then
    exec docker-entrypoint.sh "$@"
fi
exec "$@"
