#!/bin/sh
# Make the secrets of a thinkfleet fleet: one Redis password per role, the exporter's password map, and the
# key the producer signs work with.
#
#   sh deploy/make-secrets.sh [DIR]          # DIR defaults to secrets/ at the repository root
#
# Files (existing ones are kept, so a rerun never changes a password a node already has; delete a file
# to rotate it, then restart the head node's redis and the services using it):
#   redis_admin_password      operators only (redis-cli --user admin): the break-glass account
#   redis_producer_password   the producer host (THINKFLEET_REDIS_PASSWORD_FILE)
#   redis_worker_password     every GPU node (compose secret of the worker)
#   redis_flower_password     head node: Flower
#   redis_exporter_password   head node: the redis_exporter and Redis's healthcheck
#   redis_exporter_passwords.json  the same password in the exporter's own format ({"address": "password"})
#   redis_replica_password    a head that fails over (docker-compose.sentinel.yml): replication between its Redis
#   redis_sentinel_password   … and its Sentinels' user on each Redis
#   sentinel_client_password  … what its Sentinels require of their clients (THINKFLEET_REDIS_SENTINEL_PASSWORD_FILE)
#   signing_key               the producer host and every GPU node (THINKFLEET_SIGNING_KEY_FILE; compose secret of
#                             the worker): HMAC key of job records and messages (thinkfleet/signing.py). No Redis
#                             credential: whoever writes Redis without it cannot make a worker run anything.
#                             Never on the head node (Flower, the exporter and Redis don't need it).
#
# The head node needs the redis_* files; a GPU node only redis_worker_password and signing_key; the producer
# host only redis_producer_password and signing_key. The directory is made 0700 and ignores itself in git; the files are 0644 so
# the containers' non-root users (Flower, the worker, the exporter) can read their bind-mounted copy.
set -eu
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
dir=${1:-${SECRETS_DIR:-$here/../secrets}}
mkdir -p "$dir"
chmod 700 "$dir"
printf '*\n' >"$dir/.gitignore"

random_password() {
    if command -v openssl >/dev/null 2>&1; then
        openssl rand -hex 24
    else
        od -An -N24 -tx1 /dev/urandom | tr -d ' \n'
        echo
    fi
}

make_password() {  # make_password FILE — a random password, kept if FILE exists already
    if [ -s "$1" ]; then
        echo "kept    $1"
    else
        (umask 022 && random_password >"$1")
        echo "created $1"
    fi
    chmod 644 "$1"
}

for user in admin producer worker flower exporter replica sentinel; do
    make_password "$dir/redis_${user}_password"
done
# The Sentinels' own password (not a Redis user: Sentinel has one password for its clients).
make_password "$dir/sentinel_client_password"

# The signing key: 32 random bytes as hex (thinkfleet.signing.MIN_KEY_CHARS is 32 characters). Kept on a rerun
# like the passwords; to rotate it, see deploy/README.md §10 (THINKFLEET_SIGNING_KEY_PREVIOUS_FILE).
file="$dir/signing_key"
if [ -s "$file" ]; then
    echo "kept    $file"
else
    if command -v openssl >/dev/null 2>&1; then
        (umask 022 && openssl rand -hex 32 >"$file")
    else
        (umask 022 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$file" && echo >>"$file")
    fi
    echo "created $file"
fi
chmod 644 "$file"

# redis_exporter reads REDIS_PASSWORD_FILE as JSON: redis address (exactly as in REDIS_ADDR) → password.
pw=$(cat "$dir/redis_exporter_password")
printf '{"redis://redis:6379": "%s", "rediss://redis:6379": "%s"}\n' "$pw" "$pw" >"$dir/redis_exporter_passwords.json"
chmod 644 "$dir/redis_exporter_passwords.json"
echo "wrote   $dir/redis_exporter_passwords.json"
