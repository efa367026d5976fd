//! Prints the Envoy bootstrap that the integration tests run (`tests/support/envoy.rs`), so that
//! scripts and benches start Envoy with exactly the same configuration.
//!
//! ```text
//! cargo run --example render_bootstrap -- --cluster a=8001 --cluster b=8002 \
//!     [--plugin-config '{"…":…}' | --plugin-config @file.json] [--wasm PATH] \
//!     [--listener-port 10000] [--admin-port 9901] [--concurrency 2] [--route-timeout-ms 30000] \
//!     [--no-filter] > envoy.yaml
//! ```
//!
//! The output is JSON, which Envoy reads from a `.yaml` (or `.json`) file. `--wasm` defaults to
//! `<target>/wasm32-wasip1/release/computeflux.wasm` (not built by this command). `--no-filter`
//! routes everything to the first cluster without the wasm filter (the benches' baseline).
//! `--concurrency` is not part of the bootstrap; pass it to Envoy yourself.

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::Value;
use support::{render_bootstrap, target_dir, EnvoyConfig};

fn parse() -> Result<(EnvoyConfig, PathBuf, u16, u16), String> {
    let mut cfg = EnvoyConfig::default();
    let mut wasm = target_dir().join("wasm32-wasip1/release/computeflux.wasm");
    let (mut listener_port, mut admin_port) = (10000u16, 9901u16);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--no-filter" {
            cfg.with_filter = false;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let port = |v: &str| {
            v.parse::<u16>()
                .map_err(|_| format!("{flag}: bad port {v:?}"))
        };
        match flag.as_str() {
            "--cluster" => {
                let (name, p) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--cluster wants NAME=PORT, got {value:?}"))?;
                cfg.clusters.push((name.to_string(), port(p)?));
            }
            "--plugin-config" => {
                let text = match value.strip_prefix('@') {
                    Some(path) => std::fs::read_to_string(path)
                        .map_err(|e| format!("--plugin-config: reading {path}: {e}"))?,
                    None => value,
                };
                cfg.plugin_config = serde_json::from_str::<Value>(&text)
                    .map_err(|e| format!("--plugin-config is not JSON: {e}"))?;
            }
            "--wasm" => wasm = PathBuf::from(value),
            "--listener-port" => listener_port = port(&value)?,
            "--admin-port" => admin_port = port(&value)?,
            "--concurrency" => {
                cfg.concurrency = value
                    .parse()
                    .map_err(|_| format!("--concurrency: bad number {value:?}"))?
            }
            "--route-timeout-ms" => {
                cfg.route_timeout_ms = value
                    .parse()
                    .map_err(|_| format!("--route-timeout-ms: bad number {value:?}"))?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if cfg.clusters.is_empty() {
        return Err("at least one --cluster NAME=PORT is required".into());
    }
    Ok((cfg, wasm, listener_port, admin_port))
}

fn main() -> ExitCode {
    match parse() {
        Ok((cfg, wasm, listener_port, admin_port)) => {
            print!(
                "{}",
                render_bootstrap(&cfg, &wasm, listener_port, admin_port)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("render_bootstrap: {e}");
            ExitCode::from(2)
        }
    }
}
