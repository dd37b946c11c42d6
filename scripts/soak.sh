#!/usr/bin/env bash
# The memory soak: idemgate (memory store) under a stream of unique keys with a short ttl,
# its resident memory sampled as it goes. Loopback only, bounded duration.
#
#   scripts/soak.sh                  # 600 s, prints one line per sample and a summary
#
# Settings (environment):
#   DURATION=600     seconds of load          SAMPLE=10    seconds between RSS samples
#   RECORD_TTL=5s    ttl of the records       CONNECTIONS=64
#   SERVER_CPU=0     core for upstream and idemgate          LOAD_CPU=1   core for wrk
#
# It installs Debian's wrk when missing, builds the release binaries, starts the benchmark
# upstream and one idemgate on free loopback ports from a temporary directory, and stops only
# the processes it started.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
DURATION=${DURATION:-600}
SAMPLE=${SAMPLE:-10}
RECORD_TTL=${RECORD_TTL:-5s}
CONNECTIONS=${CONNECTIONS:-64}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}

NAME=soak
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

need_tools wrk:wrk taskset:util-linux

build_release
start_upstream "$SERVER_CPU"
IDEMGATE_LOG=warn taskset -c "$SERVER_CPU" "$BIN/idemgate" --listen 127.0.0.1:0 \
    --admin-listen 127.0.0.1:0 --upstream "http://$UPSTREAM" --store memory \
    --ttl "$RECORD_TTL" >"$TMP/idemgate.out" 2>&1 &
PIDS+=($!); GATEWAY_PID=$!
GATEWAY=$(wait_line "$TMP/idemgate.out" '^idemgate listening on ' "idemgate" | awk '{print $4}')

log "idemgate (memory store, ttl $RECORD_TTL) on $GATEWAY; ${DURATION}s of unique keys"
taskset -c "$LOAD_CPU" wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" -s "$ROOT/scripts/new_keys.lua" \
    "http://$GATEWAY/v1/payments" -- soak >"$TMP/wrk.out" 2>&1 &
WRK=$!
PIDS+=("$WRK")
samples=()
elapsed=0
while kill -0 "$WRK" 2>/dev/null && [ "$elapsed" -lt "$DURATION" ]; do
    sleep "$SAMPLE"
    elapsed=$((elapsed + SAMPLE))
    rss=$(rss_kib "$GATEWAY_PID")
    samples+=("$rss")
    printf '%4d s  RSS %7d KiB\n' "$elapsed" "$rss"
done
wait "$WRK" || die "wrk failed: $(cat "$TMP/wrk.out")"
forget_pid "$WRK"
grep -E 'requests in|Requests/sec|Non-2xx|Socket errors' "$TMP/wrk.out" || true

# Flat: the second half of the run never goes above the first half's highest sample.
n=${#samples[@]}
half=$((n / 2))
first_max=0; second_max=0; second_min=""
for i in "${!samples[@]}"; do
    v=${samples[$i]}
    if [ "$i" -lt "$half" ]; then
        [ "$v" -gt "$first_max" ] && first_max=$v
    else
        [ "$v" -gt "$second_max" ] && second_max=$v
        if [ -z "$second_min" ] || [ "$v" -lt "$second_min" ]; then second_min=$v; fi
    fi
done
printf 'first half: highest RSS %d KiB; second half: %d..%d KiB\n' "$first_max" "${second_min:-0}" "$second_max"
if [ "$second_max" -le "$first_max" ]; then
    echo "flat: the second half stayed within the first half's highest resident memory"
else
    echo "grew: the second half went $((second_max - first_max)) KiB above the first half's highest"
fi
