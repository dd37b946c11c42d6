#!/usr/bin/env bash
# The load benchmark: idemgate against a direct upstream and nginx, on loopback, in one run.
#
#   scripts/bench.sh            # build, run every case, print the table, update BENCHMARKS.md
#
# Settings (environment):
#   DURATION=10      seconds per measured run          REPEATS=5    runs per case (interleaved)
#   CONNECTIONS=64   wrk connections                   THREADS=2    wrk threads
#   WARMUP=2         seconds of warm-up per case
#   STORES="memory redb redis redis-cluster postgres"   the stores measured, a gateway each;
#                    also "redis-cluster-wait" (the cluster with store_wait_replicas = 1)
#   SERVER_CPU=0     core for upstream, nginx, idemgate, redis-server (the cluster's six too)
#                    and PostgreSQL
#   LOAD_CPU=1       core for wrk
#   CARGO_FLAGS=     extra flags for the release build (e.g. --no-default-features --features proxy,redis)
#   WRITE=1          write the results into BENCHMARKS.md (0: print only)
#   SETTLE_MAX=20    most seconds to wait, before each run, for the servers to go quiet
#   RECORD_TTL=5s    ttl of the new keys' records
#   BASELINE=        another idemgate binary (e.g. built from an earlier commit) to run beside
#                    this build: a second gateway per store, measured in the same rounds, and a
#                    table of this build ÷ the baseline, case by case
#   BASELINE_STORES= the stores the baseline runs with (default: STORES; an older build may
#                    lack a store)
#
# It installs Debian's nginx and wrk when missing (redis-server and PostgreSQL through
# .ci/install-deps),
# starts everything it measures on free loopback ports from a temporary directory, and stops
# only the processes it started.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)

DURATION=${DURATION:-10}
REPEATS=${REPEATS:-5}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-2}
WARMUP=${WARMUP:-2}
STORES=${STORES:-memory redb redis redis-cluster postgres}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
CARGO_FLAGS=${CARGO_FLAGS:-}
WRITE=${WRITE:-1}
SETTLE_MAX=${SETTLE_MAX:-20}
# Records of the new-keys cases expire quickly, so memory stays bounded however fast they come.
RECORD_TTL=${RECORD_TTL:-5s}
BASELINE=${BASELINE:-}
BASELINE_STORES=${BASELINE_STORES:-$STORES}

NAME=bench
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"

need_tools wrk:wrk nginx:nginx taskset:util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
case " $STORES " in *" redis"* | *" postgres "*) bash .ci/install-deps >/dev/null ;; esac

if [ "$(nproc)" -lt 2 ]; then
    die "needs at least 2 cores (one for the servers, one for wrk); this machine has $(nproc)"
fi

# --- build ---------------------------------------------------------------------------------
# shellcheck disable=SC2086 # CARGO_FLAGS is a list of flags
build_release $CARGO_FLAGS

# Started as `"${PIN[@]}" cmd &` (not in `$(…)`, which would fork a shell), so `$!` is the
# server's own pid: taskset execs it.
PIN=(taskset -c "$SERVER_CPU")

JSON='{"id":"pay_8e03978e40d543e8","object":"payment","amount":2000,"currency":"eur","status":"succeeded","customer":"cus_9s6XKzkNRiz8i3","created":1700000000,"livemode":false,"metadata":{"order":"6735"}}'

# --- upstream --------------------------------------------------------------------------------
start_upstream "$SERVER_CPU"
log "upstream on $UPSTREAM"

# --- nginx: keep-alive reverse proxy and a static reply --------------------------------------
NGINX_PROXY_PORT=$(free_port)
NGINX_STATIC_PORT=$(free_port)
mkdir -p "$TMP/nginx/logs" "$TMP/nginx/tmp"
cat >"$TMP/nginx/nginx.conf" <<EOF
daemon off;
worker_processes 1;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $TMP/nginx/tmp/body;
    proxy_temp_path $TMP/nginx/tmp/proxy;
    fastcgi_temp_path $TMP/nginx/tmp/fastcgi;
    uwsgi_temp_path $TMP/nginx/tmp/uwsgi;
    scgi_temp_path $TMP/nginx/tmp/scgi;
    keepalive_requests 1000000;
    upstream app {
        server $UPSTREAM;
        keepalive 128;
    }
    server {
        listen 127.0.0.1:$NGINX_PROXY_PORT;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
    server {
        listen 127.0.0.1:$NGINX_STATIC_PORT;
        location / {
            default_type application/json;
            return 200 '$JSON';
        }
    }
}
EOF
"${PIN[@]}" "$NGINX" -p "$TMP/nginx" -c "$TMP/nginx/nginx.conf" -e "$TMP/nginx/logs/error.log" \
    >"$TMP/nginx/out.log" 2>&1 &
PIDS+=($!); NGINX_PID=$!
wait_port "$NGINX_PROXY_PORT" nginx
wait_port "$NGINX_STATIC_PORT" nginx
# The worker does the work; its CPU time is what we compare.
NGINX_WORKER=$(pgrep -P "$NGINX_PID" | head -1)
[ -n "$NGINX_WORKER" ] || die "nginx started no worker"
log "nginx proxy on $NGINX_PROXY_PORT, static on $NGINX_STATIC_PORT"

# --- the shared stores' servers ----------------------------------------------------------------
CLUSTER_PIDS=()
case " $STORES " in *" redis "*) start_redis "$SERVER_CPU"; log "redis-server: $REDIS_URL" ;; esac
case " $STORES " in *" redis-cluster "* | *" redis-cluster-wait "*) start_redis_cluster "$SERVER_CPU"; log "redis cluster: $CLUSTER_URL" ;; esac
case " $STORES " in *" postgres "*) start_postgres "$SERVER_CPU"; log "postgres: $PG_URL" ;; esac

# --- idemgate, one per store -------------------------------------------------------------------
# New keys expire after RECORD_TTL (bounded memory at any rate); the 16 replayed keys live
# under their own route for the whole run, so every measured replay finds its record.
write_gateway_config "$RECORD_TTL"
declare -A GATEWAY GATEWAY_PID
# start_gateway KEY BINARY STORE: one gateway, its address in GATEWAY[KEY].
start_gateway() {
    local key=$1 bin=$2 store=$3 spec config="$TMP/idemgate.toml"
    case $store in
    memory) spec=memory ;;
    redb) spec="redb:$TMP/records-$key.redb" ;;
    redis) spec=$REDIS_URL ;;
    redis-cluster) spec=$CLUSTER_URL ;;
    redis-cluster-wait) spec=$CLUSTER_URL config="$TMP/idemgate-wait.toml"
        # A top-level key: before the file's [[routes]] tables.
        { echo "store_wait_replicas = 1"; cat "$TMP/idemgate.toml"; } >"$config" ;;
    postgres) spec=$PG_URL ;;
    *) die "unknown store $store (memory, redb, redis, redis-cluster, redis-cluster-wait, postgres)" ;;
    esac
    IDEMGATE_LOG=warn "${PIN[@]}" "$bin" --config "$config" \
        --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream "http://$UPSTREAM" \
        --store "$spec" >"$TMP/idemgate-$key.out" 2>&1 &
    PIDS+=($!); GATEWAY_PID[$key]=$!
    line=$(wait_line "$TMP/idemgate-$key.out" '^idemgate listening on ' "idemgate $key")
    GATEWAY[$key]=$(echo "$line" | awk '{print $4}')
    log "idemgate $key on ${GATEWAY[$key]}"
}
if [ -n "$BASELINE" ]; then
    [ -x "$BASELINE" ] || die "BASELINE=$BASELINE is not an executable idemgate binary"
    # The two builds share a Redis or PostgreSQL server: their new keys differ per run, and
    # the replayed keys' records are the same requests' either way.
    log "baseline and this build share the shared stores' servers; new keys differ per run"
fi
# Whether the baseline runs with store $1.
baseline_has() { [ -n "$BASELINE" ] && case " $BASELINE_STORES " in *" $1 "*) true ;; *) false ;; esac; }
for store in $STORES; do
    start_gateway "$store" "$BIN/idemgate" "$store"
    ! baseline_has "$store" || start_gateway "base_$store" "$BASELINE" "$store"
done

# --- cases -----------------------------------------------------------------------------------
# name|label|url|script|pid whose CPU is measured
CASES=(
    "direct|direct upstream|http://$UPSTREAM/v1/payments|post|$UPSTREAM_PID"
    "nginx_proxy|nginx pass-through|http://127.0.0.1:$NGINX_PROXY_PORT/v1/payments|post|$NGINX_WORKER"
    "nginx_static|nginx return 200|http://127.0.0.1:$NGINX_STATIC_PORT/v1/payments|post|$NGINX_WORKER"
)
first_store=${STORES%% *}
CASES+=("pass|idemgate pass-through|http://${GATEWAY[$first_store]}/v1/payments|post|${GATEWAY_PID[$first_store]}")
! baseline_has "$first_store" || CASES+=("base_pass|baseline pass-through|http://${GATEWAY[base_$first_store]}/v1/payments|post|${GATEWAY_PID[base_$first_store]}")
for store in $STORES; do
    keys=("$store")
    ! baseline_has "$store" || keys+=("base_$store")
    for key in "${keys[@]}"; do
        prefix=${key%"$store"}
        label=${prefix:+baseline }
        CASES+=("${prefix}new_$store|${label}new keys, $store|http://${GATEWAY[$key]}/v1/payments|new_keys|${GATEWAY_PID[$key]}")
        CASES+=("${prefix}replay_$store|${label}replays, $store|http://${GATEWAY[$key]}/replay/v1/payments|replays|${GATEWAY_PID[$key]}")
    done
done

# CPU ticks (user + system) a process has used so far.
busy_ticks() { cpu_ticks "$1" | awk '{print $1 + $2}'; }
TCK=$(getconf CLK_TCK)
# Ticks the hypervisor has taken from the servers' core so far (its "steal" time: the core was
# running something else of the host's while this machine had work for it); 0 on bare metal.
steal_ticks() { awk -v cpu="cpu$SERVER_CPU" '$1 == cpu {print $9 + 0}' /proc/stat; }

# Every server process whose leftover work could spill into the next case.
SERVER_PIDS="$UPSTREAM_PID $NGINX_WORKER ${REDIS_PID:-} ${CLUSTER_PIDS[*]} ${PG_PID:-} ${GATEWAY_PID[*]}"

RESULTS="$TMP/results.tsv"
: >"$RESULTS"

# RECORD_TTL in whole seconds, rounded up: the wait for a new-keys case's records to expire.
case "$RECORD_TTL" in
    *ms) RECORD_TTL_SECS=$(( (${RECORD_TTL%ms} + 999) / 1000 )) ;;
    *s) RECORD_TTL_SECS=${RECORD_TTL%s} ;;
    *m) RECORD_TTL_SECS=$(( ${RECORD_TTL%m} * 60 )) ;;
    *) die "RECORD_TTL must be given in ms, s or m (for example 5s), not $RECORD_TTL" ;;
esac
case "$RECORD_TTL_SECS" in '' | *[!0-9]*) die "RECORD_TTL is not a whole number of ms, s or m: $RECORD_TTL" ;; esac
# When the records the last new-keys case wrote have all expired (epoch seconds).
RECORDS_EXPIRE_AT=0

# CPU ticks so far of the servers and their children: PostgreSQL's backends, autovacuum and
# checkpointer are the postmaster's children.
servers_busy_ticks() {
    local pid ticks total=0 parents
    parents=$(echo $SERVER_PIDS | tr -s ' ' ',')
    for pid in $SERVER_PIDS $(pgrep -P "$parents" 2>/dev/null || true); do
        ticks=$(busy_ticks "$pid" 2>/dev/null) || ticks=0
        total=$((total + ${ticks:-0}))
    done
    echo "$total"
}

# Waits until the records an earlier new-keys case wrote have expired, then (at most
# SETTLE_MAX seconds) until the servers are quiet: expired records swept and redis keys
# expired, so no case pays for the work an earlier one left behind (see BENCHMARKS.md, Method).
settle() {
    local total before after until_expired
    until_expired=$((RECORDS_EXPIRE_AT - $(date +%s)))
    [ "$until_expired" -le 0 ] || sleep "$until_expired"
    for _ in $(seq 1 $((SETTLE_MAX * 2))); do
        before=$(servers_busy_ticks)
        sleep 0.5
        after=$(servers_busy_ticks)
        total=$((after - before))
        # Under 4 % of a core over the half second.
        if [ $((total * 100 * 2)) -le $((TCK * 4)) ]; then return 0; fi
    done
    log "servers still busy after ${SETTLE_MAX}s; measuring anyway"
}

# run CASE DURATION RUN_ID [record]
run_case() {
    local spec=$1 secs=$2 run=$3 record=${4:-}
    local name label url script pid
    IFS='|' read -r name label url script pid <<<"$spec"
    settle
    local before after stolen_before stolen_after out
    before=$(busy_ticks "$pid")
    stolen_before=$(steal_ticks)
    out=$(taskset -c "$LOAD_CPU" wrk -t"$THREADS" -c"$CONNECTIONS" -d"${secs}s" --latency \
        -s "$ROOT/scripts/$script.lua" "$url" -- "$run-$name" 2>&1) || die "wrk failed on $label: $out"
    [ "$script" != new_keys ] || RECORDS_EXPIRE_AT=$(($(date +%s) + RECORD_TTL_SECS + 1))
    stolen_after=$(steal_ticks)
    after=$(busy_ticks "$pid")
    [ -n "$record" ] || return 0
    local rps p50 p99 p999 total errors cpu_us rss stolen
    rps=$(echo "$out" | awk '/^Requests\/sec:/ {print $2}')
    # The scripts' done() prints the percentiles in µs, unrounded, p99.9 included.
    read -r p50 p99 p999 < <(echo "$out" | awk '$1 == "tail_us" {printf "%.3f %.3f %.3f\n", $2 / 1000, $3 / 1000, $4 / 1000}')
    [ -n "$p999" ] || die "wrk printed no tail percentiles on $label: $out"
    total=$(echo "$out" | awk '/requests in/ {print $1}')
    errors=$(echo "$out" | awk '/Non-2xx or 3xx responses:/ {n += $NF} /Socket errors:/ {gsub(",", ""); n += $4 + $6 + $8 + $10} END {print n + 0}')
    cpu_us=$(awk -v a="$after" -v b="$before" -v t="$TCK" -v n="$total" 'BEGIN { printf "%.2f", (n > 0) ? (a - b) * 1e6 / t / n : 0 }')
    rss=$(rss_kib "$pid")
    # The share of the run's wall time the servers' core was taken by the hypervisor.
    stolen=$(awk -v a="$stolen_after" -v b="$stolen_before" -v t="$TCK" -v s="$secs" 'BEGIN { printf "%.1f", (a - b) * 100 / t / s }')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rps" "$p50" "$p99" "$cpu_us" "$errors" "$total" "$rss" "$stolen" "$p999" >>"$RESULTS"
    log "$(printf '%-24s run %s: %9.0f req/s  p50 %6.3f ms  p99 %7.3f ms  p99.9 %7.3f ms  %6.2f us/req CPU  %4.1f %% stolen  %s errors' "$label" "$run" "$rps" "$p50" "$p99" "$p999" "$cpu_us" "$stolen" "$errors")"
}

log "warm-up: ${WARMUP}s per case"
for spec in "${CASES[@]}"; do run_case "$spec" "$WARMUP" warmup; done
for r in $(seq 1 "$REPEATS"); do
    log "round $r of $REPEATS: ${DURATION}s per case"
    for spec in "${CASES[@]}"; do run_case "$spec" "$DURATION" "r$r" record; done
done

# --- report ----------------------------------------------------------------------------------
# The median of a list of numbers, one per line on stdin.
median_of() {
    sort -g | awk '{v[NR] = $1} END { if (NR == 0) print 0; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# Medians over the repeats, per case and column.
median() { # name column
    awk -F'\t' -v n="$1" -v c="$2" '$1 == n {print $c}' "$RESULTS" | median_of
}
sum_col() { awk -F'\t' -v n="$1" -v c="$2" '$1 == n {s += $c} END {print s + 0}' "$RESULTS"; }

declare -A RPS
for spec in "${CASES[@]}"; do
    IFS='|' read -r name _ <<<"$spec"
    RPS[$name]=$(median "$name" 2)
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f×", a / b; else print "–" }'; }
# One column of a case's runs, in order, comma-separated.
by_run() { # name column
    awk -F'\t' -v n="$1" -v c="$2" '$1 == n { printf "%s%s", (k++ ? ", " : ""), $c }' "$RESULTS"
}
# The ratio of two cases within each round, one per line, in order: both ran within the same
# two minutes on the machine.
round_ratios() { # name base [column: 2 req/s (default), 4 p99]
    local c=${3:-2}
    paste <(awk -F'\t' -v n="$1" -v c="$c" '$1 == n {print $c}' "$RESULTS") \
        <(awk -F'\t' -v n="$2" -v c="$c" '$1 == n {print $c}' "$RESULTS") |
        awk -F'\t' '{ printf "%.4f\n", ($2 > 0 ? $1 / $2 : 0) }'
}
by_round() { round_ratios "$@" | awk '{ printf "%s%.2f×", (NR > 1 ? ", " : ""), $1 }'; }
# Whether case $1 was measured.
has() { [ -n "${RPS[$1]:-}" ]; }

CPU_MODEL=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)
MACHINE="$(nproc) cores, ${CPU_MODEL:-unknown CPU}, Linux $(uname -r)"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || COMMIT="$COMMIT (with local changes)"

REPORT="$TMP/report.md"
{
    echo "Run on $MACHINE at commit $COMMIT."
    echo "wrk: $CONNECTIONS connections, $THREADS threads, pinned to core $LOAD_CPU; upstream, nginx (1 worker), idemgate and"
    echo "the stores' servers pinned to core $SERVER_CPU. Each case: median of $REPEATS interleaved runs of ${DURATION} s (after a ${WARMUP} s warm-up)."
    echo "Record ttl ${RECORD_TTL}. CPU is the user+system time of the serving process (the upstream, the nginx worker, or idemgate) per request."
    echo
    echo "Stolen is the share of each run's time the hypervisor took core $SERVER_CPU for other work (steal time, by run)."
    echo
    echo "| case | req/s | p50 ms | p99 ms | p99.9 ms | CPU µs/req | RSS MiB | × nginx pass-through | × direct upstream | errors | stolen % |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for spec in "${CASES[@]}"; do
        IFS='|' read -r name label _ <<<"$spec"
        printf '| %s | %.0f | %.2f | %.2f | %.2f | %.1f | %.0f | %s | %s | %s | %s |\n' "$label" "${RPS[$name]}" \
            "$(median "$name" 3)" "$(median "$name" 4)" "$(median "$name" 10)" "$(median "$name" 5)" \
            "$(awk -v k="$(median "$name" 8)" 'BEGIN {print k / 1024}')" \
            "$(ratio "${RPS[$name]}" "${RPS[nginx_proxy]}")" "$(ratio "${RPS[$name]}" "${RPS[direct]}")" \
            "$(sum_col "$name" 6)" "$(by_run "$name" 9)"
    done
    echo
    echo "Each target is judged on the median of its ratio within each round (\"by round\", in order): the two"
    echo "cases of a round ran within the same two minutes, so a slow stretch of the machine slows both. The"
    echo "ratio of the two cases' medians (the table above) is given beside it; those medians can come from"
    echo "different rounds."
    echo
    echo "| target (issue 5) | median by round | by round | ratio of medians | target | met |"
    echo "| --- | ---: | ---: | ---: | ---: | --- |"
    target() { # label case base goal
        local r
        r=$(round_ratios "$2" "$3" | median_of | awk '{ printf "%.2f", $1 }')
        printf '| %s | %s× | %s | %s | ≥ %s× | %s |\n' "$1" "$r" "$(by_round "$2" "$3")" \
            "$(ratio "${RPS[$2]}" "${RPS[$3]}")" "$4" \
            "$(awk -v r="$r" -v g="$4" 'BEGIN { print (r >= g) ? "yes" : "**no**" }')"
    }
    target "pass-through ÷ nginx pass-through" pass nginx_proxy 1.0
    ! has new_memory || target "new keys, memory ÷ nginx pass-through" new_memory nginx_proxy 0.9
    ! has replay_memory || target "replays, memory ÷ nginx return 200" replay_memory nginx_static 0.8
    ! has new_redb || ! has new_memory || target "new keys, redb ÷ new keys, memory" new_redb new_memory 0.5
    ! has new_redis || target "new keys, redis ÷ nginx pass-through" new_redis nginx_proxy 0.35
    ! has replay_redis || target "replays, redis ÷ nginx pass-through" replay_redis nginx_proxy 0.7
    ! has new_postgres || ! has new_redis || target "new keys, postgres ÷ new keys, redis" new_postgres new_redis 0.5
    ! has replay_postgres || ! has replay_redis || target "replays, postgres ÷ replays, redis" replay_postgres replay_redis 0.6
    if has new_redis-cluster && has new_redis; then
        echo
        echo "Redis Cluster beside single Redis (reported, no target): the cluster's six nodes share core $SERVER_CPU."
        echo
        echo "| case | median by round | by round | CPU µs/req, cluster / single |"
        echo "| --- | ---: | ---: | ---: |"
        for kind in new replay; do
            printf '| %s | %s× | %s | %.1f / %.1f |\n' "$kind, redis-cluster ÷ $kind, redis" \
                "$(round_ratios "${kind}_redis-cluster" "${kind}_redis" | median_of | awk '{ printf "%.2f", $1 }')" \
                "$(by_round "${kind}_redis-cluster" "${kind}_redis")" \
                "$(median "${kind}_redis-cluster" 5)" "$(median "${kind}_redis" 5)"
        done
    fi
    if has new_redis-cluster-wait && has new_redis-cluster; then
        echo
        echo "The cost of store_wait_replicas = 1 on the cluster (reported, no target): WAIT 1 after each claim that takes a key."
        echo
        echo "| case | median by round | by round | CPU µs/req, with WAIT / without |"
        echo "| --- | ---: | ---: | ---: |"
        for kind in new replay; do
            printf '| %s | %s× | %s | %.1f / %.1f |\n' "$kind, redis-cluster-wait ÷ $kind, redis-cluster" \
                "$(round_ratios "${kind}_redis-cluster-wait" "${kind}_redis-cluster" | median_of | awk '{ printf "%.2f", $1 }')" \
                "$(by_round "${kind}_redis-cluster-wait" "${kind}_redis-cluster")" \
                "$(median "${kind}_redis-cluster-wait" 5)" "$(median "${kind}_redis-cluster" 5)"
        done
    fi
    echo
    echo "Tail targets: a case's p99 ÷ nginx pass-through's p99 within each round, the median of the rounds,"
    echo "at $CONNECTIONS connections (lower is better). p99.9 is reported beside it, the same way."
    echo
    echo "| tail target | p99 median by round | p99 by round | p99.9 median by round | target | met |"
    echo "| --- | ---: | ---: | ---: | ---: | --- |"
    tail_target() { # label case [goal; without one the row is reported, not judged]
        local r goal=${3:-} verdict=–
        r=$(round_ratios "$2" nginx_proxy 4 | median_of | awk '{ printf "%.2f", $1 }')
        [ -z "$goal" ] || verdict=$(awk -v r="$r" -v g="$goal" 'BEGIN { print (r <= g) ? "yes" : "**no**" }')
        printf '| %s | %s× | %s | %s× | %s | %s |\n' "$1" "$r" "$(by_round "$2" nginx_proxy 4)" \
            "$(round_ratios "$2" nginx_proxy 10 | median_of | awk '{ printf "%.2f", $1 }')" \
            "${goal:+≤ ${goal}×}" "$verdict"
    }
    tail_target "idemgate pass-through" pass
    for store in $STORES; do
        case $store in memory) goal=1.5 ;; redb | redis) goal=2 ;; *) goal= ;; esac
        tail_target "new keys, $store" "new_$store" "$goal"
    done
    for store in $STORES; do tail_target "replays, $store" "replay_$store" 1; done
    if [ -n "$BASELINE" ]; then
        echo
        echo "This build against the baseline ($BASELINE), judged the same way: within 5 % means ≥ 0.95×."
        echo
        echo "| this build ÷ baseline | median by round | by round | ratio of medians | CPU µs/req, this build / baseline | within 5 % |"
        echo "| --- | ---: | ---: | ---: | ---: | --- |"
        for spec in "${CASES[@]}"; do
            IFS='|' read -r name label _ <<<"$spec"
            case $name in base_* | direct | nginx_*) continue ;; esac
            has "base_$name" || continue
            r=$(round_ratios "$name" "base_$name" | median_of | awk '{ printf "%.2f", $1 }')
            printf '| %s | %s× | %s | %s | %.1f / %.1f | %s |\n' "$label" "$r" "$(by_round "$name" "base_$name")" \
                "$(ratio "${RPS[$name]}" "${RPS[base_$name]}")" "$(median "$name" 5)" "$(median "base_$name" 5)" \
                "$(awk -v r="$r" 'BEGIN { print (r >= 0.95) ? "yes" : "**no**" }')"
        done
    fi
} >"$REPORT"

echo
cat "$REPORT"

if [ "$WRITE" = 1 ]; then
    BENCH_MD="$ROOT/BENCHMARKS.md"
    START='<!-- bench.sh results: start -->'
    END='<!-- bench.sh results: end -->'
    if ! grep -qF "$START" "$BENCH_MD" 2>/dev/null; then
        printf '# Benchmarks\n\n## Latest load benchmark\n\n%s\n%s\n' "$START" "$END" >>"$BENCH_MD"
    fi
    awk -v start="$START" -v end="$END" -v report="$REPORT" '
        $0 == start { print; while ((getline line < report) > 0) print line; skip = 1; next }
        $0 == end { skip = 0 }
        !skip { print }
    ' "$BENCH_MD" >"$TMP/BENCHMARKS.md"
    cp "$TMP/BENCHMARKS.md" "$BENCH_MD"
    log "results written to BENCHMARKS.md"
fi
