#!/usr/bin/env python3
"""Quota-scenario moves and placements from a bench --raw-dir.
usage: mv.py RAWDIR [label]   (label e.g. computeflux or computeflux-x3; default: all)
Per run: per 4 s window and key: tokens used (mock log), new sessions placed (first turns) by
affinity reason; every follow-up whose endpoint differs from the previous turn's, with whether
the key it left had the turn's tokens in its window (mock log) when it was sent."""
import json, sys, glob, os, collections, bisect

def load(prefix):
    recs = [json.loads(l) for l in open(prefix + '-quota.jsonl')]
    u = json.load(open(prefix + '-quota-quota-usage.json'))
    tl = prefix + '-quota-timeline.jsonl'
    tl = [json.loads(l) for l in open(tl)] if os.path.exists(tl) else []
    return recs, u, tl

def used_at(log, at, win):
    ws = at - at % win
    i = bisect.bisect_right([e[0] for e in log], at)
    if i and log[i-1][0] >= ws:
        return log[i-1][1]
    return 0

def run(prefix):
    recs, u, tl = load(prefix)
    t0 = u['t0_unix_ms']
    keys = {k['endpoint']: k for k in u['keys']}
    win = u['keys'][0]['window_ms']
    def wi(ms):  # window index (mock windows are aligned to unix ms)
        return (t0 + int(ms)) // win - (t0 // win)
    by = {(r['session'], r['turn']): r for r in recs}
    print(f"== {os.path.basename(prefix)}  t0 % window = {t0 % win} ms; budgets",
          {e: k['tokens'] for e, k in keys.items()})
    # window table
    place = collections.defaultdict(lambda: collections.Counter())
    for r in recs:
        if r['turn'] == 0 and r['status'] == 200:
            place[(wi(r['start_ms']), r['endpoint'])][r['affinity']] += 1
    nwin = max(wi(r['start_ms']) for r in recs) + 1
    # window end use per key (max logged in window)
    wuse = collections.defaultdict(int)
    for e, k in keys.items():
        for at, used in k['log']:
            w = (at // win) - (t0 // win)
            wuse[(w, e)] = max(wuse[(w, e)], used)
    print('win ' + ' | '.join(f"{e}: used/limit, new(reasons)" for e in keys))
    for w in range(nwin):
        cells = []
        for e in keys:
            pl = place.get((w, e), {})
            n = sum(pl.values())
            cells.append(f"{e} {wuse[(w,e)]:>6}/{keys[e]['tokens']} new {n:>2} {dict(pl) if pl else ''}")
        print(f"{w:>2} [{w*win - t0 % win:>6} ms] " + ' | '.join(cells))
    # moves
    moved = both = 0
    for r in sorted(recs, key=lambda r: r['start_ms']):
        if r['turn'] == 0 or r['status'] != 200:
            continue
        p = by.get((r['session'], r['turn'] - 1))
        if not p or p['status'] != 200 or p['endpoint'] == r['endpoint']:
            continue
        moved += 1
        k = keys.get(p['endpoint'])
        at = t0 + int(max(r['start_ms'], 0))
        left = k['tokens'] - used_at(k['log'], at, win) if k else None
        need = r['prompt_tokens'] + r['completion_tokens']
        had = left is not None and left >= need
        both += had
        to_reset = win - at % win
        print(f"  move s{r['session']} t{r['turn']} {p['endpoint']}->{r['endpoint']} at {r['start_ms']:.0f} ms"
              f" (win {wi(r['start_ms'])}, {to_reset} ms to reset) aff={r['affinity']} att={r['attempts']}"
              f" left-key had {left} for ~{need}{'  << HAD QUOTA' if had else ''} ; prev placed {by[(r['session'],0)]['affinity']}@{by[(r['session'],0)]['start_ms']:.0f}")
    print(f"  moved {moved}, left key had quota (prompt+completion) {both}")
    # timeline: quota skips per window per endpoint (counter deltas, summed over processes)
    if tl:
        last = {}
        sk = collections.Counter(); sat = collections.Counter()
        for s in tl:
            for name, v in s['gauges'].items():
                if name.startswith('computeflux_quota_skips_total'):
                    key = (s['port'], name)
                    d = v - last.get(key, 0); last[key] = v
                    e = name[name.index('{')+1:-1]
                    sk[(wi(s['t_ms']), e)] += d
                if name.startswith('computeflux_saturated') and v > 0:
                    e = name[name.index('{')+1:-1]
                    sat[(wi(s['t_ms']), e)] += 1
        print('  quota skips per window:', {w: {e: int(sk[(w, e)]) for e in keys if sk[(w, e)]} for w in range(nwin)})
        print('  saturated samples per window:', {w: {e: sat[(w, e)] for e in keys if sat[(w, e)]} for w in range(nwin)})

d = sys.argv[1]
want = sys.argv[2] if len(sys.argv) > 2 else None
for f in sorted(glob.glob(os.path.join(d, '*-quota.jsonl'))):
    prefix = f[:-len('-quota.jsonl')]
    if want and os.path.basename(prefix) != want:
        continue
    run(prefix)
