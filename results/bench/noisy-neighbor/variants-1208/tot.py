import json,sys,glob
for d in sys.argv[1:]:
    f=glob.glob(d+'/raw/*x3*.jsonl')[0]
    R=[json.loads(l) for l in open(f)]
    q=sorted([r for r in R if r['tenant']=='quiet' and r['phase']=='noise'],key=lambda r:r['start_ms'])[1:]
    t=sorted((r['queue_ms'] or 0)+(r['engine_queue_ms'] or 0) for r in q); n=len(t)
    print('%s total quiet wait (filter+engine, without the onset request) p50/p90/max %.0f/%.0f/%.0f mean %.0f'%(d.split('/')[-1],t[n//2],t[int(.9*n)],t[-1],sum(t)/n))
