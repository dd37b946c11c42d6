#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: a figure that does not move with
# the load on a shared machine, for comparing two commits where req/s and CPU time are too
# noisy to show a change of a few percent. Loopback only, bounded duration.
#
#   scripts/instructions.sh        # build, count each case, print a table
#
# Settings (environment):
#   DURATION=5       seconds of counted load per case     CONNECTIONS=8   wrk connections
#   SERVER_CPU=0     core for the servers                 LOAD_CPU=1      core for wrk
#   WARMUP=6         seconds of load before counting      RECORD_TTL=5s   ttl of new keys' records
#   CACHE=0          1: also simulate the data caches and count the misses per request
#   KEEP=            a directory: keep each case's callgrind dump there, for callgrind_annotate
#   STORE=memory     the gateway's store: memory or redb (a file in the run's directory)
#   IDEMGATE=        an idemgate binary to count instead of this build's (e.g. one built from
#                    an earlier commit: run the script twice to compare the two)
#
# With CACHE=1 callgrind simulates a 32 KiB first-level data cache and a 512 KiB, 8-way last
# level (this machine's second level per core, past which a load goes to the shared L3 or to
# memory) and the table adds the data misses of that last level per request, for
# memory-layout changes that instructions do not show. It moves more than the instruction
# count between runs (the store's size and the sweeps' timing follow callgrind's pace; see
# BENCHMARKS.md). Under callgrind the gateway serves a few hundred to a few thousand
# requests a second, so the memory store holds about RECORD_TTL times that many records.
#
# The warm-up runs under full instrumentation too (its counts are dumped and dropped before
# the measured run), so records are made at the measured pace from the start. With WARMUP
# at least RECORD_TTL, the memory store is at its steady size when counting starts and
# removes about as many expired records as new keys add; a warm-up without instrumentation
# runs several times faster, and the counted run would then also sweep its surplus.
#
# Cases: the benchmark upstream alone (a bare hyper server: the floor for any hyper-based
# proxy), and idemgate with the memory store for pass-through, new keys and replays. Only the
# measured server runs under callgrind; the count covers the load window only (instrumentation
# is switched on after a warm-up), divided by the requests the server counted.
#
# Valgrind's CPU has no SHA extensions, so sha2 runs its portable code there, many times the
# instructions of the SHA-NI code used on real machines: the table also gives the count
# outside SHA-256's compression function.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
NAME=instructions
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

DURATION=${DURATION:-5}
WARMUP=${WARMUP:-6}
RECORD_TTL=${RECORD_TTL:-5s}
CACHE=${CACHE:-0}
KEEP=${KEEP:-}
CONNECTIONS=${CONNECTIONS:-8}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}

[[ "$WARMUP" =~ ^[1-9][0-9]*$ ]] || die "WARMUP must be a whole number of seconds, not '$WARMUP'"
[[ "$CACHE" =~ ^[01]$ ]] || die "CACHE must be 0 or 1, not '$CACHE'"
[ -z "$KEEP" ] || mkdir -p "$KEEP" || die "cannot make the KEEP directory '$KEEP'"
need_tools valgrind:valgrind wrk:wrk taskset:util-linux

build_release
PIN=(taskset -c "$SERVER_CPU")
LOAD=(taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNECTIONS")
CALLGRIND=(valgrind -q --tool=callgrind --instr-atstart=no)
[ "$CACHE" = 1 ] && CALLGRIND+=(--cache-sim=yes --D1=32768,8,64 --LL=524288,8,64)

# Instructions in a callgrind dump: all of them, and those of the SHA-256 compression
# function with everything it calls (its largest inclusive count).
count() {
    callgrind_annotate --inclusive=yes --auto=no "$1" 2>/dev/null | awk '
        /PROGRAM TOTALS/ { gsub(",", "", $1); total = $1 }
        /:sha2::sha256::[^ ]* \[/ { gsub(",", "", $1); if ($1 + 0 > sha) sha = $1 + 0 }
        END { printf "%d %d\n", total, sha }'
}

# Last-level data misses (reads and writes) in a callgrind dump made with CACHE=1.
misses() {
    callgrind_annotate --auto=no --show=DLmr,DLmw "$1" 2>/dev/null | awk '
        /PROGRAM TOTALS/ { gsub(/\([^)]*\)/, ""); gsub(",", ""); print $1 + $2 }'
}

# A warm-up run of server PID against URL with SCRIPT, under instrumentation (at the pace of
# the measured run); measure() drops its counts.
warm_up() {
    local pid=$1 url=$2 script=$3
    callgrind_control -i on "$pid" >/dev/null 2>&1
    "${LOAD[@]}" -d"${WARMUP}s" -s "$ROOT/scripts/$script.lua" "$url" -- warm >/dev/null
}

# The first dump callgrind writes for PID from now (each dump holds the counts since the one
# before); waits for it.
next_dump() {
    local pid=$1 dump
    for _ in $(seq 1 50); do
        dump=$(ls "$TMP"/cg."$pid".* 2>/dev/null | head -1 || true)
        [ -n "$dump" ] && { echo "$dump"; return 0; }
        sleep 0.1
    done
    die "callgrind wrote no dump for pid $pid"
}

# Dumps and drops the warm-up's counts, counts one wrk run against URL with SCRIPT, then
# dumps; prints that dump (and keeps a copy named NAME.callgrind in KEEP, when set).
measure() {
    local pid=$1 url=$2 script=$3 out=$4 name=$5 dump
    callgrind_control -d "$pid" >/dev/null 2>&1
    rm -f "$(next_dump "$pid")"
    "${LOAD[@]}" -d"${DURATION}s" -s "$ROOT/scripts/$script.lua" "$url" -- "run$RANDOM" >"$out"
    callgrind_control -i off "$pid" >/dev/null 2>&1
    callgrind_control -d "$pid" >/dev/null 2>&1
    dump=$(next_dump "$pid")
    # In a dump after the first, callgrind 3.19 writes a wrong `summary:` line (a negative
    # count, printed as a number near 2^64); its `totals:` line holds the dump's counts, and
    # callgrind_annotate reads the summary.
    local totals
    totals=$(sed -n 's/^totals: //p' "$dump")
    [ -n "$totals" ] || die "callgrind dump $dump has no totals"
    sed -i "s/^summary: .*/summary: $totals/" "$dump"
    [ -z "$KEEP" ] || cp "$dump" "$KEEP/$name.callgrind"
    echo "$dump"
}

ROWS="$TMP/rows"
: >"$ROWS"
row() { # label requests dump
    read -r total sha < <(count "$3")
    [ "$2" -gt 0 ] || die "no requests counted for $1"
    local missed=""
    [ "$CACHE" = 1 ] && missed=$(awk -v m="$(misses "$3")" -v n="$2" 'BEGIN {printf "%.1f", m / n}')
    printf '%s\t%d\t%d\t%d\t%s\n' "$1" "$2" $((total / $2)) $(((total - sha) / $2)) "$missed" \
        >>"$ROWS"
    log "$(printf '%-26s %8d requests %8d instructions/request' "$1" "$2" $((total / $2)))"
}

# --- the upstream alone --------------------------------------------------------------------
"${PIN[@]}" "${CALLGRIND[@]}" --callgrind-out-file="$TMP/cg.%p" \
    "$BIN/examples/bench_upstream" 127.0.0.1:0 >"$TMP/floor.out" 2>&1 &
PIDS+=($!); FLOOR_PID=$!
FLOOR=$(wait_line "$TMP/floor.out" '^[0-9.]+:[0-9]+$' "the upstream under callgrind")
warm_up "$FLOOR_PID" "http://$FLOOR/v1/payments" post
dump=$(measure "$FLOOR_PID" "http://$FLOOR/v1/payments" post "$TMP/wrk-floor.out" upstream)
requests=$(awk '/requests in/ {print $1}' "$TMP/wrk-floor.out")
row "upstream alone (hyper)" "$requests" "$dump"
stop_pid "$FLOOR_PID"

# --- idemgate --------------------------------------------------------------------------------
STORE=${STORE:-memory}
IDEMGATE=${IDEMGATE:-$BIN/idemgate}
[ -x "$IDEMGATE" ] || die "IDEMGATE=$IDEMGATE is not an executable idemgate binary"
case $STORE in
memory) STORE_SPEC=memory ;;
redb) STORE_SPEC="redb:$TMP/records.redb" ;;
*) die "STORE=$STORE: memory or redb" ;;
esac
start_upstream "$SERVER_CPU"
write_gateway_config "$RECORD_TTL"

# Requests idemgate has answered so far, from its admin endpoint.
answered() {
    local body
    body=$(exec 3<>"/dev/tcp/${1%:*}/${1##*:}" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3)
    echo "$body" | awk '/^idemgate_requests_total/ {s += $NF} END {printf "%d\n", s}'
}

for case in "pass-through|/v1/payments|post" "new keys|/v1/payments|new_keys" \
    "replays|/replay/v1/payments|replays"; do
    IFS='|' read -r label path script <<<"$case"
    IDEMGATE_LOG=warn "${PIN[@]}" "${CALLGRIND[@]}" --callgrind-out-file="$TMP/cg.%p" \
        "$IDEMGATE" --config "$TMP/idemgate.toml" --listen 127.0.0.1:0 \
        --admin-listen 127.0.0.1:0 --store "$STORE_SPEC" >"$TMP/idemgate.out" 2>&1 &
    PIDS+=($!); pid=$!
    line=$(wait_line "$TMP/idemgate.out" '^idemgate listening on ' "idemgate under callgrind")
    gateway=$(echo "$line" | awk '{print $4}')
    admin=$(echo "$line" | awk '{print $6}')
    # The warm-up's requests are counted by idemgate but not by callgrind: read the counter
    # around the measured run only.
    warm_up "$pid" "http://$gateway$path" "$script"
    before=$(answered "$admin")
    dump=$(measure "$pid" "http://$gateway$path" "$script" "$TMP/wrk.out" "${label// /-}")
    after=$(answered "$admin")
    row "idemgate $label ($STORE)" $((after - before)) "$dump"
    stop_pid "$pid"
    rm -f "$TMP"/cg."$pid"*
done

# The misses' column only with CACHE=1 (the rows' fifth field is empty without it).
head="| case | requests counted | instructions / request | outside SHA-256 compression |"
rule="| --- | ---: | ---: | ---: |"
[ "$CACHE" = 1 ] && head+=" last-level data misses / request |" && rule+=" ---: |"
echo "$head"
echo "$rule"
awk -F'\t' '{printf "| %s | %d | %d | %d |%s\n", $1, $2, $3, $4, ($5 == "" ? "" : " " $5 " |")}' "$ROWS"
