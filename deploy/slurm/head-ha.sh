#!/usr/bin/env bash
# One task of head-ha.sbatch (srun, one per node): this node's Redis and Sentinel of the head that fails over.
#
# The Redis is the primary when its task is the one redis-ha/primary names (task 0 at the first start; after a
# failover, the rank the Sentinels promoted: their client-reconfig-script writes it), else a replica of that task's
# Redis. Its Sentinel monitors that primary with the others (quorum SENTINEL_QUORUM). Both configs are written at
# every start (addresses change when a requeued head lands on other nodes) and hold the password, so they are 0600;
# no password is on a command line. SIGTERM stops both (Redis fsyncs its AOF); the task ends when both have exited:
# a Sentinel outlives its own Redis's crash and keeps the quorum.
set -euo pipefail

shared="${THINKFLEET_SHARED_DIR:-$HOME/thinkfleet-shared}"
ha="$shared/redis-ha"
rank="${SLURM_PROCID:?run by head-ha.sbatch (one srun task per node)}"
tasks="${SLURM_NTASKS:-3}"
stride="${HEAD_PORT_STRIDE:-0}"
port=$((${REDIS_PORT:-6379} + rank * stride))
sport=$((${SENTINEL_PORT:-26379} + rank * stride))
addr="${REDIS_ADVERTISE:-$(hostname -I 2>/dev/null | awk '{print $1}')}"
addr="${addr:-$(hostname -f)}"
master="${SENTINEL_MASTER:-thinkfleet}"
redis_server="${REDIS_SERVER:-redis-server}"
dir="$ha/$rank"
log() { echo "[thinkfleet-head $rank $(date -u +%H:%M:%S)] $*" >&2; }

umask 077
mkdir -p "$dir"
pw="$(cat "$shared/redis_password")"
echo "$addr $port $sport" > "$ha/.addr.$rank.tmp" && mv "$ha/.addr.$rank.tmp" "$ha/addr.$rank"
for _ in $(seq 600); do
  [ "$(find "$ha" -maxdepth 1 -name 'addr.*' | wc -l)" -ge "$tasks" ] && break
  sleep 0.2
done
primary_rank="$(cat "$ha/primary" 2>/dev/null || echo 0)"
[ -r "$ha/addr.$primary_rank" ] || { log "no address of task $primary_rank (redis-ha/primary): task 0's"; primary_rank=0; }
read -r primary primary_port _ < "$ha/addr.$primary_rank"

{
  echo "port $port"
  echo "bind 0.0.0.0"
  echo "protected-mode yes"
  echo "dir $dir"
  echo "pidfile $dir/redis.pid"
  echo "appendonly yes"
  echo "appendfsync everysec"
  echo "maxmemory ${REDIS_MAXMEMORY:-24gb}"
  echo "maxmemory-policy noeviction"
  echo "requirepass $pw"
  echo "masterauth $pw"  # any Redis of the head may be a replica after a failover
  echo "replica-announce-ip $addr"
  # A primary cut off from both replicas refuses writes a failover would discard (NOREPLICAS: retried, handed back).
  echo "min-replicas-to-write 1"
  echo "min-replicas-max-lag 10"
  [ "$rank" = "$primary_rank" ] || echo "replicaof $primary $primary_port"
} > "$dir/redis.conf"

# After a failover, the Sentinels run this with MASTER ROLE STATE FROM_IP FROM_PORT TO_IP TO_PORT: the promoted
# task's rank goes to redis-ha/primary, where a requeued head reads which Redis holds the newest data.
cat > "$dir/reconfig.sh" <<RECONFIG
#!/bin/sh
for f in "$ha"/addr.*; do
  read -r a p s < "\$f" || continue
  if [ "\$a" = "\$6" ] && [ "\$p" = "\$7" ]; then
    echo "\${f##*.}" > "$ha/.primary.\$\$" && mv -f "$ha/.primary.\$\$" "$ha/primary"
  fi
done
exit 0
RECONFIG
chmod 700 "$dir/reconfig.sh"
{
  echo "port $sport"
  echo "bind 0.0.0.0"
  echo "dir $dir"
  echo "requirepass $pw"  # of every client; the Sentinels give it to each other too
  echo "sentinel resolve-hostnames yes"
  echo "sentinel announce-ip $addr"
  echo "sentinel monitor $master $primary $primary_port ${SENTINEL_QUORUM:-2}"
  echo "sentinel auth-pass $master $pw"
  echo "sentinel down-after-milliseconds $master ${SENTINEL_DOWN_AFTER_MS:-5000}"
  echo "sentinel failover-timeout $master ${SENTINEL_FAILOVER_TIMEOUT_MS:-60000}"
  echo "sentinel parallel-syncs $master 1"
  echo "sentinel client-reconfig-script $master $dir/reconfig.sh"
} > "$dir/sentinel.conf"

"$redis_server" "$dir/redis.conf" &
redis=$!
"$redis_server" "$dir/sentinel.conf" --sentinel &
sentinel=$!
trap 'kill -TERM "$redis" "$sentinel" 2>/dev/null' TERM INT
role="primary"
[ "$rank" = "$primary_rank" ] || role="replica of $primary:$primary_port"
log "redis $addr:$port ($role, AOF in $dir), sentinel $addr:$sport"
set +e
while kill -0 "$redis" 2>/dev/null || kill -0 "$sentinel" 2>/dev/null; do wait; done
log "redis and sentinel exited"
