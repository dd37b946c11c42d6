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
    BIN="$ROOT/target/release"
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
