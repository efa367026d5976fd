//! The simulated prefix KV cache of one inference instance.
//!
//! Why: the balancer under test exists to keep a conversation on the instance that already holds
//! its KV cache, so the mock must make a cache hit observable (in `cached_tokens`) and cheaper (in
//! latency) in the same way vLLM's automatic prefix caching does.
//!
//! How: the prompt text is cut into tokens of [`BYTES_PER_TOKEN`] bytes and tokens into blocks of
//! `block_tokens`. Each *full* block gets a chained hash (xxh3 of the block's bytes seeded with the
//! previous block's hash, the first seeded with the model's hash), so a block hash stands for the
//! whole prefix up to its end. A prompt's cached prefix is the run of leading block hashes found
//! in the cache. The cache holds at most `cache_tokens / block_tokens` blocks and evicts the least
//! recently used one; a served prompt's blocks are touched last-block-first, so a conversation's
//! tail is evicted before its head (as vLLM frees blocks in reverse order).

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// One mock token is this many bytes of the prompt text (the last token may be shorter).
pub const BYTES_PER_TOKEN: usize = 4;

/// Number of tokens in a prompt of `len` bytes.
pub fn token_count(len: usize) -> u64 {
    len.div_ceil(BYTES_PER_TOKEN) as u64
}

/// Bounded LRU of prefix-block hashes.
pub struct PrefixCache {
    block_tokens: usize,
    capacity_blocks: usize,
    tick: u64,
    last_use: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new(cache_tokens: u64, block_tokens: usize) -> Self {
        let block_tokens = block_tokens.max(1);
        let capacity_blocks = (cache_tokens / block_tokens as u64) as usize;
        PrefixCache {
            block_tokens,
            capacity_blocks,
            tick: 0,
            last_use: HashMap::new(),
            by_tick: BTreeMap::new(),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    /// Chained hashes of the prompt's full blocks, in order.
    pub fn block_hashes(&self, model: &str, prompt: &[u8]) -> Vec<u64> {
        let block_bytes = self.block_tokens * BYTES_PER_TOKEN;
        let mut prev = xxh3_64(model.as_bytes());
        prompt
            .chunks_exact(block_bytes)
            .map(|block| {
                prev = xxh3_64_with_seed(block, prev);
                prev
            })
            .collect()
    }

    /// How many leading blocks of `hashes` are cached.
    pub fn cached_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.last_use.contains_key(h))
            .count()
    }

    /// Marks every block as just used (inserting missing ones), then evicts down to capacity.
    pub fn touch(&mut self, hashes: &[u64]) {
        for &h in hashes.iter().rev() {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(h, self.tick) {
                self.by_tick.remove(&old);
            }
            self.by_tick.insert(self.tick, h);
        }
        while self.last_use.len() > self.capacity_blocks {
            match self.by_tick.pop_first() {
                Some((_, h)) => {
                    self.last_use.remove(&h);
                }
                None => break,
            }
        }
    }

    pub fn flush(&mut self) {
        self.last_use.clear();
        self.by_tick.clear();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn extended_prompt_hits_its_prefix_blocks() {
        let mut c = PrefixCache::new(1_000, 16);
        let first = vec![b'a'; 64 * 3 + 10];
        let h1 = c.block_hashes("m", &first);
        assert_eq!(h1.len(), 3);
        assert_eq!(c.cached_blocks(&h1), 0);
        c.touch(&h1);
        let mut second = first.clone();
        second.extend_from_slice(&[b'b'; 100]);
        let h2 = c.block_hashes("m", &second);
        assert_eq!(c.cached_blocks(&h2), 3);
        assert_eq!(c.cached_blocks(&c.block_hashes("other", &second)), 0);
    }

    #[test]
    fn evicts_tail_before_head() {
        let mut c = PrefixCache::new(16 * 2, 16);
        let p = vec![b'x'; 64 * 3];
        let h = c.block_hashes("m", &p);
        c.touch(&h);
        assert_eq!(c.len(), 2);
        assert_eq!(c.cached_blocks(&h), 2);
    }
}
