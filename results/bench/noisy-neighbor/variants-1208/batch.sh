#!/usr/bin/env bash
# usage: batch.sh name:wasm ... — runs each under ONE hold of the bench lock (alternated), loadavg printed
cd "$(dirname "$0")/../../../.."
export ENVOY_BIN=/work/main/.venv/bin/envoy COMPUTEFLUX_PYTHON=/work/main/.venv/bin/python MOCK_UPSTREAM_BIN=target/release/mock_upstream
EXTRA=${EXTRA:---replicas 3}
P=${POL:-computeflux}
exec 9>/work/wt/bench.lock
flock 9
for nw in "$@"; do
  n=${nw%%:*}; w=${nw#*:}
  mkdir -p results/tmp/$n
  {
  echo "start $(date -u +%T) load $(cat /proc/loadavg) wasm $w $(sha256sum $w | cut -c1-12)"
  echo "command: COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EXTRA"
  COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EXTRA
  echo "end $(date -u +%T) load $(cat /proc/loadavg)"
  } > results/tmp/$n/log 2>&1
done
