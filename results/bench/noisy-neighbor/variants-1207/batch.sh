#!/usr/bin/env bash
# usage: batch.sh name:wasm ... — runs each under ONE hold of the bench lock (alternated), loadavg printed
cd /work/wt/fair43e
export ENVOY_BIN=/work/main/.venv/bin/envoy COMPUTEFLUX_PYTHON=/work/main/.venv/bin/python MOCK_UPSTREAM_BIN=target/release/mock_upstream
EXTRA=${EXTRA:---replicas 3}
exec 9>/work/wt/bench.lock
flock 9
for nw in "$@"; do
  n=${nw%%:*}; w=${nw#*:}; EX="$EXTRA"; P=${POL:-computeflux}
  case "$w" in *"|"*) P=$(echo "$w" | cut -d'|' -f3); EX=$(echo "$w" | cut -d'|' -f2); w=${w%%|*};; esac
  mkdir -p results/tmp/$n
  {
  echo "start $(date -u +%T) load $(cat /proc/loadavg) wasm $w $(sha256sum $w | cut -c1-12)"
  echo "command: COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EX"
  COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EX
  echo "end $(date -u +%T) load $(cat /proc/loadavg)"
  } > results/tmp/$n/log 2>&1
done
