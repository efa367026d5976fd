import json,sys
for f in sys.argv[1:]:
    r=[json.loads(l) for l in open(f)]
    after=[x for x in r if x['endpoint']=='a' and x['start_ms']>=15000]
    aff={}
    for x in after: aff[x['affinity']]=aff.get(x['affinity'],0)+1
    print(f.split('/')[-1], 'to a after 15 s:', len(after), aff, 'at', [round(x['start_ms']/1000,1) for x in after][:12])
