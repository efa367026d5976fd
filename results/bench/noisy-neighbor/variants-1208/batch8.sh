#!/usr/bin/env bash
# One hold: h1, m8, h2 (three replicas), then the final run (1 and 3, with least_request) on H or C, whichever's mean ratio is lower
cd "$(dirname "$0")/../../../.."
export ENVOY_BIN=/work/main/.venv/bin/envoy COMPUTEFLUX_PYTHON=/work/main/.venv/bin/python MOCK_UPSTREAM_BIN=target/release/mock_upstream
exec 9>/work/wt/bench.lock
flock 9
run() { n=$1; w=$2; P=$3; EX=$4; mkdir -p results/tmp/$n; {
  echo "start $(date -u +%T) load $(cat /proc/loadavg) wasm $w $(sha256sum $w | cut -c1-12)"
  echo "command: COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EX"
  COMPUTEFLUX_WASM=$w target/release/bench --noisy-neighbor --policies $P --raw-dir results/tmp/$n/raw --out results/tmp/$n $EX
  echo "end $(date -u +%T) load $(cat /proc/loadavg)"; } > results/tmp/$n/log 2>&1; }
run h1 results/tmp/wasm/partH.wasm computeflux "--replicas 3"
run m8 results/tmp/wasm/main.wasm computeflux "--replicas 3"
run h2 results/tmp/wasm/partH.wasm computeflux "--replicas 3"
best=$(python3 - <<'PY'
import json,glob
def ratio(d):
    R=[json.loads(l) for l in open(glob.glob(d+'/raw/*x3*.jsonl')[0])]
    a=max(r['latency_ms'] for r in R if r['tenant']=='quiet' and r['phase']=='alone')
    return max(r['latency_ms'] for r in R if r['tenant']=='quiet' and r['phase']=='noise')/a
h=(ratio('results/tmp/h1')+ratio('results/tmp/h2'))/2
c=(ratio('results/tmp/c1')+ratio('results/tmp/c2'))/2
print('partH' if h<=c else 'partC')
PY
)
echo "final module $best" > results/tmp/final-choice
run final results/tmp/wasm/$best.wasm computeflux,least_request "--replicas 1,3"
