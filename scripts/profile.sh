#!/usr/bin/env bash
# Where the gateway's CPU goes under load: `perf record` on idemgate (with any store)
# while wrk drives one case, then the hottest symbols, user space and kernel together.
# Loopback only, bounded duration.
#
#   scripts/profile.sh                      # new keys, 8 s sampled, top 40 symbols
#   CASE=replays scripts/profile.sh         # or pass-through
#   STORE=redb scripts/profile.sh           # the embedded durable store, in a file under /tmp
#   CALL_GRAPH=1 scripts/profile.sh         # with call stacks (DWARF unwinding), for perf report -G
#
# Settings (environment):
#   CASE=new-keys    pass-through | new-keys | replays       TOP=40      symbols printed
#   STORE=memory     memory | redb | redis | redis-cluster | postgres (their servers on SERVER_CPU)
#   DURATION=8       seconds sampled                         WARMUP=7    seconds of load before
#   RECORD_TTL=5s    ttl of new keys' records                CONNECTIONS=64  THREADS=2
#   SERVER_CPU=0     core for upstream and idemgate          LOAD_CPU=1  core for wrk
#   FREQUENCY=2999   samples per second                      CALL_GRAPH=0
#   OUT=target/profile/CASE   where perf.data is kept (CASE-redb with STORE=redb), for
#                             `perf report -i` or `perf annotate -i`
#
# The warm-up is longer than the record ttl so the memory store has reached the size it keeps:
# sampled sooner, the profile shows its slab and index growing (page faults), which a
# long-running gateway does not pay. The same pinning as scripts/bench.sh. The per-request
# CPU figures are measured while perf samples, so they run a little above bench.sh's.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
CASE=${CASE:-new-keys}
DURATION=${DURATION:-8}
WARMUP=${WARMUP:-7}
RECORD_TTL=${RECORD_TTL:-5s}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
FREQUENCY=${FREQUENCY:-2999}
CALL_GRAPH=${CALL_GRAPH:-0}
TOP=${TOP:-40}
STORE=${STORE:-memory}
OUT=${OUT:-$ROOT/target/profile/$CASE$([ "$STORE" = memory ] || echo "-$STORE")}

NAME=profile
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

case "$CASE" in
    pass-through) path=/v1/payments; script=post ;;
    new-keys) path=/v1/payments; script=new_keys ;;
    replays) path=/replay/v1/payments; script=replays ;;
    *) die "CASE must be pass-through, new-keys or replays, not '$CASE'" ;;
esac
case "$STORE" in
    memory) spec=memory ;;
    redb) spec="redb:$TMP/records.redb" ;;
    redis | redis-cluster | postgres) ;;
    *) die "STORE must be memory, redb, redis, redis-cluster or postgres, not '$STORE'" ;;
esac
[[ "$DURATION" =~ ^[1-9][0-9]*$ ]] || die "DURATION must be a whole number of seconds, not '$DURATION'"
[[ "$WARMUP" =~ ^[1-9][0-9]*$ ]] || die "WARMUP must be a whole number of seconds, not '$WARMUP'"

need_tools perf:linux-perf wrk:wrk taskset:util-linux

build_release
case "$STORE" in
    redis) start_redis "$SERVER_CPU"; spec=$REDIS_URL ;;
    redis-cluster) start_redis_cluster "$SERVER_CPU"; spec=$CLUSTER_URL ;;
    postgres) start_postgres "$SERVER_CPU"; spec=$PG_URL ;;
esac
start_upstream "$SERVER_CPU"
write_gateway_config "$RECORD_TTL"
IDEMGATE_LOG=warn taskset -c "$SERVER_CPU" "$BIN/idemgate" --config "$TMP/idemgate.toml" \
    --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --store "$spec" >"$TMP/idemgate.out" 2>&1 &
PIDS+=($!); GATEWAY_PID=$!
GATEWAY=$(wait_line "$TMP/idemgate.out" '^idemgate listening on ' "idemgate" | awk '{print $4}')

LOAD=(taskset -c "$LOAD_CPU" wrk -t"$THREADS" -c"$CONNECTIONS" -s "$ROOT/scripts/$script.lua")
log "$CASE ($STORE store) on $GATEWAY: ${WARMUP}s of warm-up, then ${DURATION}s sampled"
"${LOAD[@]}" -d"${WARMUP}s" "http://$GATEWAY$path" -- "warm$RANDOM" >/dev/null

mkdir -p "$OUT"
RECORD=(perf record -q -F "$FREQUENCY" -p "$GATEWAY_PID" -o "$OUT/perf.data")
[ "$CALL_GRAPH" = 1 ] && RECORD+=(--call-graph "dwarf,8192")
read -r user0 sys0 < <(cpu_ticks "$GATEWAY_PID")
"${RECORD[@]}" -- sleep "$DURATION" >"$TMP/perf.out" 2>&1 &
PIDS+=($!); PERF_PID=$!
"${LOAD[@]}" -d"${DURATION}s" "http://$GATEWAY$path" -- "run$RANDOM" >"$TMP/wrk.out"
wait "$PERF_PID" || { cat "$TMP/perf.out" >&2; die "perf record failed"; }
forget_pid "$PERF_PID"
read -r user1 sys1 < <(cpu_ticks "$GATEWAY_PID")

requests=$(awk '/requests in/ {print $1}' "$TMP/wrk.out")
[ "${requests:-0}" -gt 0 ] || die "wrk completed no requests"
hz=$(getconf CLK_TCK)
per_request() { awk -v t="$1" -v hz="$hz" -v n="$requests" 'BEGIN {printf "%.1f", t * 1e6 / hz / n}'; }
echo "$CASE: $(awk '/Requests\/sec/ {print $2}' "$TMP/wrk.out") req/s;" \
    "gateway CPU per request: $(per_request $((user1 - user0))) µs user," \
    "$(per_request $((sys1 - sys0))) µs system"
echo
perf report -i "$OUT/perf.data" --no-children --sort dso,symbol --stdio 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | head -n "$TOP" | cut -c1-160
echo
log "samples kept in $OUT/perf.data (perf report -i / perf annotate -i)"
