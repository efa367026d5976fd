//! Data-parallel ranks of one mock engine (`--data-parallel-size N`, default 1).
//!
//! Why: vLLM (`--data-parallel-size`) and SGLang (`--dp-size`) run several ranks behind one
//! endpoint, each an engine core of its own: its own prefix cache, its own running batch and
//! waiting queue, its own series on `/metrics`. A request carrying `x-data-parallel-rank: k`
//! (any case) goes to rank k; without it the engine's own balancer spreads requests over its
//! ranks, so a conversation's turns find their cache only when they happen to land on the same
//! rank. The bench compares routers that pin ranks with those that cannot, and the tests make
//! one rank full while the other has room.
//!
//! How: one [`PrefixCache`] per rank, the same capacity each (`--cache-tokens` is per rank, as
//! each GPU has its own KV memory), and one [`RankLoad`] per rank: its requests waiting for one
//! of its slots, running in its batch, decoding, and the KV blocks its running requests hold
//! (`--max-concurrency` slots per rank, as vLLM's `--max-num-seqs` is per engine core; a
//! rank's requests wait only behind that rank's). The rank is the header's value when it parses
//! and is below N (another value is refused with 400, as vLLM refuses a rank out of range);
//! without the header, the rank with the fewest requests waiting or running, ties broken
//! round-robin (vLLM's internal balancer picks the least loaded engine by its queue and running
//! counts). Per-rank counters (requests, prompt and cached tokens, the load) feed
//! `/_mock/stats` (`ranks`) and `/metrics`, whose every series is then written once per rank
//! with the rank as a label (vLLM `engine="<k>"`, SGLang `dp_rank="<k>"`: [`interleave`]).

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

/// What one rank bears now (gauges, each moved by a [`Held`]).
#[derive(Default, Debug)]
pub struct RankLoad {
    /// Requests waiting for one of the rank's slots.
    pub waiting: AtomicI64,
    /// Requests holding one of its slots (its running batch).
    pub running: AtomicI64,
    /// Of those, the ones decoding (the batched model's batch slowdown).
    pub decoding: AtomicI64,
    /// KV-cache blocks held by its running requests (prompt and output).
    pub kv_blocks: AtomicI64,
}

/// Which gauge of a [`RankLoad`].
pub type Which = fn(&RankLoad) -> &AtomicI64;

/// The load of every rank, shared by the requests that move it.
pub type Loads = Arc<Vec<RankLoad>>;

/// Adds to one gauge of one rank until dropped.
pub struct Held {
    loads: Loads,
    rank: usize,
    which: Which,
    delta: i64,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(l) = self.loads.get(self.rank) {
            (self.which)(l).fetch_sub(self.delta, Ordering::SeqCst);
        }
    }
}

/// Adds `delta` to gauge `which` of `rank` until the returned guard drops.
pub fn hold(loads: &Loads, rank: usize, which: Which, delta: i64) -> Held {
    if let Some(l) = loads.get(rank) {
        which(l).fetch_add(delta, Ordering::SeqCst);
    }
    Held {
        loads: loads.clone(),
        rank,
        which,
        delta,
    }
}

/// Gauge `which` of `rank` now (0 past the last rank, never negative).
pub fn read(loads: &Loads, rank: usize, which: Which) -> u64 {
    loads
        .get(rank)
        .map_or(0, |l| which(l).load(Ordering::SeqCst).max(0) as u64)
}

/// The ranks of one engine.
pub struct Ranks {
    pub caches: Vec<PrefixCache>,
    pub stats: Vec<RankStats>,
    loads: Loads,
    next: usize,
}

impl Ranks {
    pub fn new(size: usize, cache_tokens: u64, block_tokens: usize) -> Ranks {
        let size = size.clamp(1, MAX_RANKS);
        Ranks {
            caches: (0..size)
                .map(|_| PrefixCache::new(cache_tokens, block_tokens))
                .collect(),
            stats: vec![RankStats::default(); size],
            loads: Arc::new((0..size).map(|_| RankLoad::default()).collect()),
            next: 0,
        }
    }

    pub fn size(&self) -> usize {
        self.caches.len()
    }

    /// The ranks' loads (moved by the requests without the state lock).
    pub fn loads(&self) -> Loads {
        self.loads.clone()
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

    /// Requests of `rank` waiting or running.
    pub fn in_flight(&self, rank: usize) -> u64 {
        read(&self.loads, rank, |l| &l.waiting) + read(&self.loads, rank, |l| &l.running)
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
        let l = &self.loads;
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
                        "waiting": read(l, k, |l| &l.waiting),
                        "running": read(l, k, |l| &l.running),
                        "in_flight": self.in_flight(k),
                        "kv_blocks_used": read(l, k, |l| &l.kv_blocks),
                        "cache_blocks": self.caches.get(k).map_or(0, PrefixCache::len),
                    })
                })
                .collect(),
        )
    }
}

/// Merges one exposition per rank (each rendered with its own rank label, the same families in
/// the same order) into one page: comment lines once, each sample line followed by the same
/// line of the other ranks, as an engine's page lists every rank's series of a family together.
pub fn interleave(per_rank: &[String]) -> String {
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
        for rank in &lines {
            out.push_str(rank.get(i).copied().unwrap_or(line));
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
        let loads = r.loads();
        // Idle: round-robin.
        let picks: Vec<usize> = (0..6).map(|_| r.choose(None).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        // Rank 0 running, rank 1 queueing: rank 2 until it is as busy.
        let _a = hold(&loads, 0, |l| &l.running, 1);
        let _b = hold(&loads, 1, |l| &l.waiting, 1);
        assert_eq!(r.choose(None), Ok(2));
        let c = hold(&loads, 2, |l| &l.running, 1);
        assert_eq!(r.in_flight(2), 1);
        drop(c);
        assert_eq!(r.in_flight(2), 0);
        assert_eq!(r.choose(None), Ok(2));
    }

    #[test]
    fn each_rank_has_its_own_load() {
        let r = Ranks::new(2, 1_000, 16);
        let loads = r.loads();
        let held: Vec<Held> = (0..3)
            .map(|_| hold(&loads, 0, |l| &l.waiting, 1))
            .chain([hold(&loads, 1, |l| &l.kv_blocks, 7)])
            .collect();
        let rank = |k: usize| {
            let v = &r.to_json()[k];
            (v["waiting"].as_u64(), v["kv_blocks_used"].as_u64())
        };
        assert_eq!((rank(0), rank(1)), ((Some(3), Some(0)), (Some(0), Some(7))));
        drop(held);
        assert_eq!((rank(0), rank(1)), ((Some(0), Some(0)), (Some(0), Some(0))));
        // Past the last rank: nothing moves, nothing panics.
        let _none = hold(&loads, 9, |l| &l.running, 1);
        assert_eq!(read(&loads, 9, |l| &l.running), 0);
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
    fn series_are_interleaved_per_rank() {
        let t = |k: u32, v: u32| {
            format!("# HELP a x\n# TYPE a gauge\na{{engine=\"{k}\",model_name=\"m\"}} {v}\n")
        };
        let merged = interleave(&[t(0, 1), t(1, 2)]);
        assert_eq!(
            merged,
            "# HELP a x\n# TYPE a gauge\na{engine=\"0\",model_name=\"m\"} 1\na{engine=\"1\",model_name=\"m\"} 2\n"
        );
    }
}
