import json,sys
for path in sys.argv[1:]:
    recs=[json.loads(l) for l in open(path)]
    ok=[r for r in recs if 200<=r["status"]<300]
    lat=sorted(r["latency_ms"] for r in ok)
    p99=lat[int(0.99*len(lat))-1]
    print(path.split('/')[-1], "p99", round(p99), "p50", round(lat[len(lat)//2]), "n", len(ok))
    for r in sorted(ok,key=lambda r:r["start_ms"]):
        if r["latency_ms"]>=p99*0.9:
            print(f'  t={r["start_ms"]/1000:6.2f} s{r["session"]:3d} turn{r["turn"]} {r["model"]} app{r.get("app")} ep {r["endpoint"]} aff {r.get("affinity")} lat {r["latency_ms"]:.0f} ttfb {r["ttfb_ms"]:.0f} prompt {r["prompt_tokens"]} cached {r["cached_tokens"]} out {r["completion_tokens"]} stream {r["stream"]} rep {r.get("replica")}')
