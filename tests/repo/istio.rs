//! The Istio manifests in `envoy/istio/` are well-formed and agree with each other and with the
//! filter: they pass the validators generated from Istio's CRD schemas (npm
//! `@kubernetes-models/istio`, Istio 1.29), and every field used exists in the Istio 1.30 API
//! with an allowed value (a hand-written subset: the npm validators accept unknown fields and
//! have no `TrafficExtension`),
//! the three ways of loading the module carry the same URL, digest and plugin configuration,
//! that configuration is accepted by `Config::from_value`, every endpoint's cluster is created
//! by a ServiceEntry and reached by a VirtualService route on the routing header, and the
//! EnvoyFilter's Wasm config passes `envoy --mode validate` with the built module; and the pool
//! form (`pool.yaml`, issue 40): its CLUSTER patch targets the Service a VirtualService route
//! reaches, carries the same `override_host` policy as `envoy/pool.yaml`, and merged into a
//! cluster shaped as Istio generates it passes `envoy --mode validate`.
// Test helpers fail loudly: that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::deploy_support;
use crate::support;

use std::collections::BTreeMap;
use std::process::Command;

use computeflux::scheduler::config::Config;
use deploy_support::{files_with_ext, root, str_at, wasm_filters, yaml_doc, yaml_docs};
use serde_json::{json, Value};

/// Every resource in envoy/istio/, keyed by "Kind/name".
fn resources() -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for f in files_with_ext(&root().join("envoy/istio"), &[".yaml", ".yml"]) {
        for doc in yaml_docs(&f) {
            let key = format!(
                "{}/{}",
                str_at(&doc, "/kind", "resource"),
                str_at(&doc, "/metadata/name", "resource")
            );
            assert!(
                out.insert(key.clone(), doc).is_none(),
                "{key} defined twice"
            );
        }
    }
    out
}

/// A shape: the allowed keys of an object (with the shape of each value), a list of one shape,
/// an enum, a scalar type, or "any" (free-form, e.g. pluginConfig).
fn check(v: &Value, shape: &Value, at: &str, errors: &mut Vec<String>) {
    match shape {
        Value::String(t) => {
            let ok = match t.as_str() {
                "any" => true,
                "string" => v.is_string(),
                "int" => v.is_i64() || v.is_u64(),
                "bool" => v.is_boolean(),
                "sha256" => v.as_str().is_some_and(|s| {
                    s.len() == 64
                        && s.bytes()
                            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
                }),
                "strings" => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
                "string_map" => v
                    .as_object()
                    .is_some_and(|m| m.values().all(Value::is_string)),
                other => panic!("unknown shape {other}"),
            };
            if !ok {
                errors.push(format!("{at}: {v} is not {t}"));
            }
        }
        Value::Array(alts) if alts.first().is_some_and(|a| a == "enum") => {
            if !alts[1..].contains(v) {
                errors.push(format!("{at}: {v} is not one of {:?}", &alts[1..]));
            }
        }
        Value::Array(item) => match v.as_array() {
            Some(list) => {
                for (i, x) in list.iter().enumerate() {
                    check(x, &item[0], &format!("{at}[{i}]"), errors);
                }
            }
            None => errors.push(format!("{at}: not a list")),
        },
        Value::Object(fields) => match v.as_object() {
            Some(obj) => {
                for (k, x) in obj {
                    match fields.get(k) {
                        Some(s) => check(x, s, &format!("{at}.{k}"), errors),
                        None => errors.push(format!(
                            "{at}.{k}: unknown field (known: {:?})",
                            fields.keys().collect::<Vec<_>>()
                        )),
                    }
                }
            }
            None => errors.push(format!("{at}: not an object")),
        },
        other => panic!("bad shape {other}"),
    }
}

fn metadata() -> Value {
    json!({"name": "string", "namespace": "string", "labels": "string_map", "annotations": "string_map"})
}

/// The fields of the Istio 1.30 APIs that the manifests may use (from istio/api
/// extensions/v1alpha1 wasm.proto and traffic_extension.proto, networking/v1 and v1alpha3).
fn shapes() -> BTreeMap<(&'static str, &'static str), Value> {
    let selector = json!({"matchLabels": "string_map"});
    let fail = json!(["enum", "FAIL_CLOSE", "FAIL_OPEN", "FAIL_RELOAD"]);
    let pull = json!(["enum", "UNSPECIFIED_POLICY", "IfNotPresent", "Always"]);
    let phase = json!(["enum", "UNSPECIFIED_PHASE", "AUTHN", "AUTHZ", "STATS"]);
    let plugin_type = json!(["enum", "UNSPECIFIED_PLUGIN_TYPE", "HTTP", "NETWORK"]);
    let vm = json!({"env": [{"name": "string", "value": "string", "valueFrom": ["enum", "INLINE", "HOST"]}]});
    let traffic = json!([{"mode": ["enum", "UNDEFINED", "CLIENT", "SERVER", "CLIENT_AND_SERVER"],
                          "ports": [{"number": "int"}]}]);
    let wasm_common = json!({
        "url": "string", "sha256": "sha256", "imagePullPolicy": pull, "imagePullSecret": "string",
        "pluginConfig": "any", "pluginName": "string", "failStrategy": fail, "vmConfig": vm,
        "type": plugin_type,
    });
    let mut wasm_plugin = wasm_common.as_object().unwrap().clone();
    for (k, v) in [
        ("selector", selector.clone()),
        ("phase", phase.clone()),
        ("priority", json!("int")),
        ("match", traffic.clone()),
    ] {
        wasm_plugin.insert(k.into(), v);
    }
    let string_match = json!({"exact": "string", "prefix": "string", "regex": "string"});
    let destination = json!({"host": "string", "subset": "string", "port": {"number": "int"}});
    let mut m = BTreeMap::new();
    m.insert(
        ("extensions.istio.io/v1alpha1", "WasmPlugin"),
        json!({
            "apiVersion": "string", "kind": "string", "metadata": metadata(),
            "spec": Value::Object(wasm_plugin),
        }),
    );
    m.insert(
        ("extensions.istio.io/v1alpha1", "TrafficExtension"),
        json!({
            "apiVersion": "string", "kind": "string", "metadata": metadata(),
            "spec": {"selector": selector, "phase": phase, "priority": "int", "match": traffic,
                     "wasm": wasm_common, "lua": {"inlineCode": "string"}},
        }),
    );
    m.insert(("networking.istio.io/v1alpha3", "EnvoyFilter"), json!({
        "apiVersion": "string", "kind": "string", "metadata": metadata(),
        "spec": {
            "workloadSelector": {"labels": "string_map"},
            "priority": "int",
            "configPatches": [{
                "applyTo": ["enum", "INVALID", "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER",
                            "HTTP_FILTER", "ROUTE_CONFIGURATION", "VIRTUAL_HOST", "HTTP_ROUTE",
                            "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER"],
                "match": {
                    "context": ["enum", "ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"],
                    "listener": {"portNumber": "int", "name": "string", "filterChain": {
                        "name": "string", "sni": "string",
                        "filter": {"name": "string", "subFilter": {"name": "string"}}}},
                    "cluster": {"service": "string", "portNumber": "int", "subset": "string",
                                "name": "string"},
                },
                "patch": {"operation": ["enum", "INVALID", "MERGE", "ADD", "REMOVE",
                                        "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"],
                          "value": "any",
                          "filterClass": ["enum", "UNSPECIFIED", "AUTHN", "AUTHZ", "STATS"]},
            }],
        },
    }));
    m.insert(
        ("networking.istio.io/v1", "Gateway"),
        json!({
            "apiVersion": "string", "kind": "string", "metadata": metadata(),
            "spec": {"selector": "string_map", "servers": [{
                "port": {"number": "int", "name": "string", "protocol": "string"},
                "hosts": "strings"}]},
        }),
    );
    m.insert(("networking.istio.io/v1", "VirtualService"), json!({
        "apiVersion": "string", "kind": "string", "metadata": metadata(),
        "spec": {"hosts": "strings", "gateways": "strings", "http": [{
            "name": "string",
            "match": [{"headers": {"x-computeflux-cluster": string_match}, "uri": string_match}],
            "route": [{"destination": destination, "weight": "int"}],
            "headers": {"request": {"remove": "strings", "set": "string_map", "add": "string_map"}},
            "timeout": "string",
            "retries": {"attempts": "int", "perTryTimeout": "string", "retryOn": "string"},
            "directResponse": {"status": "int", "body": {"string": "string"}},
        }]},
    }));
    m.insert(
        ("networking.istio.io/v1", "ServiceEntry"),
        json!({
            "apiVersion": "string", "kind": "string", "metadata": metadata(),
            "spec": {"hosts": "strings", "location": ["enum", "MESH_EXTERNAL", "MESH_INTERNAL"],
                     "resolution": ["enum", "NONE", "STATIC", "DNS", "DNS_ROUND_ROBIN"],
                     "ports": [{"number": "int", "name": "string", "protocol": "string",
                                "targetPort": "int"}],
                     "endpoints": [{"address": "string", "ports": "any"}]},
        }),
    );
    m.insert(("networking.istio.io/v1", "DestinationRule"), json!({
        "apiVersion": "string", "kind": "string", "metadata": metadata(),
        "spec": {"host": "string", "trafficPolicy": {
            "connectionPool": {"http": {"http1MaxPendingRequests": "int",
                                        "http2MaxRequests": "int",
                                        "maxRequestsPerConnection": "int"},
                               "tcp": {"maxConnections": "int", "connectTimeout": "string"}},
            "tls": {"mode": ["enum", "DISABLE", "SIMPLE", "MUTUAL", "ISTIO_MUTUAL"], "sni": "string"}}},
    }));
    m.insert(
        ("v1", "ConfigMap"),
        json!({
            "apiVersion": "string", "kind": "string", "metadata": metadata(), "data": "string_map",
        }),
    );
    m
}

#[test]
fn manifests_use_only_known_fields_and_values() {
    let shapes = shapes();
    let mut errors = Vec::new();
    let all = resources();
    for (key, doc) in &all {
        let api = str_at(doc, "/apiVersion", key);
        let kind = str_at(doc, "/kind", key);
        let shape = shapes
            .get(&(api, kind))
            .unwrap_or_else(|| panic!("{key}: no shape for {api} {kind}"));
        check(doc, shape, key, &mut errors);
        assert_eq!(
            str_at(doc, "/metadata/namespace", key),
            "istio-ingress",
            "{key}"
        );
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    for must in [
        "WasmPlugin/computeflux",
        "TrafficExtension/computeflux",
        "EnvoyFilter/computeflux",
        "VirtualService/computeflux",
        "ConfigMap/computeflux-stats-tags",
        "EnvoyFilter/computeflux-pool",
        "VirtualService/computeflux-pool",
    ] {
        assert!(all.contains_key(must), "{must} missing");
    }
}

#[test]
fn the_checker_rejects_unknown_fields_and_values() {
    let shapes = shapes();
    let mut doc = resources()["WasmPlugin/computeflux"].clone();
    doc["spec"]["failStrategy"] = json!("FAIL_SOMETIMES");
    doc["spec"]["sha"] = json!("x");
    let mut errors = Vec::new();
    check(
        &doc,
        &shapes[&("extensions.istio.io/v1alpha1", "WasmPlugin")],
        "w",
        &mut errors,
    );
    assert_eq!(errors.len(), 2, "{errors:?}");
}

#[test]
fn module_loading_forms_agree_and_the_configuration_is_accepted() {
    let all = resources();
    let wp = &all["WasmPlugin/computeflux"]["spec"];
    let te = &all["TrafficExtension/computeflux"]["spec"];
    let ef = &all["EnvoyFilter/computeflux"]["spec"];
    let ext = ef["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "EXTENSION_CONFIG")
        .expect("EXTENSION_CONFIG patch");
    let wasm_cfg = &ext["patch"]["value"]["typed_config"]["config"];
    let remote = &wasm_cfg["vm_config"]["code"]["remote"];

    // The same image, digest and configuration in all three.
    let url = wp["url"].as_str().unwrap();
    assert!(url.starts_with("oci://"), "{url}");
    assert_eq!(te["wasm"]["url"], url);
    assert_eq!(remote["http_uri"]["uri"], url);
    assert_eq!(te["wasm"]["sha256"], wp["sha256"]);
    assert_eq!(remote["sha256"], wp["sha256"]);
    let from_ef: Value =
        serde_json::from_str(wasm_cfg["configuration"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(wp["pluginConfig"], te["wasm"]["pluginConfig"]);
    assert_eq!(wp["pluginConfig"], from_ef);
    let cfg = Config::from_value(&wp["pluginConfig"])
        .unwrap_or_else(|e| panic!("pluginConfig rejected: {e:?}"));

    // Reload on failure; placement before the router (no phase); the EnvoyFilter form sets
    // what the others cannot.
    assert_eq!(wp["failStrategy"], "FAIL_RELOAD");
    assert_eq!(te["wasm"]["failStrategy"], "FAIL_RELOAD");
    assert_eq!(wasm_cfg["failure_policy"], "FAIL_RELOAD");
    assert!(wp.get("phase").is_none() && te.get("phase").is_none());
    assert_eq!(wasm_cfg["allow_on_headers_stop_iteration"], true);
    let filter = ef["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "HTTP_FILTER")
        .unwrap();
    assert_eq!(filter["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(
        filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    assert_eq!(
        filter["patch"]["value"]["name"],
        ext["patch"]["value"]["name"]
    );
    let buffer = ef["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "LISTENER")
        .unwrap()["patch"]["value"]["per_connection_buffer_limit_bytes"]
        .as_u64()
        .unwrap();
    assert!(
        buffer >= cfg.max_body_bytes,
        "buffer {buffer} < max_body_bytes"
    );

    // Every endpoint's cluster: a ServiceEntry host:port, a DestinationRule, and a route that
    // matches the routing header on exactly that value and goes there.
    let vs = &all["VirtualService/computeflux"]["spec"]["http"];
    for ep in &cfg.endpoints {
        let parts: Vec<&str> = ep.cluster.split('|').collect();
        assert_eq!(
            parts.len(),
            4,
            "{}: {} is not outbound|port||host",
            ep.name,
            ep.cluster
        );
        assert_eq!(parts[0], "outbound");
        let (port, host) = (parts[1].parse::<u64>().unwrap(), parts[3]);
        assert!(
            all.values().any(|d| d["kind"] == "ServiceEntry"
                && d["spec"]["hosts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|h| h == host)
                && d["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["number"] == port)),
            "no ServiceEntry for {host}:{port}"
        );
        assert!(
            all.values()
                .any(|d| d["kind"] == "DestinationRule" && d["spec"]["host"] == host),
            "no DestinationRule for {host}"
        );
        let route = vs
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["match"][0]["headers"][&cfg.routing_header]["exact"] == ep.cluster.as_str())
            .unwrap_or_else(|| panic!("no route matches {} = {}", cfg.routing_header, ep.cluster));
        assert_eq!(route["route"][0]["destination"]["host"], host);
        assert_eq!(route["route"][0]["destination"]["port"]["number"], port);
        assert_eq!(
            route["headers"]["request"]["remove"],
            json!([cfg.routing_header])
        );
        assert_eq!(route["retries"]["attempts"], 0, "Istio retries must be off");
    }
    // The last route catches requests without a decision.
    assert!(vs
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .get("directResponse")
        .is_some());
}

#[test]
fn envoyfilter_wasm_config_passes_envoy_validate() {
    // Envoy's own check of the patch: the EXTENSION_CONFIG's Wasm config, with the remote
    // oci:// code replaced by the built module (what the istio-agent does), in envoy.yaml's
    // listener.
    let ef = &resources()["EnvoyFilter/computeflux"];
    let ext = ef["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "EXTENSION_CONFIG")
        .unwrap();
    let mut typed = ext["patch"]["value"]["typed_config"].clone();
    typed["config"]["vm_config"]["code"] =
        json!({"local": {"filename": support::wasm_path().display().to_string()}});
    let mut bootstrap = yaml_doc(&root().join("envoy/envoy.yaml"));
    let (ptr, _) = wasm_filters(&bootstrap).remove(0);
    *bootstrap
        .pointer_mut(&format!("{ptr}/typed_config"))
        .unwrap() = typed;
    // The clusters the configuration names, as placeholders.
    let cfg: Value = serde_json::from_str(
        ext["patch"]["value"]["typed_config"]["config"]["configuration"]["value"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let clusters: Vec<Value> = cfg["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            json!({"name": e["cluster"], "type": "STATIC", "connect_timeout": "1s",
                        "load_assignment": {"cluster_name": e["cluster"], "endpoints": []}})
        })
        .collect();
    bootstrap["static_resources"]["clusters"] = Value::Array(clusters);
    let dir = std::env::temp_dir().join(format!("computeflux-istio-{}", support::unique_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.json");
    std::fs::write(&path, bootstrap.to_string()).unwrap();
    let out = Command::new(support::envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("OK"), "{text}");
    assert!(text.contains("configuration accepted"), "{text}");
}

/// Runs `envoy --mode validate` on `bootstrap`; `(passed, Envoy's output)`.
fn envoy_validate(bootstrap: &Value) -> (bool, String) {
    let dir = std::env::temp_dir().join(format!("computeflux-istio-{}", support::unique_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.json");
    std::fs::write(&path, bootstrap.to_string()).unwrap();
    let out = Command::new(support::envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success() && text.contains("OK"), text)
}

#[test]
fn pool_cluster_patch_reaches_the_services_cluster_and_passes_envoy_validate() {
    // pool.yaml: the EnvoyFilter's CLUSTER patch targets the Service's outbound cluster, the
    // VirtualService routes that cluster's name in the routing header to the same Service, and
    // the patch merged into a cluster shaped as Istio generates it passes `envoy --mode
    // validate` (EDS from ADS replaced by a file: no control plane here).
    let all = resources();
    let patch = all["EnvoyFilter/computeflux-pool"]["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["applyTo"] == "CLUSTER")
        .expect("CLUSTER patch")
        .clone();
    assert_eq!(patch["match"]["context"], "GATEWAY");
    assert_eq!(patch["patch"]["operation"], "MERGE");
    let service = patch["match"]["cluster"]["service"].as_str().unwrap();
    let port = patch["match"]["cluster"]["portNumber"].as_u64().unwrap();
    let cluster = format!("outbound|{port}||{service}");
    let routes = all["VirtualService/computeflux-pool"]["spec"]["http"]
        .as_array()
        .unwrap()
        .clone();
    let route = routes
        .iter()
        .find(|r| r["match"][0]["headers"]["x-computeflux-cluster"]["exact"] == cluster.as_str())
        .unwrap_or_else(|| panic!("no route on x-computeflux-cluster = {cluster}"));
    assert_eq!(route["route"][0]["destination"]["host"], service);
    assert_eq!(route["route"][0]["destination"]["port"]["number"], port);
    assert_eq!(
        route["retries"]["attempts"], 0,
        "the filter fails over itself"
    );
    let lb =
        &patch["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
    assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
    assert_eq!(
        lb["typed_config"]["override_host_sources"][0]["header"], "x-gateway-destination-endpoint",
        "the header the filter writes by default"
    );
    // The same policy and upstream stamp as the plain-Envoy pool (envoy/pool.yaml).
    let local = yaml_doc(&root().join("envoy/pool.yaml"));
    for key in ["load_balancing_policy", "typed_extension_protocol_options"] {
        assert_eq!(
            local["static_resources"]["clusters"][0][key], patch["patch"]["value"][key],
            "{key}"
        );
    }

    let dir = std::env::temp_dir().join(format!("computeflux-eds-{}", support::unique_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    let eds = dir.join("eds.json");
    std::fs::write(
        &eds,
        json!({"version_info": "1", "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": cluster,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address":
                {"address": "10.0.0.5", "port_value": port}}}}]}]}]})
        .to_string(),
    )
    .unwrap();
    // What Istio generates for an outbound Service cluster (istioctl proxy-config cluster -o
    // json), the fields that bear on load balancing kept.
    let istio_cluster = |extra: Value| -> Value {
        let mut c = json!({
            "name": cluster, "type": "EDS", "connect_timeout": "10s",
            "lb_policy": "LEAST_REQUEST",
            "eds_cluster_config": {"service_name": cluster, "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {"path": eds.display().to_string(),
                                       "watched_directory": {"path": dir.display().to_string()}}}},
            "circuit_breakers": {"thresholds": [{"max_connections": 4294967295u64,
                                                 "max_requests": 4294967295u64}]},
        });
        for v in [extra, patch["patch"]["value"].clone()] {
            for (k, x) in v.as_object().unwrap() {
                c[k] = x.clone();
            }
        }
        c
    };
    let bootstrap = |c: Value| {
        json!({"node": {"id": "gw", "cluster": "gw"},
               "static_resources": {"clusters": [c]}})
    };
    let (ok, text) = envoy_validate(&bootstrap(istio_cluster(json!({}))));
    assert!(ok, "{text}");
    // The caveat pool.yaml states: a locality-weighted DestinationRule cannot take the patch.
    let (ok, text) = envoy_validate(&bootstrap(istio_cluster(
        json!({"common_lb_config": {"locality_weighted_lb_config": {}}}),
    )));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "{text}");
    assert!(text.contains("load_balancing_policy"), "{text}");
}

#[test]
fn gateway_stats_tags_match_envoy_yaml() {
    let cm = &resources()["ConfigMap/computeflux-stats-tags"];
    let bootstrap: Value =
        serde_json::from_str(cm["data"]["custom_bootstrap.json"].as_str().unwrap()).unwrap();
    let local = yaml_doc(&root().join("envoy/envoy.yaml"));
    assert_eq!(
        bootstrap["stats_config"]["stats_tags"],
        local["stats_config"]["stats_tags"]
    );
}

#[test]
fn manifests_pass_the_crd_schema_validators_from_npm() {
    // @kubernetes-models/istio (npm) ships validators generated from Istio 1.29's CRD schemas.
    // Installed once into <target>/istio-schemas from tests/istio_schema/package.json.
    let here = root().join("tests/istio_schema");
    let dir = support::target_dir().join("istio-schemas");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["package.json", "validate.mjs"] {
        std::fs::copy(here.join(f), dir.join(f)).unwrap();
    }
    if !dir.join("node_modules/@kubernetes-models/istio").is_dir() {
        let o = Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--silent"])
            .current_dir(&dir)
            .output()
            .unwrap_or_else(|e| panic!("npm is needed for the Istio schema check: {e}"));
        assert!(
            o.status.success(),
            "npm install: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let files = files_with_ext(&root().join("envoy/istio"), &[".yaml"]);
    let o = Command::new("node")
        .arg("validate.mjs")
        .args(&files)
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| panic!("node is needed for the Istio schema check: {e}"));
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{out}");
    for must in [
        "ok WasmPlugin/computeflux",
        "ok EnvoyFilter/computeflux",
        "ok VirtualService/computeflux",
        "ok EnvoyFilter/computeflux-pool",
        "ok VirtualService/computeflux-pool",
    ] {
        assert!(out.contains(must), "{must} missing:\n{out}");
    }
    assert_eq!(out.matches("ok ServiceEntry/").count(), 4, "{out}");
    assert_eq!(out.matches("ok DestinationRule/").count(), 4, "{out}");
}
