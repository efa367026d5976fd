import json,sys,collections
recs=[json.loads(l) for l in open(sys.argv[1])]
by=collections.defaultdict(list)
for r in recs: by[r['session']].append(r)
moves=collections.Counter(); aff=collections.Counter(); pairs=collections.Counter(); turnc=collections.Counter()
first_aff=collections.Counter()
fu=0; same=0
ex=[]
for s,rs in by.items():
    rs.sort(key=lambda r:r['turn'])
    first_aff[(rs[0]['affinity'],rs[0]['endpoint'])]+=1
    for a,b in zip(rs,rs[1:]):
        if a['status']!=200 or b['status']!=200: continue
        fu+=1
        if a['endpoint']==b['endpoint']: same+=1; continue
        pairs[(a['endpoint'],b['endpoint'])]+=1
        aff[(a['affinity'],b['affinity'])]+=1
        turnc[b['turn']]+=1
    if len(ex)<6 and len(set(r['endpoint'] for r in rs))>1:
        ex.append((s,[(r['endpoint'],r['affinity'][:4],r['replica'][-5:]) for r in rs]))
print('follow-ups',fu,'same',same,'%.1f%%'%(100*same/max(fu,1)))
print('pairs',pairs.most_common(8))
print('affinity prev->next',aff.most_common(10))
print('turn',sorted(turnc.items()))
print('first turns',first_aff.most_common(12))
ep=collections.defaultdict(list)
for r in recs: ep[r['endpoint']].append(r['latency_ms'])
for e,l in sorted(ep.items()):
    l.sort(); print(e,len(l),'median %.0f'%l[len(l)//2], 'p99 %.0f'%l[int(len(l)*.99)])
for e in ex: print(e)
