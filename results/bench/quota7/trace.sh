#!/usr/bin/env bash
# The trace run: the bench driver on the baseline module (main 234257e), quota scenario only.
set -euo pipefail
cd /work/wt/quota
export ENVOY_BIN=/work/wt/quota/.venv/bin/envoy
export COMPUTEFLUX_WASM=/work/ana/quota7/base.wasm
export COMPUTEFLUX_FLOOR_WASM=/work/wt/quota/target/wasm32-wasip1/release/examples/floor_filter.wasm
export MOCK_UPSTREAM_BIN=/work/wt/quota/target/release/mock_upstream
export BENCH_PID_FILE=/work/wt/quota/results/tmp/bench/pids-trace
export BENCH_TIMELINE_MS=250
: > "$BENCH_PID_FILE"
target/release/bench --out results/bench/quota7/trace --no-overhead --micro-missing "skipped (--no-micro)" \
  --scenarios quota --policies computeflux --replicas 1 --raw-dir /work/ana/quota7-trace \
  --date "$(date -u +%Y-%m-%dT%H:%MZ)" --commit 234257e --command "trace: bench driver on main's module, quota only"
