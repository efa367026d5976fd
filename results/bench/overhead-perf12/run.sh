#!/bin/bash
cd /work/main
ENVOY_BIN=/work/main/.venv/bin/envoy scripts/bench --no-cost --no-micro --no-routing --overhead-endpoints 4,512 --overhead-reps 1 --overhead-seconds 20 --out /tmp/fleetperf > /tmp/fleetperf.log 2>&1 &
B=$!
while ! grep -q "overhead against fleet size" /tmp/fleetperf.log; do sleep 1; if ! kill -0 $B 2>/dev/null; then exit 1; fi; done
perf record -a -F 499 -o /tmp/perf.data -- sleep 150 > /tmp/perf.log 2>&1 &
P=$!
wait $B
kill -INT $P 2>/dev/null; wait $P
