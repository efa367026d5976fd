import json,sys,glob
for d in sys.argv[1:]:
    f=glob.glob(d+'/raw/*x3*.jsonl')[0]
    R=[json.loads(l) for l in open(f)]
    q=sorted([r for r in R if r['tenant']=='quiet' and r['phase']=='noise'],key=lambda r:r['start_ms'])
    print(d, ' '.join('#%d %.0f(f%s e%.0f %s)'%(i,r['latency_ms'],'%.0f'%r['queue_ms'] if r['queue_ms'] is not None else '-',r['engine_queue_ms'] or 0,r['endpoint']) for i,r in enumerate(q[:4])))
    nz=sorted([r for r in R if r['tenant']=='noisy' and r['phase']=='noise' and r['start_ms']<28000],key=lambda r:r['start_ms'])
    print('   noisy first 1s: n=%d direct=%d eng wait max %.0f mean %.0f; by ep %s'%(len(nz),sum(1 for r in nz if r['queue_ms'] is None and r['status']==200),max((r['engine_queue_ms'] or 0) for r in nz),sum((r['engine_queue_ms'] or 0) for r in nz)/len(nz), {e:sum(1 for r in nz if r['endpoint']==e and r['start_ms']<27450) for e in 'abcd'}))
