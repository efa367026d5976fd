import json,sys,glob
for d in sys.argv[1:]:
    f=glob.glob(d+'/raw/*x3*.jsonl')[0]
    R=[json.loads(l) for l in open(f)]
    reps=sorted(set(r.get('replica') for r in R if r.get('replica'))); rid={x:i for i,x in enumerate(reps)}
    nz=sorted([r for r in R if r['phase']=='noise' and r['start_ms']<27800],key=lambda r:r['start_ms'])
    print(d)
    for r in nz:
        print('  %s %6.0f rep %s %s filt %4s eng %4.0f lat %5.0f mt %3d'%(r['tenant'][0],r['start_ms'],rid.get(r.get('replica'),'-'),r['endpoint'],'%.0f'%r['queue_ms'] if r['queue_ms'] is not None else '-',r['engine_queue_ms'] or 0,r['latency_ms'],r['max_tokens']))
