#![cfg(not(target_arch = "wasm32"))]
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

mod deploy_support;
mod support;

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
    for must in ["envoy/envoy.yaml", "envoy/envoy.compose.yaml"] {
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
