//! A pool cluster fed by EDS from a watched file, as in `envoy/pool.yaml`: the hosts of one
//! Envoy cluster, picked by the filter through `override_host` (`x-gateway-destination-endpoint`).
//!
//! The file is replaced by rename (Envoy's `watched_directory` reloads it on the move), so that
//! Envoy never reads a half-written membership.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::unique_u32;

/// The header the filter names hosts in (its default `destination_header`).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The response header the pool cluster's upstream filter stamps with the serving host.
pub const STAMP_HEADER: &str = "x-computeflux-upstream-host";

/// A directory holding one cluster's EDS file.
pub struct EdsFile {
    pub cluster: String,
    pub dir: PathBuf,
}

impl EdsFile {
    /// A new directory for `cluster`'s membership, empty at first.
    pub fn new(cluster: &str) -> EdsFile {
        let dir = std::env::temp_dir().join(format!("computeflux-eds-{}", unique_u32()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("EDS dir");
        let f = EdsFile {
            cluster: cluster.to_string(),
            dir,
        };
        f.set(&[]);
        f
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join("eds.json")
    }

    /// Replaces the membership with these ports on 127.0.0.1 (by rename).
    pub fn set(&self, ports: &[u16]) {
        let endpoints: Vec<Value> = ports
            .iter()
            .map(|p| {
                json!({"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": p
                }}}})
            })
            .collect();
        let doc = json!({"resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": self.cluster,
            "endpoints": [{"lb_endpoints": endpoints}],
        }]});
        let tmp = self.dir.join("eds.json.tmp");
        std::fs::write(&tmp, doc.to_string()).expect("EDS file");
        std::fs::rename(&tmp, self.path()).expect("EDS rename");
    }

    /// The pool cluster reading this file: override_host on the destination header, falling
    /// back to `fallback` (`round_robin`, `least_request`), and the upstream stamp.
    pub fn cluster(&self, fallback: &str) -> Value {
        pool_cluster(&self.cluster, &self.path(), &self.dir, fallback)
    }
}

impl Drop for EdsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An EDS cluster fed from `path` (watched in `dir`) whose hosts are picked by the filter's
/// destination header, with the upstream `header_mutation` stamp that names the serving host
/// on every answer (callouts included).
pub fn pool_cluster(name: &str, path: &Path, dir: &Path, fallback: &str) -> Value {
    let fallback_type = match fallback {
        "least_request" => "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
        _ => "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
    };
    json!({
        "name": name,
        "type": "EDS",
        "connect_timeout": "1s",
        "per_connection_buffer_limit_bytes": 16 * 1024 * 1024,
        "eds_cluster_config": {"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {
                "path": path.display().to_string(),
                "watched_directory": {"path": dir.display().to_string()},
            },
        }},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": DESTINATION_HEADER}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": format!("envoy.load_balancing_policies.{fallback}"),
                    "typed_config": {"@type": fallback_type},
                }}]},
            },
        }}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
                "http_filters": [
                    {
                        "name": "envoy.filters.http.header_mutation",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                            "mutations": {"response_mutations": [{"append": {
                                "header": {"key": STAMP_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }}]},
                        },
                    },
                    {
                        "name": "envoy.filters.http.upstream_codec",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"},
                    },
                ],
            },
        },
    })
}
