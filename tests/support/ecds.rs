//! An Envoy whose wasm filter configuration comes by ECDS from a watched file, so that a test
//! can reconfigure the plugin live (same process, same VM, shared data kept) while requests
//! are in flight.

use std::time::Duration;

use serde_json::{json, Value};

use super::envoy::EnvoyConfig;

/// Envoy whose wasm filter configuration comes from a file by ECDS (`config_discovery` with a
/// watched directory), so that the plugin can be reconfigured live.
pub struct EcdsEnvoy {
    child: std::process::Child,
    pub dir: std::path::PathBuf,
    pub admin_port: u16,
    pub port: u16,
    filter: Value,
}

impl EcdsEnvoy {
    pub fn start(plugin: Value, clusters: &[(&str, u16)]) -> EcdsEnvoy {
        EcdsEnvoy::start_with(EnvoyConfig::new(plugin, clusters))
    }

    /// [`EcdsEnvoy::start`] with `cfg`'s route, connection manager and concurrency settings
    /// (its `plugin_config` is the first ECDS version).
    pub fn start_with(cfg: EnvoyConfig) -> EcdsEnvoy {
        EcdsEnvoy::start_module(cfg, &super::wasm_path())
    }

    /// [`EcdsEnvoy::start_with`] running the module `wasm` (see [`EcdsEnvoy::write_module`]).
    pub fn start_module(cfg: EnvoyConfig, wasm: &std::path::Path) -> EcdsEnvoy {
        let plugin = cfg.plugin_config.clone();
        let mut boot: Value =
            serde_json::from_str(&super::render_bootstrap(&cfg, wasm, 0, 0)).unwrap();
        let dir = std::env::temp_dir().join(format!("computeflux-ecds-{}", super::unique_u32()));
        std::fs::create_dir_all(&dir).unwrap();
        let filters = boot
            .pointer_mut(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
            )
            .unwrap();
        let wasm_filter = filters[0]["typed_config"].clone();
        filters[0] = json!({
            "name": "envoy.filters.http.wasm",
            "config_discovery": {
                "config_source": {"path_config_source": {
                    "path": dir.join("filter.json").display().to_string(),
                    "watched_directory": {"path": dir.display().to_string()},
                }},
                "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"],
            },
        });
        let mut e = EcdsEnvoy {
            child: std::process::Command::new("true").spawn().unwrap(),
            dir: dir.clone(),
            admin_port: 0,
            port: 0,
            filter: wasm_filter,
        };
        let _ = e.child.wait();
        e.write_plugin(&plugin, "1");
        let boot_path = dir.join("envoy.json");
        std::fs::write(&boot_path, boot.to_string()).unwrap();
        let admin_path = dir.join("admin.txt");
        e.child = std::process::Command::new(super::envoy_bin())
            .arg("-c")
            .arg(&boot_path)
            .arg("--concurrency")
            .arg(cfg.concurrency.to_string())
            .args(["--disable-hot-restart", "--base-id"])
            .arg(super::unique_u32().to_string())
            .arg("--log-path")
            .arg(dir.join("envoy.log"))
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (admin, port) =
            super::envoy::wait_ready(&mut e.child, &admin_path, Duration::from_secs(20))
                .unwrap_or_else(|err| {
                    panic!(
                        "{err}\n{}",
                        std::fs::read_to_string(dir.join("envoy.log")).unwrap_or_default()
                    )
                });
        e.admin_port = admin;
        e.port = port;
        e
    }

    /// Replaces the plugin configuration (written aside, then renamed into the watched file).
    pub fn write_plugin(&self, plugin: &Value, version: &str) {
        self.write_filter(plugin, None, version);
    }

    /// Replaces the plugin configuration and the module: `wasm` runs in a new VM (`vm_tag` is
    /// its VM configuration, so that even the same module file gets a VM of its own) with the
    /// same `vm_id`, so it shares the old VM's shared data — a module upgrade, with the old
    /// VM's requests still in flight.
    pub fn write_module(
        &self,
        plugin: &Value,
        wasm: &std::path::Path,
        vm_tag: &str,
        version: &str,
    ) {
        self.write_filter(plugin, Some((wasm, vm_tag)), version);
    }

    fn write_filter(
        &self,
        plugin: &Value,
        module: Option<(&std::path::Path, &str)>,
        version: &str,
    ) {
        let mut typed = self.filter.clone();
        typed["config"]["configuration"]["value"] = Value::String(plugin.to_string());
        if let Some((wasm, tag)) = module {
            let vm = &mut typed["config"]["vm_config"];
            vm["code"]["local"]["filename"] = Value::String(wasm.display().to_string());
            vm["configuration"] = json!({
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": tag,
            });
        }
        let doc = json!({
            "version_info": version,
            "resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": "envoy.filters.http.wasm",
                "typed_config": typed,
            }],
        });
        let tmp = self.dir.join("filter.json.tmp");
        std::fs::write(&tmp, doc.to_string()).unwrap();
        std::fs::rename(&tmp, self.dir.join("filter.json")).unwrap();
    }

    pub fn stats(&self) -> std::collections::BTreeMap<String, i64> {
        super::envoy::computeflux_stats(self.admin_port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for EcdsEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
