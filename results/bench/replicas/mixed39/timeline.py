import json,collections,sys
recs=[json.loads(l) for l in open(sys.argv[1])]
home={}
for r in recs:
    if r['affinity']=='prefix': home[(r['app'],r['model'])]=r['endpoint']
print(home)
for h in sys.argv[2:]:
    line=[]
    for r in sorted(recs,key=lambda r:r['start_ms']):
        if home.get((r['app'],r['model']))!=h: continue
        if r['turn'] not in (0,1,2) : continue
        line.append('%d%s%s'%(r['turn'], 'H' if r['endpoint']==h else r['endpoint'], r['replica'][-1]))
    # print with time buckets
    out=collections.defaultdict(list)
    for r in sorted(recs,key=lambda r:r['start_ms']):
        if home.get((r['app'],r['model']))!=h or r['turn'] not in (0,1,2): continue
        out[int(r['start_ms']//2000)].append('%d%s'%(r['turn'], 'H' if r['endpoint']==h else r['endpoint']))
    print('home',h)
    for b in sorted(out): print(' %3ds'%(b*2), ' '.join(out[b]))
