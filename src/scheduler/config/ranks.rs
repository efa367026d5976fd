//! Data-parallel ranks as endpoints of their own.
//!
//! Why: one engine may run several data-parallel ranks (vLLM `--data-parallel-size`, SGLang
//! `--dp-size`), each with its own prefix (KV) cache. Without a rank named on the request the
//! engine's own balancer spreads a conversation's turns over its ranks, and the cache is found
//! only by chance. Both engines honour the request header `x-data-parallel-rank`.
//!
//! How: an endpoint with `data_parallel_size: n > 1` becomes `n` endpoints, one per rank, named
//! `<name>-r<k>` (so ids, metrics labels and pins are per rank, and stable across reloads),
//! sharing the cluster, weight, models and headers, plus [`RANK_HEADER`]`: <k>`. Each rank is
//! then placed, pinned and bounded like any endpoint: a session keeps its rank on every turn,
//! on every replica. [`expand`] is a plain function over one endpoint's configuration, so it
//! composes with however endpoints are produced (a configured list, or an Envoy cluster's
//! hosts).
//!
//! The filter removes a client's own [`RANK_HEADER`] from every request: only the filter
//! chooses ranks.
//!
//! Scraped load: every rank scrapes its engine's `/metrics` page and reads its own series where
//! the page labels them by rank (vLLM `engine`, SGLang `dp_rank`: `wire::engine_load::parse_rank`),
//! so a rank is saturated by its own queue and KV cache. On a page without rank labels each
//! rank's share is the engine's queue and running batch split evenly ([`DataParallel::share`]),
//! KV-cache usage (a mean) as is.

use super::EndpointConfig;
use crate::scheduler::state::hash::endpoint_id;

/// The request header naming the data-parallel rank (vLLM and SGLang, case-insensitive).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// The largest accepted `data_parallel_size`.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 64;

/// The rank an endpoint stands for, of how many its engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallel {
    pub rank: u32,
    pub size: u32,
}

impl DataParallel {
    /// This rank's even share of an engine-wide count, rounded up (one queued request shows on
    /// every rank rather than on none).
    pub fn share(&self, engine_total: u32) -> u32 {
        engine_total.div_ceil(self.size.max(1))
    }
}

/// The name of rank `rank` of endpoint `name`.
pub fn rank_name(name: &str, rank: u32) -> String {
    format!("{name}-r{rank}")
}

/// The endpoints `ep` stands for with `size` data-parallel ranks: itself for `size <= 1`, else
/// one per rank (see the module doc).
pub fn expand(ep: EndpointConfig, size: u32) -> Vec<EndpointConfig> {
    if size <= 1 {
        return vec![ep];
    }
    (0..size)
        .map(|rank| {
            let name = rank_name(&ep.name, rank);
            let mut headers = ep.headers.clone();
            headers.push((RANK_HEADER.to_string(), rank.to_string()));
            EndpointConfig {
                id: endpoint_id(&name),
                name,
                headers,
                data_parallel: Some(DataParallel { rank, size }),
                ..ep.clone()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::config::Config;
    use serde_json::json;

    fn cfg(v: serde_json::Value) -> Result<Config, Vec<crate::scheduler::config::ConfigError>> {
        Config::from_value(&v)
    }

    #[test]
    fn an_endpoint_with_ranks_becomes_one_endpoint_per_rank() {
        let c = cfg(json!({"endpoints": [
            {"name": "gpu", "cluster": "cg", "weight": 2, "models": ["m"],
             "headers": {"x-key": "v"}, "data_parallel_size": 3},
            {"name": "solo", "cluster": "cs"}
        ]}))
        .unwrap();
        let names: Vec<&str> = c.endpoints.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["gpu-r0", "gpu-r1", "gpu-r2", "solo"]);
        for (k, e) in c.endpoints.iter().take(3).enumerate() {
            assert_eq!(e.cluster, "cg");
            assert_eq!(e.weight, 2.0);
            assert_eq!(e.models.as_deref(), Some(&["m".to_string()][..]));
            assert_eq!(e.id, endpoint_id(&format!("gpu-r{k}")));
            assert_eq!(
                e.headers,
                vec![
                    ("x-key".to_string(), "v".to_string()),
                    (RANK_HEADER.to_string(), k.to_string())
                ]
            );
            assert_eq!(
                e.data_parallel,
                Some(DataParallel {
                    rank: k as u32,
                    size: 3
                })
            );
        }
        let solo = &c.endpoints[3];
        assert_eq!((solo.data_parallel, solo.headers.len()), (None, 0));
        // Size 1 (the default, or said) is the endpoint itself.
        let one =
            cfg(json!({"endpoints": [{"name": "a", "cluster": "c", "data_parallel_size": 1}]}))
                .unwrap();
        assert_eq!(one.endpoints[0].name, "a");
        assert_eq!(one.endpoints[0].data_parallel, None);
    }

    #[test]
    fn bad_sizes_and_clashes_are_refused_with_their_field() {
        let problems = |v| {
            cfg(v)
                .unwrap_err()
                .into_iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        };
        for bad in [json!(0), json!(65), json!(2.5), json!("2")] {
            let p = problems(
                json!({"endpoints": [{"name": "a", "cluster": "c", "data_parallel_size": bad}]}),
            );
            assert!(p.contains("endpoints[0].data_parallel_size"), "{p}");
        }
        let p = problems(
            json!({"endpoints": [{"name": "a", "cluster": "c", "data_parallel_size": 2,
            "headers": {"X-Data-Parallel-Rank": "1"}}]}),
        );
        assert!(
            p.contains("endpoints[0].headers.X-Data-Parallel-Rank"),
            "{p}"
        );
        let long = "n".repeat(62);
        let p = problems(
            json!({"endpoints": [{"name": long, "cluster": "c", "data_parallel_size": 16}]}),
        );
        assert!(p.contains("endpoints[0].name"), "{p}");
        // A rank's name taken by another endpoint.
        let p = problems(json!({"endpoints": [
            {"name": "a", "cluster": "c", "data_parallel_size": 2},
            {"name": "a-r1", "cluster": "c"}
        ]}));
        assert!(p.contains("\"a-r1\" is used twice"), "{p}");
        // The total, ranks counted, is bounded like the list.
        let many: Vec<_> = (0..20)
            .map(|i| json!({"name": format!("e{i}"), "cluster": "c", "data_parallel_size": 64}))
            .collect();
        let p = problems(json!({ "endpoints": many }));
        assert!(p.contains("at most 1024"), "{p}");
    }

    #[test]
    fn shares_split_evenly_rounding_up() {
        let r = DataParallel { rank: 1, size: 4 };
        assert_eq!([0, 1, 4, 5, 8].map(|n| r.share(n)), [0, 1, 1, 2, 2]);
        assert_eq!(DataParallel { rank: 0, size: 0 }.share(3), 3);
    }
}
