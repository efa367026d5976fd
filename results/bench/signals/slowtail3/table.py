"""Issue 23's slow-endpoint and mixed-fleet targets from one bench run (branch slowtail3).

python3 table.py RESULTS_DIR [RAW_DIR]

Per filter variant and topology: steady and slow p99, slow ÷ steady, cached and follow-ups
(steady → slow), the steady run's pin_break / degraded decisions, and — from the per-request
records of --raw-dir — the new m1 sessions placed on `c` / `d` after the onset (3 s) and the
slow run's requests above 1.5 × the steady p99: to `a` · `b` · `c`/`d`. Then mixed_fleet: cached,
follow-ups, p99, and p99 ÷ the best Envoy balancer's in the run (ring_hash here)."""
import json, os, sys
from collections import Counter

out = sys.argv[1]
raw = sys.argv[2] if len(sys.argv) > 2 else None
runs = json.load(open(os.path.join(out, 'results.json')))['routing']
by = {(r['policy'], r['replicas'], r['scenario']): r for r in runs}
print('| policy | × | steady p99 ms | slow p99 ms | slow ÷ steady | cached steady → slow | follow-ups steady → slow | steady pin_break / degraded | new m1 sessions after onset `c` / `d` | slow > 1.5 × steady p99: `a` · `b` · `c`/`d` |')
print('|---|---|---|---|---|---|---|---|---|---|')
for (pol, rep, sc), st in sorted(by.items()):
    if sc != 'steady' or (pol, rep, 'slow') not in by:
        continue
    sl = by[(pol, rep, 'slow')]
    p_st, p_sl = st['latency_ms']['p99'], sl['latency_ms']['p99']
    d = st.get('decisions') or {}
    name = f"{pol}{'-x3' if rep == 3 else ''}"
    buckets, split = '–', '–'
    f = os.path.join(raw, f'{name}-slow.jsonl') if raw else ''
    if raw and os.path.exists(f):
        recs = [json.loads(l) for l in open(f)]
        ok = [r for r in recs if r['status'] == 200]
        big = [r for r in ok if r['latency_ms'] > 1.5 * p_st]
        c = Counter(r['endpoint'] if r['endpoint'] in 'ab' else 'cd' for r in big)
        buckets = f"{len(big)}: {c['a']} · {c['b']} · {c['cd']}"
        new = Counter(r['endpoint'] for r in ok if r['turn'] == 0 and r['model'] == 'm1' and r['start_ms'] >= 3000)
        split = f"{new['c']} / {new['d']}"
    dec = f"{d.get('pin_break', 0)} / {d.get('degraded', 0)}"
    print(f"| {pol} | {rep} | {p_st:.0f} | {p_sl:.0f} | **{p_sl / p_st:.2f}** | {100 * st['cached_ratio']:.1f} % → {100 * sl['cached_ratio']:.1f} % | {100 * st['same_endpoint_share']:.1f} % → {100 * sl['same_endpoint_share']:.1f} % | {dec} | {split} | {buckets} |")
print()
print('| mixed_fleet | × | cached | follow-ups | pin_break / degraded | p99 ms | p99 ÷ best Envoy balancer |')
print('|---|---|---|---|---|---|---|')
envoy = ('round_robin', 'least_request', 'ring_hash', 'maglev')
for rep in (1, 3):
    best = min((r['latency_ms']['p99'] for (p, x, s), r in by.items() if s == 'mixed_fleet' and x == rep and p in envoy), default=None)
    for (pol, x, sc), r in sorted(by.items()):
        if sc != 'mixed_fleet' or x != rep:
            continue
        d = r.get('decisions') or {}
        ratio = f"{r['latency_ms']['p99'] / best:.2f}" if best else '–'
        print(f"| {pol} | {rep} | {100 * r['cached_ratio']:.1f} % | {100 * r['same_endpoint_share']:.1f} % | {d.get('pin_break', 0)} / {d.get('degraded', 0)} | {r['latency_ms']['p99']:.0f} | {ratio} |")
