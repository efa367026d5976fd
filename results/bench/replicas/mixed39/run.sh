#!/bin/sh
# results/tmp/mixed39/run.sh NAME WASM ARGS...
NAME=$1; WASM=$2; shift 2
cd /work/wt/mixed39
export ENVOY_BIN=/work/main/.venv/bin/envoy COMPUTEFLUX_PYTHON=/work/main/.venv/bin/python
echo "$NAME start $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)" >> results/tmp/mixed39/runs.log
COMPUTEFLUX_WASM=$WASM target/release/bench --no-overhead --micro-missing skipped --no-baseline \
  --system-prompts 8 --system-tokens 800 --system-zipf 1.1 --second-model-share 0.25 --stream-share 0.5 \
  --plugin-extra '{"pin_cookie": false}' --out results/tmp/mixed39/$NAME --raw-dir results/tmp/mixed39/$NAME-raw "$@"
echo "$NAME end $(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg) rc=$?" >> results/tmp/mixed39/runs.log
