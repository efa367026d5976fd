"""Issue 23's slow-endpoint target from one bench run (branch slowtail2): per filter variant and
topology, p99 slow / steady, cached and follow-ups, the steady run's pin_break / degraded
decisions, the slow run's moves off `b` for relief (follow-ups that left `b` for `c`/`d`), and
where the slow run's requests above 1.5 x the steady p99 went, from the per-request records of
--raw-dir: to `a` · `b` for m2 · `b` for m1 · `c`/`d`.

python3 table.py RESULTS_DIR RAW_DIR"""
import json, os, sys
from collections import Counter

out, raw = sys.argv[1], sys.argv[2]
runs = json.load(open(os.path.join(out, 'results.json')))['routing']
by = {(r['policy'], r['replicas'], r['scenario']): r for r in runs}
print('| policy | replicas | steady p99 ms | slow p99 ms | slow ÷ steady | cached steady → slow | follow-ups steady → slow | steady pin_break / degraded | slow: follow-ups moved `b` → `c`/`d` | slow requests > 1.5 × steady p99: `a` · `b` m2 · `b` m1 · `c`/`d` |')
print('|---|---|---|---|---|---|---|---|---|---|')
for (pol, rep, sc), st in sorted(by.items()):
    if sc != 'steady' or (pol, rep, 'slow') not in by:
        continue
    sl = by[(pol, rep, 'slow')]
    p_st, p_sl = st['latency_ms']['p99'], sl['latency_ms']['p99']
    d = st.get('decisions') or {}
    name = f"{pol}{'-x3' if rep == 3 else ''}"
    buckets, moved = '–', '–'
    f = os.path.join(raw, f'{name}-slow.jsonl')
    if os.path.exists(f):
        recs = [json.loads(l) for l in open(f)]
        ok = [r for r in recs if r['status'] == 200]
        big = [r for r in ok if r['latency_ms'] > 1.5 * p_st]
        c = Counter('a' if r['endpoint'] == 'a' else f"b{r['model']}" if r['endpoint'] == 'b' else 'cd' for r in big)
        buckets = f"{len(big)}: {c['a']} · {c['bm2']} · {c['bm1']} · {c['cd']}"
        turns = {}
        for r in ok:
            turns[(r['session'], r['turn'])] = r['endpoint']
        moved = str(sum(1 for (s, t), e in turns.items() if t > 0 and turns.get((s, t - 1)) == 'b' and e in 'cd'))
    dec = f"{d.get('pin_break', 0)} / {d.get('degraded', 0)}"
    print(f"| {pol} | {rep} | {p_st:.0f} | {p_sl:.0f} | **{p_sl / p_st:.2f}** | {100 * st['cached_ratio']:.1f} % → {100 * sl['cached_ratio']:.1f} % | {100 * st['same_endpoint_share']:.1f} % → {100 * sl['same_endpoint_share']:.1f} % | {dec} | {moved} | {buckets} |")
