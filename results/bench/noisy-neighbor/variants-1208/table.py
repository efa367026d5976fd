import json,sys,glob,re
# one row per run: name, rule(wasm), load at start, ratio, ratio without the onset request, noisy/s, steady waited, quiet waits
print('| run | module | load | ×3 quiet p99 alone / noise ms (÷) | without the onset request (÷) | quiet wait in the filter p90 / max ms | quiet wait in an engine p50 / p90 / max ms | ×3 noisy served /s | steady waited | quiet errors | onset request ms (engine wait) | quiet >5 ms in an engine | quiet wait, filter + engine, without the onset: mean / p90 / max ms |')
print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
for d in sys.argv[1:]:
    log=open(d+'/log').read()
    m=re.search(r'load ([\d.]+).*wasm \S+/(\w+)\.wasm',log)
    f=glob.glob(d+'/raw/*x3*.jsonl')[0]
    R=[json.loads(l) for l in open(f)]
    q=sorted([r for r in R if r['tenant']=='quiet' and r['phase']=='noise'],key=lambda r:r['start_ms'])
    al=max(r['latency_ms'] for r in R if r['tenant']=='quiet' and r['phase']=='alone')
    lat=[r['latency_ms'] for r in q]
    tt=sorted((r['queue_ms'] or 0)+(r['engine_queue_ms'] or 0) for r in q[1:])
    fw=sorted((r['queue_ms'] or 0) for r in q); ew=sorted((r['engine_queue_ms'] or 0) for r in q); n=len(q)
    S=json.load(open(d+'/latest.json'))
    run=[r for r in S['runs'] if r['replicas']==3 and r['policy']=='computeflux'][0]
    ns=run['noise_noisy']['served_per_s']
    qe=run['noise_quiet']['errors']+run['alone_quiet']['errors']
    sw=sum(1 for r in R if r['phase']=='steady' and r['queue_ms'])
    print('| %s | %s | %s | %.0f / %.0f (%.2f) | %.2f | %.0f / %.0f | %.0f / %.0f / %.0f | %.1f | %d | %d | %.0f (%.0f) | %d | %.0f / %.0f / %.0f |'%(d.split('/')[-1],m.group(2),m.group(1),al,max(lat),max(lat)/al,max(lat[1:])/al,fw[int(.9*n)],fw[-1],ew[n//2],ew[int(.9*n)],ew[-1],ns,sw,qe,q[0]['latency_ms'],q[0]['engine_queue_ms'] or 0,sum(1 for x in ew if x>5),sum(tt)/len(tt),tt[int(.9*len(tt))],tt[-1]))
