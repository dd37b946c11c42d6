#!/usr/bin/env bash
# Messages per second through `idemgate consume` (memory store) against a bare
# XREADGROUP + POST + XACK loop, on one redis-server and one handler, in one run
# (crates/idemgate-gateway/tests/consume_bench.rs, built in release).
#
#   scripts/bench-consume.sh
#
# Settings (environment):
#   CONSUME_BENCH_MESSAGES=20000   messages per run
#   CONSUME_BENCH_ROUNDS=3         rounds; each measures the consumer, then the bare loop
#   CONSUME_BENCH_IN_FLIGHT=64     messages in flight, for both
#   CARGO_FLAGS=                   extra flags for the release build
#
# It prints one line per round and the medians; nothing is written to BENCHMARKS.md. The
# redis-server it measures on is started on a free loopback port by the test and stopped by
# its own pid.
set -euo pipefail

cd "$(dirname "$0")/.."
bash .ci/install-deps >/dev/null
# shellcheck disable=SC2086
cargo test --release --locked -p idemgate-gateway --test consume_bench ${CARGO_FLAGS:-} \
    -- --ignored --nocapture 2>&1 | grep -E '^(round|consume bench)|panicked|FAILED'
