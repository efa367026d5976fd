//! Data-parallel ranks of one mock engine (`--data-parallel-size N`, default 1).
//!
//! Why: vLLM (`--data-parallel-size`) and SGLang (`--dp-size`) run several ranks behind one
//! endpoint, each with its own prefix cache. A request carrying `x-data-parallel-rank: k`
//! (any case) goes to rank k; without it the engine's own balancer spreads requests over its
//! ranks, so a conversation's turns find their cache only when they happen to land on the same
//! rank. The bench compares routers that pin ranks with those that cannot.
//!
//! How: one [`PrefixCache`] per rank, the same capacity each (`--cache-tokens` is per rank, as
//! each GPU has its own KV memory). The rank is the header's value when it parses and is below
//! N (another value is refused with 400, as vLLM refuses a rank out of range); without the
//! header, the rank with the fewest requests in flight, ties broken round-robin (vLLM's
//! internal balancer picks the least loaded engine by its queue and running counts).
//! Per-rank counters (requests, prompt and cached tokens, requests in flight) feed
//! `/_mock/stats` (`ranks`) and the vLLM dialect of `/metrics`, whose every series carries the
//! rank as its `engine` label ([`label_ranks`]).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use super::cache::PrefixCache;

/// The request header naming the rank (vLLM and SGLang read it case-insensitively; the mock's
/// header map is lowercase).
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// Most ranks a mock runs.
pub const MAX_RANKS: usize = 64;

/// The counters of one rank.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStats {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Requests that named this rank in the header.
    pub by_header: u64,
}

/// The ranks of one engine.
pub struct Ranks {
    pub caches: Vec<PrefixCache>,
    pub stats: Vec<RankStats>,
    in_flight: Arc<Vec<AtomicI64>>,
    next: usize,
}

/// A request held on a rank: its in-flight count, given back on drop.
pub struct Held {
    in_flight: Arc<Vec<AtomicI64>>,
    rank: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(n) = self.in_flight.get(self.rank) {
            n.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Ranks {
    pub fn new(size: usize, cache_tokens: u64, block_tokens: usize) -> Ranks {
        let size = size.clamp(1, MAX_RANKS);
        Ranks {
            caches: (0..size)
                .map(|_| PrefixCache::new(cache_tokens, block_tokens))
                .collect(),
            stats: vec![RankStats::default(); size],
            in_flight: Arc::new((0..size).map(|_| AtomicI64::new(0)).collect()),
            next: 0,
        }
    }

    pub fn size(&self) -> usize {
        self.caches.len()
    }

    /// The rank for a request whose rank header is `header`: `Err` for a value that names no
    /// rank of this engine.
    pub fn choose(&mut self, header: Option<&str>) -> Result<usize, String> {
        if let Some(v) = header {
            return match v.trim().parse::<usize>() {
                Ok(k) if k < self.size() => {
                    if let Some(s) = self.stats.get_mut(k) {
                        s.by_header += 1;
                    }
                    Ok(k)
                }
                _ => Err(format!(
                    "{RANK_HEADER} {v:?} is not a rank of this engine (0..{})",
                    self.size()
                )),
            };
        }
        let n = self.size();
        let load = |k: usize| self.in_flight(k);
        let start = self.next % n;
        let k = (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&k| load(k))
            .unwrap_or(0);
        self.next = k + 1;
        Ok(k)
    }

    /// Counts a request in flight on `rank` until the returned guard drops.
    pub fn hold(&self, rank: usize) -> Held {
        if let Some(n) = self.in_flight.get(rank) {
            n.fetch_add(1, Ordering::SeqCst);
        }
        Held {
            in_flight: self.in_flight.clone(),
            rank,
        }
    }

    pub fn in_flight(&self, rank: usize) -> i64 {
        self.in_flight
            .get(rank)
            .map_or(0, |n| n.load(Ordering::SeqCst))
    }

    /// The cache of `rank` (`None` past the last rank).
    pub fn cache(&mut self, rank: usize) -> Option<&mut PrefixCache> {
        self.caches.get_mut(rank)
    }

    /// Blocks held by every rank's cache.
    pub fn blocks(&self) -> usize {
        self.caches.iter().map(PrefixCache::len).sum()
    }

    pub fn capacity_blocks(&self) -> usize {
        self.caches.iter().map(PrefixCache::capacity_blocks).sum()
    }

    pub fn flush(&mut self) {
        self.caches.iter_mut().for_each(PrefixCache::flush);
    }

    /// `/_mock/stats`' `ranks`: one object per rank.
    pub fn to_json(&self) -> Value {
        Value::Array(
            self.stats
                .iter()
                .enumerate()
                .map(|(k, s)| {
                    json!({
                        "rank": k,
                        "requests": s.requests,
                        "by_header": s.by_header,
                        "prompt_tokens": s.prompt_tokens,
                        "cached_tokens": s.cached_tokens,
                        "completion_tokens": s.completion_tokens,
                        "in_flight": self.in_flight(k),
                        "cache_blocks": self.caches.get(k).map_or(0, PrefixCache::len),
                    })
                })
                .collect(),
        )
    }
}

/// Merges one exposition per rank (each rendered with `engine="0"`, the same families in the
/// same order) into one whose every series is repeated per rank with `engine="<k>"`, as vLLM
/// labels its series by data-parallel rank: comment lines once, each sample line followed by
/// the same line of the other ranks.
pub fn label_ranks(per_rank: &[String]) -> String {
    let lines: Vec<Vec<&str>> = per_rank.iter().map(|t| t.lines().collect()).collect();
    let Some(first) = lines.first() else {
        return String::new();
    };
    let mut out = String::new();
    for (i, line) in first.iter().enumerate() {
        if line.starts_with('#') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        for (k, rank) in lines.iter().enumerate() {
            let l = rank.get(i).copied().unwrap_or(line);
            out.push_str(&l.replace("engine=\"0\"", &format!("engine=\"{k}\"")));
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_header_names_the_rank_and_a_wrong_one_is_refused() {
        let mut r = Ranks::new(3, 1_000, 16);
        assert_eq!(r.choose(Some("2")), Ok(2));
        assert_eq!(r.choose(Some(" 0 ")), Ok(0));
        assert!(r.choose(Some("3")).is_err());
        assert!(r.choose(Some("-1")).is_err());
        assert!(r.choose(Some("x")).is_err());
        assert_eq!((r.stats[2].by_header, r.stats[0].by_header), (1, 1));
    }

    #[test]
    fn without_the_header_requests_spread_to_the_least_loaded_rank() {
        let mut r = Ranks::new(3, 1_000, 16);
        // Idle: round-robin.
        let picks: Vec<usize> = (0..6).map(|_| r.choose(None).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // Rank 0 and 1 busy: rank 2 until it is as busy.
        let _a = r.hold(0);
        let _b = r.hold(1);
        assert_eq!(r.choose(None), Ok(2));
        let c = r.hold(2);
        assert_eq!(r.in_flight(2), 1);
        drop(c);
        assert_eq!(r.in_flight(2), 0);
        assert_eq!(r.choose(None), Ok(2));
    }

    #[test]
    fn each_rank_has_its_own_cache() {
        let mut r = Ranks::new(2, 1_000, 16);
        let p = vec![b'a'; 64 * 4];
        let h = r.cache(0).unwrap().block_hashes("m", &p);
        r.cache(0).unwrap().touch(&h);
        assert_eq!(r.cache(0).unwrap().cached_blocks(&h), 4);
        assert_eq!(r.cache(1).unwrap().cached_blocks(&h), 0);
        assert_eq!(r.blocks(), 4);
        r.flush();
        assert_eq!(r.blocks(), 0);
    }

    #[test]
    fn series_are_repeated_per_rank() {
        let t = |v: u32| {
            format!("# HELP a x\n# TYPE a gauge\na{{engine=\"0\",model_name=\"m\"}} {v}\n")
        };
        let merged = label_ranks(&[t(1), t(2)]);
        assert_eq!(
            merged,
            "# HELP a x\n# TYPE a gauge\na{engine=\"0\",model_name=\"m\"} 1\na{engine=\"1\",model_name=\"m\"} 2\n"
        );
    }
}
