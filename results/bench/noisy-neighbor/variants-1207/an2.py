import json,sys,glob
# per run: bench p99 (max of 75) alone/noise, the onset quiet request (first of the noise phase), slowest excluding it, quiet waits, noisy/s
for d in sys.argv[1:]:
    for f in sorted(glob.glob(d+'/raw/*.jsonl')):
        R=[json.loads(l) for l in open(f)]
        q=sorted([r for r in R if r['tenant']=='quiet' and r['phase']=='noise'],key=lambda r:r['start_ms'])
        a=[r['latency_ms'] for r in R if r['tenant']=='quiet' and r['phase']=='alone']
        al=max(a); lat=[r['latency_ms'] for r in q]
        on=q[0]; rest=max(lat[1:])
        fw=[r['queue_ms'] or 0 for r in q]; ew=sorted(r['engine_queue_ms'] or 0 for r in q)
        nz=[r for r in R if r['tenant']=='noisy' and r['phase']=='noise']
        nq=[r['engine_queue_ms'] or 0 for r in nz if r['status']==200]
        print('%-6s %s quiet max %.0f/%.0f=%.2f | onset %.0f ms (fw %s ew %.0f) | without onset %.2f | fw p90/max %.0f/%.0f ew p50/p90/max %.0f/%.0f/%.0f | noisy eng wait mean %.0f | steady waited %d'%(
          d.split('/')[-1], f.split('-x')[-1][:1] if '-x' in f else '?', max(lat), al, max(lat)/al, on['latency_ms'], on['queue_ms'], on['engine_queue_ms'] or 0, rest/al,
          sorted(fw)[int(.9*len(fw))], max(fw), ew[len(ew)//2], ew[int(.9*len(ew))], ew[-1], sum(nq)/len(nq), sum(1 for r in R if r['phase']=='steady' and r['queue_ms'])))
