"""Issue 23's slow-endpoint target from one bench run: p99 slow / steady per policy and topology,
cached and follow-ups, the steady run's pin_break/degraded decisions, and where the slow run's
requests above 1.5 x the steady p99 went (from the per-request records of --raw-dir)."""
import json, math, os, sys
from collections import Counter

def q(xs, p):
    xs = sorted(xs)
    return xs[max(0, math.ceil(p * len(xs)) - 1)] if xs else float('nan')

out, raw = sys.argv[1], sys.argv[2]
runs = json.load(open(os.path.join(out, 'results.json')))['routing']
key = lambda r: (r['policy'], r['replicas'], r['scenario'])
by = {key(r): r for r in runs}
print('| policy | replicas | steady p99 ms | slow p99 ms | slow ÷ steady | cached steady → slow | follow-ups steady → slow | steady pin_break / degraded | slow requests > 1.5 × steady p99: sent to `a` before 4.5 s · to `a` later · elsewhere |')
print('|---|---|---|---|---|---|---|---|---|')
for (pol, rep, sc), st in sorted(by.items()):
    if sc != 'steady' or (pol, rep, 'slow') not in by:
        continue
    sl = by[(pol, rep, 'slow')]
    p_st, p_sl = st['latency_ms']['p99'], sl['latency_ms']['p99']
    d = st.get('decisions') or {}
    label = pol.replace('_', '\\_') if False else pol
    name = f"{pol}{'-x3' if rep == 3 else ''}"
    buckets = '–'
    f = os.path.join(raw, f'{name}-slow.jsonl')
    if os.path.exists(f):
        recs = [json.loads(l) for l in open(f)]
        big = [r for r in recs if r['status'] == 200 and r['latency_ms'] > 1.5 * p_st]
        c = Counter('a_early' if r['endpoint'] == 'a' and r['start_ms'] < 4500 else 'a_late' if r['endpoint'] == 'a' else 'other' for r in big)
        buckets = f"{len(big)}: {c['a_early']} · {c['a_late']} · {c['other']}"
    dec = f"{d.get('pin_break', 0)} / {d.get('degraded', 0)}" if pol.startswith('computeflux') else '–'
    print(f"| {pol} | {rep} | {p_st:.0f} | {p_sl:.0f} | **{p_sl / p_st:.2f}** | {100 * st['cached_ratio']:.1f} % → {100 * sl['cached_ratio']:.1f} % | {100 * st['same_endpoint_share']:.1f} % → {100 * sl['same_endpoint_share']:.1f} % | {dec} | {buckets} |")
