import json,sys,collections
for path in sys.argv[1:]:
    recs=[json.loads(l) for l in open(path)]
    ok=[r for r in recs if 200<=r["status"]<300]
    lat=sorted(r["latency_ms"] for r in ok)
    p99=lat[int(0.99*len(lat))-1]
    sess=collections.Counter(); reqs=collections.Counter(); tok=collections.Counter()
    apps=collections.defaultdict(collections.Counter)
    for r in ok:
        reqs[r["endpoint"]]+=1; tok[r["endpoint"]]+=r["prompt_tokens"]-r["cached_tokens"]
        if r["turn"]==0:
            sess[r["endpoint"]]+=1; apps[(r["model"],r.get("app"))][r["endpoint"]]+=1
    slow=[r for r in ok if r["latency_ms"]>=p99]
    sl=collections.Counter((r["endpoint"],r["turn"]>0) for r in slow)
    print(path.split('/')[-1], "p99",round(p99),"sessions",dict(sorted(sess.items())),"reqs",dict(sorted(reqs.items())),"uncached ktok",{k:v//1000 for k,v in sorted(tok.items())})
    print("   slowest:",dict(sl))
    print("   apps:",{f"{m}/{a}":dict(sorted(c.items())) for (m,a),c in sorted(apps.items(), key=lambda x:-sum(x[1].values()))})
