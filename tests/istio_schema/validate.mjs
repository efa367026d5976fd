// Validates Istio resources against the validators that @kubernetes-models/istio generates from
// Istio's CRD schemas (Istio 1.29.2: types, enums, required fields, bounds; not unknown fields,
// not TrafficExtension, which tests/istio.rs checks by hand). Usage: node validate.mjs FILE...
// Prints "ok Kind/name" or "skip Kind/name" per document; exits 1 on the first invalid one.
import fs from 'node:fs';
import yaml from 'js-yaml';
import { WasmPlugin } from '@kubernetes-models/istio/extensions.istio.io/v1alpha1/WasmPlugin';
import { EnvoyFilter } from '@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter';
import { Gateway } from '@kubernetes-models/istio/networking.istio.io/v1/Gateway';
import { VirtualService } from '@kubernetes-models/istio/networking.istio.io/v1/VirtualService';
import { ServiceEntry } from '@kubernetes-models/istio/networking.istio.io/v1/ServiceEntry';
import { DestinationRule } from '@kubernetes-models/istio/networking.istio.io/v1/DestinationRule';

const models = { WasmPlugin, EnvoyFilter, Gateway, VirtualService, ServiceEntry, DestinationRule };
for (const file of process.argv.slice(2)) {
  for (const doc of yaml.loadAll(fs.readFileSync(file, 'utf8'))) {
    const id = `${doc.kind}/${doc.metadata?.name}`;
    const Model = models[doc.kind];
    if (!Model) {
      console.log(`skip ${id}`);
      continue;
    }
    try {
      new Model(doc).validate();
    } catch (e) {
      console.log(`invalid ${id} (${file}): ${e.message}`);
      process.exit(1);
    }
    console.log(`ok ${id}`);
  }
}
