import json,sys,collections
for path in sys.argv[1:]:
    recs=[json.loads(l) for l in open(path)]
    ok=[r for r in recs if 200<=r["status"]<300]
    eps=sorted({r["endpoint"] for r in ok})
    print(path.split('/')[-1])
    for t in range(0,16):
        T=t*1000
        c={e:sum(1 for r in ok if r["endpoint"]==e and r["start_ms"]<=T<r["start_ms"]+r["latency_ms"]) for e in eps}
        ns={e:sum(1 for r in ok if r["endpoint"]==e and r["turn"]==0 and r["start_ms"]<=T) for e in eps}
        print(f"  t={t:2d}s inflight",c," sessions so far",ns)
