# shellcheck shell=bash
# Helpers shared by the benchmark scripts (bench.sh, soak.sh, instructions.sh, profile.sh);
# sourced, not run.
# The sourcing script sets NAME (its prefix in messages) first.

log() { printf '%s: %s\n' "$NAME" "$*" >&2; }
die() { log "$*"; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo "$@"
    else die "need root or sudo to run: $*"; fi
}

# Installs the Debian packages named for each missing command: `need_tools cmd:package ...`.
need_tools() {
    local pair missing=()
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${pair%%:*}" ] \
            || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and apt-get is not available"
    log "installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

# A temporary directory and the processes started in it (append pids to PIDS), removed and
# stopped on exit; only those processes are ever signalled.
TMP=$(mktemp -d "${TMPDIR:-/tmp}/idemgate-$NAME.XXXXXX")
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Forgets pid $1 once it has been reaped, so cleanup never signals a number the system may
# have given to another process since.
forget_pid() {
    local kept=() pid
    for pid in "${PIDS[@]}"; do [ "$pid" = "$1" ] || kept+=("$pid"); done
    PIDS=("${kept[@]}")
}

# Stops pid $1 (started by this script), reaps it and forgets it.
stop_pid() {
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    forget_pid "$1"
}

# Builds the release binaries the scripts run (extra cargo flags as arguments); sets BIN.
build_release() {
    log "building release binaries"
    # The gateway on its own, as it ships: built together with the examples it would get the
    # features their dev-dependencies turn on (tokio's test-util).
    cargo build --release --locked --bins "$@" >&2
    cargo build --release --locked --examples "$@" >&2
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
}

# Starts the benchmark upstream on core $1; sets UPSTREAM (its address) and UPSTREAM_PID.
# Called directly, not in `$(…)`, so the pid is the server's and it outlives the call.
start_upstream() {
    taskset -c "$1" "$BIN/examples/bench_upstream" 127.0.0.1:0 >"$TMP/upstream.out" 2>&1 &
    UPSTREAM_PID=$!
    PIDS+=("$UPSTREAM_PID")
    UPSTREAM=$(wait_line "$TMP/upstream.out" '^[0-9.]+:[0-9]+$' "the upstream")
}

# Writes the gateway's configuration for the load scripts to $TMP/idemgate.toml: the upstream
# start_upstream started, records of new keys living $1, and the replayed keys under a route
# of their own (/replay, ttl 1 h) so every measured replay finds its record.
write_gateway_config() {
    cat >"$TMP/idemgate.toml" <<EOF
upstream = "http://$UPSTREAM"
ttl = "$1"

[[routes]]
prefix = "/replay"
ttl = "1h"
EOF
}

# User and system CPU time of process $1 so far, in clock ticks, as "USER SYSTEM" (fields 14
# and 15 of its stat, counted after the command name, which may hold spaces).
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12, $13}'; }

# Resident memory of process $1, in KiB.
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# Waits until FILE has a line matching PATTERN; prints the line.
wait_line() {
    local file=$1 pattern=$2 what=$3 line
    for _ in $(seq 1 300); do
        line=$(grep -m1 -E "$pattern" "$file" 2>/dev/null || true)
        if [ -n "$line" ]; then echo "$line"; return 0; fi
        sleep 0.1
    done
    log "$what did not start; its output:"
    cat "$file" >&2 || true
    exit 1
}

free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((20000 + RANDOM % 40000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return 0
        fi
    done
    die "no free port found"
}

# Waits until a TCP port accepts connections.
wait_port() {
    local port=$1 what=$2
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    die "$what did not start listening on port $port"
}

# Starts redis-server on core $1, no persistence; sets REDIS_URL and REDIS_PID.
start_redis() {
    local port
    port=$(free_port)
    mkdir -p "$TMP/redis"
    taskset -c "$1" redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
        --dir "$TMP/redis" --daemonize no --loglevel warning >"$TMP/redis/out.log" 2>&1 &
    PIDS+=($!); REDIS_PID=$!
    wait_port "$port" redis-server
    REDIS_URL="redis://127.0.0.1:$port"
}

# Starts a six-node Redis Cluster (three primaries, a replica each) on core $1; sets
# CLUSTER_URL and CLUSTER_PIDS.
start_redis_cluster() {
    local nodes=() node port
    CLUSTER_PIDS=()
    for _ in 1 2 3 4 5 6; do
        # A node's cluster bus listens on its port + 10000, which must be a port too.
        port=$(free_port)
        while [ "$port" -gt 55000 ]; do port=$(free_port); done
        mkdir -p "$TMP/cluster/$port"
        taskset -c "$1" redis-server --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
            --cluster-config-file nodes.conf --save '' --appendonly no --dir "$TMP/cluster/$port" \
            --daemonize no --loglevel warning >"$TMP/cluster/$port/out.log" 2>&1 &
        PIDS+=($!); CLUSTER_PIDS+=($!)
        nodes+=("127.0.0.1:$port")
    done
    for node in "${nodes[@]}"; do wait_port "${node#*:}" "redis-server (cluster node)"; done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes \
        >"$TMP/cluster/create.log" 2>&1 || die "redis-cli --cluster create failed: $(cat "$TMP/cluster/create.log")"
    for node in "${nodes[@]}"; do
        for _ in $(seq 1 100); do
            redis-cli -p "${node#*:}" cluster info 2>/dev/null | grep -q '^cluster_state:ok' && break
            sleep 0.1
        done
        redis-cli -p "${node#*:}" cluster info | grep -q '^cluster_state:ok' || die "cluster node $node is not ok"
    done
    CLUSTER_URL="redis-cluster://$(IFS=,; echo "${nodes[*]}")"
}

# Starts PostgreSQL (Debian's, as .ci/install-deps installs it) on core $1 with its durable
# defaults (fsync and synchronous_commit on); sets PG_URL and PG_PID.
start_postgres() {
    local bin port as_pg=()
    bin=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -1)
    [ -x "$bin/initdb" ] || die "PostgreSQL is not installed: run .ci/install-deps"
    mkdir -p "$TMP/pg/socket"
    # PostgreSQL refuses to run as root: as root, it runs as nobody (setpriv execs it, so $! is
    # the server's own pid).
    if [ "$(id -u)" -eq 0 ]; then
        chmod 711 "$TMP"
        chown -R nobody:nogroup "$TMP/pg"
        as_pg=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
    fi
    "${as_pg[@]}" "$bin/initdb" -D "$TMP/pg/data" -U postgres --auth=trust -E UTF8 \
        >"$TMP/pg/initdb.log" 2>&1 || die "initdb failed: $(cat "$TMP/pg/initdb.log")"
    port=$(free_port)
    taskset -c "$1" "${as_pg[@]}" "$bin/postgres" -D "$TMP/pg/data" -p "$port" -k "$TMP/pg/socket" \
        -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on -c max_connections=200 \
        >"$TMP/pg/out.log" 2>&1 &
    PIDS+=($!); PG_PID=$!
    wait_port "$port" postgres
    PG_URL="postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable"
}
