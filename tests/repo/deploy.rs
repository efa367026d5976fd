//! The deployment files agree with what they name: every Envoy config in the repository passes
//! `envoy --mode validate` with the built module (which also runs the plugin's configuration
//! check), the docker-compose variant of `envoy/envoy.yaml` differs from it only where
//! documented, and `envoy/docker-compose.yml` mounts files that exist, publishes the ports the
//! Envoy config listens on, pins the Envoy version the tests run, and starts the mocks with
//! flags they accept. Docker itself does not run on our machines: these checks stand in for
//! `docker compose up`.
// Test helpers fail loudly: that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::deploy_support;
use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;

use deploy_support::{at, pinned_envoy_version, plugin_config, str_at, wasm_filters, yaml_doc};
use serde_json::{json, Value};

fn root() -> PathBuf {
    deploy_support::root()
}

/// Envoy bootstraps: YAML or JSON files in the repository (outside build output) whose single
/// document has `static_resources`.
fn envoy_configs() -> Vec<PathBuf> {
    deploy_support::files_with_ext(&root(), &[".yaml", ".yml", ".json"])
        .into_iter()
        .filter(|p| {
            let Ok(text) = std::fs::read_to_string(p) else {
                return false;
            };
            let docs = if p.extension().is_some_and(|e| e == "json") {
                serde_json::from_str::<Value>(&text)
                    .map(|v| vec![v])
                    .unwrap_or_default()
            } else {
                deploy_support::yaml_docs_str(&text).unwrap_or_default()
            };
            docs.len() == 1 && docs[0].get("static_resources").is_some()
        })
        .collect()
}

/// Runs `envoy --mode validate` on `bootstrap` (with every wasm module path pointing at the
/// built module) and returns Envoy's output. Panics if validation fails.
fn validate(name: &str, mut bootstrap: Value) -> String {
    let wasm = support::wasm_path().display().to_string();
    let pointers: Vec<String> = wasm_filters(&bootstrap)
        .into_iter()
        .map(|(p, _)| format!("{p}/typed_config/config/vm_config/code/local/filename"))
        .collect();
    for p in &pointers {
        let slot = bootstrap
            .pointer_mut(p)
            .unwrap_or_else(|| panic!("{name}: wasm filter without {p}"));
        *slot = Value::String(wasm.clone());
    }
    let dir = std::env::temp_dir().join(format!("computeflux-deploy-{}", support::unique_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("envoy.json");
    std::fs::write(&path, serde_json::to_string_pretty(&bootstrap).unwrap()).unwrap();
    let out = Command::new(support::envoy_bin())
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "--log-level",
            "info",
            "-c",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("OK"),
        "{name} fails `envoy --mode validate`:\n{text}"
    );
    if !pointers.is_empty() {
        assert!(
            text.contains("configuration accepted"),
            "{name}: the plugin did not accept its configuration:\n{text}"
        );
    }
    text
}

#[test]
fn every_envoy_config_in_the_repo_passes_validate() {
    let configs = envoy_configs();
    let rel: Vec<String> = configs
        .iter()
        .map(|p| p.strip_prefix(root()).unwrap().display().to_string())
        .collect();
    for must in [
        "envoy/envoy.yaml",
        "envoy/envoy.compose.yaml",
        "envoy/pool.yaml",
    ] {
        assert!(
            rel.iter().any(|r| r == must),
            "{must} not found among {rel:?}"
        );
    }
    for (path, name) in configs.iter().zip(&rel) {
        let v = if name.ends_with(".json") {
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
        } else {
            yaml_doc(path)
        };
        validate(name, v);
    }
    // The bootstrap the integration tests and scripts render (examples/render_bootstrap.rs).
    let cfg = support::EnvoyConfig::new(
        json!({"endpoints": [{"name": "a", "cluster": "a"}, {"name": "b", "cluster": "b"}]}),
        &[("a", 18001), ("b", 18002)],
    );
    let text = support::render_bootstrap(&cfg, Path::new("/placeholder.wasm"), 0, 0);
    validate("render_bootstrap", serde_json::from_str(&text).unwrap());
}

/// The Envoy configuration README.md shows a newcomer (its first `yaml` block) is complete: it
/// passes `envoy --mode validate` with the built module, and the plugin accepts the JSON in it.
#[test]
fn the_readme_envoy_snippet_passes_validate() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = readme
        .find("```yaml\n")
        .expect("README.md shows no ```yaml block")
        + "```yaml\n".len();
    let len = readme[start..]
        .find("```")
        .expect("README.md's yaml block is not closed");
    let docs = deploy_support::yaml_docs_str(&readme[start..start + len]).unwrap();
    assert_eq!(docs.len(), 1, "README.md's yaml block: one document");
    let bootstrap = docs.into_iter().next().unwrap();
    assert_eq!(
        wasm_filters(&bootstrap).len(),
        1,
        "README.md's snippet loads the filter"
    );
    validate("README.md", bootstrap);
}

#[test]
fn a_rejected_plugin_configuration_fails_validation() {
    // The check above is only worth something if validate runs the plugin's on_configure.
    let mut v = yaml_doc(&root().join("envoy/envoy.yaml"));
    let (ptr, filter) = wasm_filters(&v).remove(0);
    let mut cfg = plugin_config(&filter);
    cfg["max_attempts"] = json!(99);
    *v.pointer_mut(&format!("{ptr}/typed_config/config/configuration/value"))
        .unwrap() = Value::String(cfg.to_string());
    let result = std::panic::catch_unwind(|| validate("bad max_attempts", v));
    assert!(
        result.is_err(),
        "an invalid plugin configuration passed validation"
    );
}

/// Replaces the parts in which envoy.compose.yaml is documented to differ from envoy.yaml by
/// placeholders, after checking that they have the documented form. Returns the cluster
/// endpoints (cluster name, address, port) that were replaced.
fn normalize(v: &mut Value, compose: bool) -> Vec<(String, String, u64)> {
    let what = if compose {
        "envoy.compose.yaml"
    } else {
        "envoy.yaml"
    };
    let bind = if compose { "0.0.0.0" } else { "127.0.0.1" };
    for p in [
        "/admin/address/socket_address/address",
        "/static_resources/listeners/0/address/socket_address/address",
    ] {
        assert_eq!(str_at(v, p, what), bind, "{what}: {p}");
        *v.pointer_mut(p).unwrap() = json!("BIND");
    }
    for (ptr, _) in wasm_filters(v) {
        let p = format!("{ptr}/typed_config/config/vm_config/code/local/filename");
        let expect = if compose {
            "/etc/envoy/computeflux.wasm"
        } else {
            "target/wasm32-wasip1/release/computeflux.wasm"
        };
        assert_eq!(str_at(v, &p, what), expect, "{what}: {p}");
        *v.pointer_mut(&p).unwrap() = json!("WASM");
    }
    let mut endpoints = Vec::new();
    let clusters = v
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
        .unwrap();
    for c in clusters {
        let name = c["name"].as_str().unwrap().to_string();
        let ty = c["type"].as_str().unwrap().to_string();
        if compose {
            assert_eq!(ty, "STRICT_DNS", "{what}: cluster {name}");
            let fam = c.as_object_mut().unwrap().remove("dns_lookup_family");
            assert_eq!(fam, Some(json!("V4_ONLY")), "{what}: cluster {name}");
        } else {
            assert_eq!(ty, "STATIC", "{what}: cluster {name}");
        }
        c["type"] = json!("TYPE");
        let lbs = c
            .pointer_mut("/load_assignment/endpoints")
            .and_then(Value::as_array_mut)
            .unwrap();
        for group in lbs {
            for lb in group["lb_endpoints"].as_array_mut().unwrap() {
                let sa = lb.pointer_mut("/endpoint/address/socket_address").unwrap();
                endpoints.push((
                    name.clone(),
                    sa["address"].as_str().unwrap().to_string(),
                    sa["port_value"].as_u64().unwrap(),
                ));
                *sa = json!("ADDRESS");
            }
        }
    }
    endpoints
}

/// The first JSON pointer at which `a` and `b` differ, with both values.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| match (x.get(k), y.get(k)) {
                (Some(p), Some(q)) => first_difference(p, q, format!("{at}/{k}")),
                (p, q) => Some(format!("{at}/{k}: envoy.yaml {p:?} vs compose {q:?}")),
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| first_difference(p, q, format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(format!("{at}: envoy.yaml {a} vs compose {b}")),
    }
}

#[test]
fn compose_envoy_config_differs_from_envoy_yaml_only_where_documented() {
    let mut local = yaml_doc(&root().join("envoy/envoy.yaml"));
    let mut compose = yaml_doc(&root().join("envoy/envoy.compose.yaml"));
    let local_eps = normalize(&mut local, false);
    let compose_eps = normalize(&mut compose, true);
    if let Some(d) = first_difference(&local, &compose, String::new()) {
        panic!(
            "envoy/envoy.compose.yaml drifted from envoy/envoy.yaml beyond bind addresses, the \
             module path and the cluster addresses (run scripts/compose-config): {d}"
        );
    }
    assert_eq!(local_eps.len(), compose_eps.len());
    for ((ln, la, _), (cn, ca, cp)) in local_eps.iter().zip(&compose_eps) {
        assert_eq!(ln, cn);
        assert_eq!(la, "127.0.0.1");
        // gpu_a -> service gpu-a, the mock's port in the container.
        assert_eq!(ca, &cn.replace('_', "-"), "cluster {cn}");
        assert_eq!(*cp, 8000, "cluster {cn}");
    }
}

/// The `--flag value` pairs of an argument list.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn strings(v: &Value, what: &str) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} must be a list"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("{what}: {s} is not a string"))
                .to_string()
        })
        .collect()
}

/// `ENTRYPOINT [...]` of a Dockerfile, and its `EXPOSE`d ports.
fn dockerfile(path: &Path) -> (Vec<String>, Vec<u64>) {
    let text = std::fs::read_to_string(path).unwrap();
    let entry = text
        .lines()
        .filter_map(|l| l.strip_prefix("ENTRYPOINT "))
        .next_back()
        .unwrap_or_else(|| panic!("{}: no ENTRYPOINT", path.display()));
    let entry: Value = serde_json::from_str(entry).unwrap();
    let expose = text
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse::<u64>().unwrap()))
        .collect();
    (strings(&entry, "ENTRYPOINT"), expose)
}

#[test]
fn compose_file_agrees_with_the_files_it_names() {
    let envoy_dir = root().join("envoy");
    let compose = yaml_doc(&envoy_dir.join("docker-compose.yml"));
    let envoy_cfg = yaml_doc(&envoy_dir.join("envoy.compose.yaml"));
    let services = at(&compose, "/services", "compose").as_object().unwrap();

    // Image: the official Envoy image at the version the tests run.
    let version = pinned_envoy_version();
    let envoy = &services["envoy"];
    assert_eq!(
        str_at(envoy, "/image", "services.envoy"),
        format!("envoyproxy/envoy:v{version}")
    );
    let out = Command::new(support::envoy_bin())
        .arg("--version")
        .output()
        .unwrap();
    let local = String::from_utf8_lossy(&out.stdout);
    assert!(
        local.contains(&format!("/{version}/")),
        "the tests' Envoy is not {version}: {local}"
    );

    // Mounts: bind mounts of files that exist (the module after the build), read-only, never
    // created on the host; the config mounted where the command reads it; the module mounted
    // where the config loads it from.
    let command = strings(
        at(envoy, "/command", "services.envoy"),
        "services.envoy.command",
    );
    let config_target = flag(&command, "-c").expect("envoy command has -c");
    let wasm_filename = {
        let (_, f) = wasm_filters(&envoy_cfg).remove(0);
        str_at(
            &f,
            "/typed_config/config/vm_config/code/local/filename",
            "envoy.compose.yaml",
        )
        .to_string()
    };
    let wasm_built = support::wasm_path();
    let mut targets = Vec::new();
    for m in at(envoy, "/volumes", "services.envoy").as_array().unwrap() {
        assert_eq!(m["type"], "bind", "{m}");
        assert_eq!(m["read_only"], true, "mounts must be read-only: {m}");
        assert_eq!(
            m.pointer("/bind/create_host_path"),
            Some(&json!(false)),
            "{m}"
        );
        let source = envoy_dir.join(m["source"].as_str().unwrap());
        let target = m["target"].as_str().unwrap().to_string();
        assert!(
            source.is_file(),
            "mount source {} does not exist",
            source.display()
        );
        if target == config_target {
            assert_eq!(
                source.canonicalize().unwrap(),
                envoy_dir.join("envoy.compose.yaml").canonicalize().unwrap()
            );
        } else if target == wasm_filename {
            assert_eq!(
                source.canonicalize().unwrap(),
                wasm_built.canonicalize().unwrap()
            );
        } else {
            panic!("unexpected mount {m}");
        }
        targets.push(target);
    }
    assert!(
        targets.contains(&config_target),
        "the config is not mounted at {config_target}"
    );
    assert!(
        targets.contains(&wasm_filename),
        "the module is not mounted at {wasm_filename}"
    );

    // Ports: what is published is what Envoy listens on (container side), on host loopback.
    let listener = at(
        &envoy_cfg,
        "/static_resources/listeners/0/address/socket_address/port_value",
        "envoy.compose.yaml",
    )
    .as_u64()
    .unwrap();
    let admin = at(
        &envoy_cfg,
        "/admin/address/socket_address/port_value",
        "envoy.compose.yaml",
    )
    .as_u64()
    .unwrap();
    let mut published = Vec::new();
    for p in strings(
        at(envoy, "/ports", "services.envoy"),
        "services.envoy.ports",
    ) {
        let parts: Vec<&str> = p.split(':').collect();
        assert_eq!(
            parts.len(),
            3,
            "publish as host_ip:host_port:container_port: {p}"
        );
        assert_eq!(
            parts[0], "127.0.0.1",
            "publish on the host's loopback only: {p}"
        );
        published.push(parts[2].parse::<u64>().unwrap());
    }
    published.sort();
    let mut expected = vec![listener, admin];
    expected.sort();
    assert_eq!(
        published, expected,
        "published container ports vs envoy.compose.yaml"
    );

    // Upstreams: one service per cluster, named as the cluster's address, listening on the
    // cluster's port, serving the models the plugin configuration routes to it.
    let (_, filter) = wasm_filters(&envoy_cfg).remove(0);
    let plugin = plugin_config(&filter);
    let mock_dockerfile = root().join("envoy/Dockerfile.mock");
    let (entrypoint, exposed) = dockerfile(&mock_dockerfile);
    let mock_port: u64 = flag(&entrypoint, "--port").unwrap().parse().unwrap();
    assert_eq!(exposed, vec![mock_port]);
    assert_eq!(flag(&entrypoint, "--host").as_deref(), Some("0.0.0.0"));
    let clusters = at(
        &envoy_cfg,
        "/static_resources/clusters",
        "envoy.compose.yaml",
    )
    .as_array()
    .unwrap();
    let depends = strings(at(envoy, "/depends_on", "services.envoy"), "depends_on");
    for c in clusters {
        let name = c["name"].as_str().unwrap();
        let sa = at(
            c,
            "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address",
            name,
        );
        let service_name = sa["address"].as_str().unwrap();
        let service = services
            .get(service_name)
            .unwrap_or_else(|| panic!("cluster {name} points at {service_name}, not a service"));
        assert!(
            depends.iter().any(|d| d == service_name),
            "envoy must depend on {service_name}"
        );
        assert_eq!(sa["port_value"].as_u64(), Some(mock_port), "cluster {name}");
        let dockerfile_rel = str_at(service, "/build/dockerfile", service_name);
        let context = envoy_dir.join(str_at(service, "/build/context", service_name));
        assert_eq!(
            context.join(dockerfile_rel).canonicalize().unwrap(),
            mock_dockerfile.canonicalize().unwrap()
        );
        let args = strings(at(service, "/command", service_name), service_name);
        let ep = plugin["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["cluster"] == name)
            .unwrap_or_else(|| panic!("no endpoint routes to cluster {name}"));
        assert_eq!(
            flag(&args, "--name").as_deref(),
            ep["name"].as_str(),
            "{service_name}"
        );
        let models: Vec<String> = flag(&args, "--models")
            .unwrap()
            .split(',')
            .map(str::to_string)
            .collect();
        assert_eq!(models, strings(&ep["models"], "models"), "{service_name}");
    }
}

#[test]
fn compose_mock_command_lines_start_the_mock() {
    // The Dockerfile's ENTRYPOINT plus each service's command, on loopback with a free port
    // (the container binds 0.0.0.0:8000): the flags are ones the mock accepts, and it serves
    // the models it is told to.
    let compose = yaml_doc(&root().join("envoy/docker-compose.yml"));
    let services = compose["services"].as_object().unwrap();
    let mut n = 0;
    for (name, s) in services {
        let Some(cmd) = s.get("command") else {
            continue;
        };
        if name == "envoy" {
            continue;
        }
        let args = strings(cmd, name);
        let svc_name = flag(&args, "--name").unwrap();
        let models = flag(&args, "--models").unwrap();
        let mut rest = Vec::new();
        let mut i = 0;
        while i < args.len() {
            if args[i] == "--name" || args[i] == "--models" {
                i += 2;
                continue;
            }
            rest.push(args[i].as_str());
            i += 1;
        }
        let models: Vec<&str> = models.split(',').collect();
        let mock = support::MockUpstream::start(&svc_name, &models, &rest);
        let listed = support::get(mock.port, "/v1/models").json();
        let ids: Vec<&str> = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert_eq!(ids, models, "{name}: /v1/models");
        n += 1;
    }
    assert_eq!(n, 4, "four mock services");
}

/// The header the filter writes a pool's chosen host into: the configuration's
/// `destination_header`, else its default.
fn destination_header(plugin: &Value) -> String {
    plugin
        .get("destination_header")
        .and_then(Value::as_str)
        .unwrap_or("x-gateway-destination-endpoint")
        .to_ascii_lowercase()
}

/// The `override_host` policy's header sources of a cluster's `load_balancing_policy`.
fn override_host_headers(lbp: &Value, what: &str) -> Vec<String> {
    let ext = at(lbp, "/policies/0/typed_extension_config", what);
    assert_eq!(
        str_at(ext, "/name", what),
        "envoy.load_balancing_policies.override_host",
        "{what}"
    );
    at(ext, "/typed_config/override_host_sources", what)
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s.get("header").and_then(Value::as_str))
        .map(str::to_ascii_lowercase)
        .collect()
}

#[test]
fn pool_yaml_gives_every_pool_an_override_host_eds_cluster_fed_by_its_file() {
    // envoy/pool.yaml (issue 40): each pool entry of the plugin configuration names a cluster
    // that reads the filter's destination header with `override_host`, is fed by EDS from a
    // watched file that exists and assigns that cluster, and the bootstrap sets the node that
    // file-based xDS needs.
    let v = yaml_doc(&root().join("envoy/pool.yaml"));
    assert!(!str_at(&v, "/node/id", "pool.yaml").is_empty());
    assert!(!str_at(&v, "/node/cluster", "pool.yaml").is_empty());
    let (_, filter) = wasm_filters(&v).remove(0);
    let plugin = plugin_config(&filter);
    let header = destination_header(&plugin);
    let pools: Vec<&Value> = plugin["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["pool"] == true)
        .collect();
    assert!(!pools.is_empty(), "pool.yaml has no pool entry");
    let clusters = v["static_resources"]["clusters"].as_array().unwrap();
    for ep in pools {
        let name = str_at(ep, "/cluster", "pool entry");
        let c = clusters
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("cluster {name} missing"));
        assert_eq!(c["type"], "EDS", "{name}");
        assert!(
            c.get("lb_policy").is_none(),
            "{name}: the load_balancing_policy decides"
        );
        assert_eq!(
            override_host_headers(at(c, "/load_balancing_policy", name), name),
            std::slice::from_ref(&header),
            "{name} must read the header the filter writes"
        );
        let src = at(c, "/eds_cluster_config/eds_config/path_config_source", name);
        let file = root().join(str_at(src, "/path", name));
        let dir = root().join(str_at(src, "/watched_directory/path", name));
        assert_eq!(
            file.parent(),
            Some(dir.as_path()),
            "{name}: the file is in the watched directory"
        );
        let eds: Value = if file.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
        } else {
            yaml_doc(&file)
        };
        assert_eq!(eds["resources"][0]["cluster_name"], name);
        assert!(
            eds["resources"][0]["endpoints"][0]["lb_endpoints"]
                .as_array()
                .is_some_and(|l| !l.is_empty()),
            "{name}: the file lists hosts"
        );
    }
}

/// A running Envoy started from a bootstrap value; stopped by PID when dropped.
struct RawEnvoy {
    child: std::process::Child,
    port: u16,
    dir: PathBuf,
}

impl RawEnvoy {
    fn start(bootstrap: &Value) -> RawEnvoy {
        let dir = std::env::temp_dir().join(format!("computeflux-pool-{}", support::unique_u32()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("envoy.json");
        std::fs::write(&path, bootstrap.to_string()).unwrap();
        let admin = dir.join("admin.txt");
        let child = Command::new(support::envoy_bin())
            .arg("-c")
            .arg(&path)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "--log-level",
                "warn",
            ])
            .args(["--base-id", &support::unique_u32().to_string()])
            .arg("--admin-address-path")
            .arg(&admin)
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut e = RawEnvoy {
            child,
            port: 0,
            dir,
        };
        let (_, port) =
            support::envoy::wait_ready(&mut e.child, &admin, std::time::Duration::from_secs(20))
                .unwrap_or_else(|err| panic!("pool Envoy not ready: {err}"));
        e.port = port;
        e
    }
}

impl Drop for RawEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes the EDS file of `cluster` with these ports and renames it into `dir`.
fn write_eds(dir: &Path, file: &str, cluster: &str, ports: &[u16]) {
    let lb: Vec<Value> = ports
        .iter()
        .map(|p| json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}))
        .collect();
    let doc = json!({"version_info": support::unique_u32().to_string(), "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": cluster, "endpoints": [{"lb_endpoints": lb}]}]});
    let tmp = dir.join(".eds.tmp");
    std::fs::write(&tmp, doc.to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(file)).unwrap();
}

#[test]
fn pool_yaml_cluster_sends_a_request_to_the_host_named_and_follows_its_file() {
    // The pool cluster of envoy/pool.yaml, live (the filter's side of pools is tested in its
    // own integration tests): its route sends straight to the cluster, the EDS file is a
    // temporary copy listing two mocks. A header naming one host reaches it; a list falls
    // through to a host that exists; a host added to the file is reached soon after.
    let mut v = yaml_doc(&root().join("envoy/pool.yaml"));
    let (ptr, filter) = wasm_filters(&v).remove(0);
    let plugin = plugin_config(&filter);
    let header = destination_header(&plugin);
    let cluster = plugin["endpoints"][0]["cluster"]
        .as_str()
        .unwrap()
        .to_string();
    let hcm_ptr = ptr.rsplit_once("/http_filters").unwrap().0.to_string();
    let hcm = v.pointer_mut(&hcm_ptr).unwrap();
    hcm["http_filters"]
        .as_array_mut()
        .unwrap()
        .retain(|f| f["name"] != "envoy.filters.http.wasm");
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"] =
        json!({"cluster": cluster, "timeout": "10s"});
    v["admin"]["address"]["socket_address"]["port_value"] = json!(0);
    v["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = json!(0);
    let eds_dir =
        std::env::temp_dir().join(format!("computeflux-pool-eds-{}", support::unique_u32()));
    std::fs::create_dir_all(&eds_dir).unwrap();
    let c = v["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == cluster.as_str())
        .unwrap();
    let src = &mut c["eds_cluster_config"]["eds_config"]["path_config_source"];
    src["path"] = json!(eds_dir.join("eds.json").display().to_string());
    src["watched_directory"]["path"] = json!(eds_dir.display().to_string());
    let mocks: Vec<support::MockUpstream> = ["p0", "p1", "p2"]
        .iter()
        .map(|n| support::MockUpstream::start(n, &[], &[]))
        .collect();
    write_eds(
        &eds_dir,
        "eds.json",
        &cluster,
        &[mocks[0].port, mocks[1].port],
    );
    let envoy = RawEnvoy::start(&v);
    let body = support::chat_body("m", &["hi"], json!({}));
    let served_by = |value: &str| -> Option<String> {
        let r =
            support::http::try_post_chat(envoy.port, &[(header.as_str(), value)], &body).ok()?;
        r.header("x-mock-endpoint").map(str::to_string)
    };
    for _ in 0..5 {
        assert_eq!(served_by(&mocks[1].addr()).as_deref(), Some("p1"));
        assert_eq!(served_by(&mocks[0].addr()).as_deref(), Some("p0"));
    }
    // Not in the cluster yet: the list falls through to the next host that is.
    let list = format!("{},{}", mocks[2].addr(), mocks[1].addr());
    assert_eq!(served_by(&list).as_deref(), Some("p1"));
    write_eds(
        &eds_dir,
        "eds.json",
        &cluster,
        &[mocks[0].port, mocks[1].port, mocks[2].port],
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if served_by(&mocks[2].addr()).as_deref() == Some("p2") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a host added to the file was not reached within 10 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    drop(envoy);
    let _ = std::fs::remove_dir_all(&eds_dir);
}

/// The fields of Envoy Gateway's API that `envoy/gateway/pool.yaml` may use (from
/// envoyproxy/gateway `api/v1alpha1`: BackendTrafficPolicy, `LoadBalancer`,
/// `EndpointOverride`; and the Gateway API's HTTPRoute v1), as `(pointer, allowed)`: every leaf
/// of a document must sit under one of these pointers (array indices dropped).
const GATEWAY_FIELDS: &[&str] = &[
    "/apiVersion",
    "/kind",
    "/metadata/name",
    "/metadata/namespace",
    "/spec/parentRefs/name",
    "/spec/parentRefs/namespace",
    "/spec/hostnames",
    "/spec/rules/matches/headers/name",
    "/spec/rules/matches/headers/value",
    "/spec/rules/filters/type",
    "/spec/rules/filters/requestHeaderModifier/remove",
    "/spec/rules/backendRefs/name",
    "/spec/rules/backendRefs/port",
    "/spec/rules/timeouts/request",
    "/spec/targetRefs/group",
    "/spec/targetRefs/kind",
    "/spec/targetRefs/name",
    "/spec/loadBalancer/type",
    "/spec/loadBalancer/endpointOverride/extractFrom/header",
    "/spec/targetRef/group",
    "/spec/targetRef/kind",
    "/spec/targetRef/name",
    "/spec/type",
    "/spec/jsonPatches/type",
    "/spec/jsonPatches/name",
    "/spec/jsonPatches/operation/op",
    "/spec/jsonPatches/operation/path",
    // Free-form: an xDS value, checked against envoy/pool.yaml below.
    "/spec/jsonPatches/operation/value/*",
];

/// Every leaf of `v` as a pointer without array indices.
fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                leaves(x, format!("{at}/{k}"), out);
            }
        }
        Value::Array(a) if a.iter().any(|x| x.is_object()) => {
            for x in a {
                leaves(x, at.clone(), out);
            }
        }
        _ => out.push(at),
    }
}

#[test]
fn gateway_pool_overrides_the_endpoint_of_the_routes_own_cluster() {
    // envoy/gateway/pool.yaml: only fields of Envoy Gateway's and the Gateway API's schemas
    // (a hand-written subset: no Envoy Gateway CRD validator runs here), a load-balancer type
    // from its enum, the endpoint override reading the header the filter writes, attached to
    // the route whose rule's cluster name (Envoy Gateway's `httproute/<ns>/<name>/rule/<i>`)
    // the routing header matches.
    let docs = deploy_support::yaml_docs(&root().join("envoy/gateway/pool.yaml"));
    let mut fields = Vec::new();
    for d in &docs {
        leaves(d, String::new(), &mut fields);
    }
    let unknown: Vec<&String> = fields
        .iter()
        .filter(|f| {
            !GATEWAY_FIELDS.iter().any(|g| match g.strip_suffix('*') {
                Some(prefix) => f.starts_with(prefix),
                None => f == g,
            })
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "fields outside the known schema: {unknown:?}"
    );
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k}"))
    };
    let route = kind("HTTPRoute");
    let btp = kind("BackendTrafficPolicy");
    assert_eq!(route["apiVersion"], "gateway.networking.k8s.io/v1");
    assert_eq!(btp["apiVersion"], "gateway.envoyproxy.io/v1alpha1");
    let lb = &btp["spec"]["loadBalancer"];
    assert!(
        ["ConsistentHash", "LeastRequest", "Random", "RoundRobin"]
            .contains(&lb["type"].as_str().unwrap()),
        "{lb}"
    );
    let sources = lb["endpointOverride"]["extractFrom"].as_array().unwrap();
    assert!((1..=10).contains(&sources.len()));
    let local = yaml_doc(&root().join("envoy/pool.yaml"));
    let (_, filter) = wasm_filters(&local).remove(0);
    assert_eq!(
        sources[0]["header"].as_str().unwrap(),
        destination_header(&plugin_config(&filter))
    );
    // The stamp the filter learns the pods from, on the route's cluster, as in envoy/pool.yaml.
    let patch = &kind("EnvoyPatchPolicy")["spec"]["jsonPatches"][0];
    assert_eq!(
        patch["type"],
        "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    );
    assert_eq!(
        patch["name"],
        format!(
            "httproute/{}/{}/rule/0",
            str_at(route, "/metadata/namespace", "route"),
            str_at(route, "/metadata/name", "route")
        )
        .as_str()
    );
    assert_eq!(
        patch["operation"]["path"],
        "/typed_extension_protocol_options"
    );
    assert_eq!(
        patch["operation"]["value"],
        local["static_resources"]["clusters"][0]["typed_extension_protocol_options"]
    );
    let target = &btp["spec"]["targetRefs"][0];
    assert_eq!(target["kind"], "HTTPRoute");
    assert_eq!(target["name"], route["metadata"]["name"]);
    assert_eq!(btp["metadata"]["namespace"], route["metadata"]["namespace"]);
    for (i, rule) in route["spec"]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let own = format!(
            "httproute/{}/{}/rule/{i}",
            str_at(route, "/metadata/namespace", "route"),
            str_at(route, "/metadata/name", "route")
        );
        let m = &rule["matches"][0]["headers"][0];
        assert_eq!(m["name"], "x-computeflux-cluster");
        assert_eq!(
            m["value"],
            own.as_str(),
            "rule {i} matches its own cluster's name"
        );
    }
}
