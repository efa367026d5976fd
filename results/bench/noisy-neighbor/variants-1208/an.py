import json,sys,glob
# per run: quiet noise requests, slowest first, with where the time went
def base(alone):
    # latency alone by max_tokens, stream (nearest max_tokens)
    return sorted((r['max_tokens'],r['latency_ms']) for r in alone)
for d in sys.argv[1:]:
    for f in sorted(glob.glob(d+'/raw/*.jsonl')):
        R=[json.loads(l) for l in open(f)]
        if not any(r.get('replica') for r in R) and '-x3' not in f and 'x3' not in f: pass
        alone=[r for r in R if r['tenant']=='quiet' and r['phase']=='alone']
        q=sorted([r for r in R if r['tenant']=='quiet' and r['phase']=='noise'],key=lambda r:r['start_ms'])
        al=max(r['latency_ms'] for r in alone)
        B=base(alone)
        def est(mt):
            return min(B,key=lambda b:abs(b[0]-mt))[1]
        nz=[r for r in R if r['tenant']=='noisy' and r['phase']=='noise']
        served=sum(1 for r in nz if r['status']==200 and r['start_ms']+r['latency_ms']<=47000)/20
        print('== %s %s alone max %.0f noise max %.0f ratio %.3f noisy ~%.1f/s steady waited %d'%(d,f.split('/')[-1],al,max(r['latency_ms'] for r in q),max(r['latency_ms'] for r in q)/al,served,sum(1 for r in R if r['phase']=='steady' and r['queue_ms'])))
        reps=sorted(set(r.get('replica') for r in R if r.get('replica')))
        rid={x:i for i,x in enumerate(reps)}
        top=sorted(q,key=lambda r:-r['latency_ms'])[:int(sys.argv[0] and 8)]
        for i,r in enumerate(q): r['_i']=i
        for r in top:
            print('  #%2d t=%6.0f lat %5.0f (%.2f) mt %3d %s base %4.0f excess %4.0f | filt %4s eng %4s ep %s rep %s'%(r['_i'],r['start_ms'],r['latency_ms'],r['latency_ms']/al,r['max_tokens'],'S' if r['stream'] else 'P',est(r['max_tokens']),r['latency_ms']-est(r['max_tokens']),
              '%.0f'%r['queue_ms'] if r['queue_ms'] is not None else '-', '%.0f'%r['engine_queue_ms'] if r['engine_queue_ms'] is not None else '-', r['endpoint'], rid.get(r.get('replica'),'-')))
        fw=sorted((r['queue_ms'] or 0) for r in q); ew=sorted((r['engine_queue_ms'] or 0) for r in q)
        n=len(q)
        print('  quiet filt wait p50/p90/max %.0f/%.0f/%.0f  eng wait p50/p90/max %.0f/%.0f/%.0f  waited-in-filter %d/%d  eng>5ms %d'%(fw[n//2],fw[int(.9*n)],fw[-1],ew[n//2],ew[int(.9*n)],ew[-1],sum(1 for x in fw if x>0),n,sum(1 for x in ew if x>5)))
