#!/bin/sh
# A private CA and a server certificate for the head node's Redis (TLS is optional: deploy/README.md).
#
#   sh deploy/make-tls-certs.sh DIR NAME [NAME…]    # NAME: how nodes reach the head, e.g. 10.0.0.10 head-01
#
# Writes into DIR (existing files are kept; delete them to re-issue):
#   redis_tls_ca.crt       the CA certificate: every client (nodes, producer) verifies the server with it
#   redis_tls_ca.key       the CA key: keep it off the head node once the certificate is issued
#   redis_tls_server.crt   the server certificate, valid for each NAME plus redis, localhost, 127.0.0.1
#   redis_tls_server.key   its key (0600; the Redis entrypoint copies it for the redis user)
set -eu
[ "$#" -ge 2 ] || {
    echo "usage: $0 DIR NAME [NAME…]" >&2
    exit 2
}
dir=$1
shift
days=${TLS_DAYS:-825}
mkdir -p "$dir"
chmod 700 "$dir"
[ -e "$dir/.gitignore" ] || printf '*\n' >"$dir/.gitignore"

san="DNS:redis,DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
    case "$name" in
        *[!0-9.]*) san="$san,DNS:$name" ;;
        *) san="$san,IP:$name" ;;
    esac
done

umask 077
if [ ! -s "$dir/redis_tls_ca.key" ]; then
    openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days "$days" -subj "/CN=thinkfleet redis CA" \
        -keyout "$dir/redis_tls_ca.key" -out "$dir/redis_tls_ca.crt" 2>/dev/null
    echo "created $dir/redis_tls_ca.crt"
fi
if [ ! -s "$dir/redis_tls_server.key" ]; then
    ext="$dir/.server.ext.$$"
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' "$san" >"$ext"
    openssl req -newkey rsa:3072 -nodes -sha256 -subj "/CN=thinkfleet redis" \
        -keyout "$dir/redis_tls_server.key" -out "$dir/.server.csr.$$" 2>/dev/null
    openssl x509 -req -sha256 -days "$days" -in "$dir/.server.csr.$$" -CA "$dir/redis_tls_ca.crt" \
        -CAkey "$dir/redis_tls_ca.key" -CAcreateserial -out "$dir/redis_tls_server.crt" -extfile "$ext" 2>/dev/null
    rm -f "$ext" "$dir/.server.csr.$$" "$dir/redis_tls_ca.srl"
    echo "created $dir/redis_tls_server.crt for $san"
fi
chmod 644 "$dir/redis_tls_ca.crt" "$dir/redis_tls_server.crt"
chmod 600 "$dir/redis_tls_ca.key" "$dir/redis_tls_server.key"
