//! The endpoint table as it is stored: a small header key and the entries in groups of
//! [`GROUP_LEN`] under keys of their own (a request copies across the host boundary
//! the header and the groups it reads or writes, not the whole fleet).
//!
//! Header ([`TABLE_KEY`]): version byte, retry budget, layout generation, entry count, then
//! one version per group (the highest version of that group any writer recorded). Group `g`
//! ([`group_key`]): version byte, its own version, its entry count, then its entries (entries
//! `g × GROUP_LEN ..` of the layout, each id, write stamp, state). A write changes a group
//! under that group's CAS, with a version one more than both the group's and the header's
//! record of it (the entries it changed get that version as their stamp), then records the
//! version in the header under the header's CAS, as a maximum: versions only move up, so a
//! lost race on the header never hides an entry update, and a reader that compares the
//! header's versions with the ones it last read reads only the groups that moved.

use super::{decode_entry, encode_entry, u32_at, u64_at, EndpointState, Table, ENTRY_BYTES};
use super::{BUDGET_BYTES, TABLE_KEY, TABLE_VERSION};
use crate::scheduler::health::budget::RetryBudget;
use crate::scheduler::state::codec::{Reader, Writer};
use crate::scheduler::state::store::{numbered_key, update_owned, Store, CAS_RETRIES};

/// Entries per group key. A request reads the header plus each group that changed since its
/// worker last read it, and writes the group of its endpoint: smaller groups copy fewer bytes
/// per changed group, larger ones keep the header (one version per group) smaller. Measured
/// (`tests/cost`, new session at 512 endpoints): 16 copies 16.4 KB in and 15.1 KB out for
/// 213 130 instructions; 8 copies 11.0 KB and 9.5 KB for 220 596 (the header of 64 versions
/// is read, decoded and written by every table write).
pub const GROUP_LEN: usize = 16;

/// Version byte, budget, layout generation, entry count (then one version per group).
const HEAD_BYTES: usize = 1 + BUDGET_BYTES + 8 + 4;
/// Version byte, the group's version, its entry count (then its entries).
const GROUP_HEAD_BYTES: usize = 1 + 8 + 4;

/// The shared-data key of group `g`: `{TABLE_KEY}/g{g}`.
pub fn group_key(g: usize) -> String {
    numbered_key(&[TABLE_KEY, "/g"], g as u64)
}

/// The version a write of a group takes: one more than both its stored version and the
/// header's record of it (versions only move up, also over a group reset by garbage).
fn next_version(stored: u64, recorded: u64) -> u64 {
    stored.max(recorded).wrapping_add(1)
}

/// The entries of `table` that group `g` holds.
fn group_part(table: &Table, g: usize) -> &[(u32, EndpointState)] {
    let from = g.saturating_mul(GROUP_LEN);
    table
        .entries
        .get(from..from.saturating_add(group_size(table.entries.len(), g)))
        .unwrap_or(&[])
}

/// Groups of a table of `entries` entries.
pub fn groups(entries: usize) -> usize {
    entries.div_ceil(GROUP_LEN)
}

/// Entries of group `g` in a table of `entries` entries.
fn group_size(entries: usize, g: usize) -> usize {
    entries
        .saturating_sub(g.saturating_mul(GROUP_LEN))
        .min(GROUP_LEN)
}

/// A header to write (see [`Head`] for one read).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Header {
    pub budget: RetryBudget,
    pub generation: u64,
    pub entries: usize,
    /// By group: the highest version recorded.
    pub versions: Vec<u64>,
}

impl Header {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(HEAD_BYTES + 8 * self.versions.len());
        w.u8(TABLE_VERSION);
        self.budget.encode(&mut w);
        w.u64(self.generation);
        w.u32(self.entries as u32);
        for g in 0..groups(self.entries) {
            w.u64(self.versions.get(g).copied().unwrap_or(0));
        }
        w.buf
    }
}

/// The stored header as read: its budget, generation and entry count decoded, the versions
/// left in its bytes. A request reads the version of each group it compares where it lies and
/// records a version by rewriting its 8 bytes in place, instead of decoding every group's
/// version into a list and encoding them all again (two of each per request, about 300
/// instructions per group under wasm, 32 groups at 512 endpoints).
#[derive(Debug, Clone, PartialEq)]
pub struct Head {
    pub budget: RetryBudget,
    pub generation: u64,
    pub entries: usize,
    /// The stored bytes (the budget's as read: [`Head::into_bytes`] writes `budget` back).
    bytes: Vec<u8>,
}

impl Head {
    /// `None` for anything that is not a header of this version.
    pub fn decode(bytes: Vec<u8>) -> Option<Head> {
        let mut r = Reader::new(&bytes);
        if r.u8()? != TABLE_VERSION {
            return None;
        }
        let budget = RetryBudget::decode(&mut r)?;
        let generation = r.u64()?;
        let entries = r.u32()? as usize;
        if r.remaining() != groups(entries).checked_mul(8)? {
            return None;
        }
        Some(Head {
            budget,
            generation,
            entries,
            bytes,
        })
    }

    /// The stored header (`None`: missing or undecodable) and its CAS token.
    pub fn read(store: &dyn Store) -> (Option<Head>, Option<u32>) {
        let (bytes, cas) = store.get(TABLE_KEY);
        (bytes.and_then(Head::decode), cas)
    }

    /// Where group `g`'s version lies (`None`: no such group).
    fn at(&self, g: usize) -> Option<usize> {
        (g < groups(self.entries)).then(|| HEAD_BYTES + 8 * g)
    }

    /// The recorded version of group `g` (0: none).
    pub fn version(&self, g: usize) -> u64 {
        self.at(g)
            .and_then(|at| u64_at(&self.bytes, at))
            .unwrap_or(0)
    }

    /// Group `g` reached `version`: recorded as a maximum (nothing for a group it has not).
    pub fn record(&mut self, g: usize, version: u64) {
        let v = self.version(g).max(version);
        if let Some(dst) = self
            .at(g)
            .and_then(|at| self.bytes.get_mut(at..at.saturating_add(8)))
        {
            dst.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The versions, by group: [`Head::version`] of each, read in one pass over the bytes (by
    /// group, each look-up checked its group and the bytes' bounds: about 40 instructions per
    /// group under wasm, 33 groups at 512 endpoints on every request).
    pub fn versions(&self) -> impl Iterator<Item = u64> + '_ {
        let end = HEAD_BYTES.saturating_add(8 * groups(self.entries));
        let (words, _) = self
            .bytes
            .get(HEAD_BYTES..end)
            .unwrap_or_default()
            .as_chunks::<8>();
        words.iter().map(|w| u64::from_le_bytes(*w))
    }

    /// The header's bytes with `budget` written back: what [`Header::encode`] gives for the
    /// same fields.
    pub fn into_bytes(self) -> Vec<u8> {
        let mut w = Writer::with_capacity(BUDGET_BYTES);
        self.budget.encode(&mut w);
        let mut bytes = self.bytes;
        if let (Some(dst), true) = (
            bytes.get_mut(1..1 + BUDGET_BYTES),
            w.buf.len() == BUDGET_BYTES,
        ) {
            dst.copy_from_slice(&w.buf);
        }
        bytes
    }
}

/// A group's version and its entries' bytes (a whole number of entries, at most
/// [`GROUP_LEN`]); `None` for anything that is not a group of this version.
pub fn parse_group(bytes: &[u8]) -> Option<(u64, &[u8])> {
    if bytes.first() != Some(&TABLE_VERSION) {
        return None;
    }
    let version = u64_at(bytes, 1)?;
    let n = u32_at(bytes, 9)? as usize;
    let entries = bytes.get(GROUP_HEAD_BYTES..)?;
    (n <= GROUP_LEN && Some(entries.len()) == n.checked_mul(ENTRY_BYTES))
        .then_some((version, entries))
}

/// A group of `version` holding `entries`, each stamped with its given stamp.
fn encode_group<'e>(
    version: u64,
    entries: impl ExactSizeIterator<Item = (u32, u64, &'e EndpointState)>,
) -> Vec<u8> {
    let mut w = Writer::with_capacity(GROUP_HEAD_BYTES + entries.len() * ENTRY_BYTES);
    w.u8(TABLE_VERSION);
    w.u64(version);
    w.u32(entries.len() as u32);
    for (id, stamp, st) in entries {
        encode_entry(&mut w, id, stamp, st);
    }
    w.buf
}

/// The stored table as it is laid out: the header's budget and generation and the entries of
/// every group that decodes, in order; whether every group decoded (with the header's count).
/// `None` when the header is missing or undecodable. Reads every key: for a full load only.
pub fn read_stored(store: &dyn Store) -> Option<(Table, bool)> {
    let head = Head::read(store).0?;
    let mut entries = Vec::with_capacity(head.entries);
    let mut complete = true;
    for g in 0..groups(head.entries) {
        let bytes = store.get(&group_key(g)).0;
        let decoded = bytes.as_deref().and_then(|b| {
            let (_, chunks) = parse_group(b)?;
            let mut out = Vec::with_capacity(GROUP_LEN);
            for chunk in chunks.chunks_exact(ENTRY_BYTES) {
                out.push(decode_entry(chunk)?);
            }
            (out.len() == group_size(head.entries, g)).then_some(out)
        });
        match decoded {
            Some(group) => entries.extend(group),
            None => complete = false,
        }
    }
    Some((
        Table {
            budget: head.budget,
            entries,
            generation: head.generation,
        },
        complete,
    ))
}

/// Endpoint `id`'s stored entry when it is at position `i` of the stored layout: one group
/// read, whatever the fleet's size.
pub fn read_entry(store: &dyn Store, i: usize, id: u32) -> Option<EndpointState> {
    let bytes = store.get(&group_key(i / GROUP_LEN)).0?;
    let (_, chunks) = parse_group(&bytes)?;
    let at = (i % GROUP_LEN).checked_mul(ENTRY_BYTES)?;
    match decode_entry(chunks.get(at..at.checked_add(ENTRY_BYTES)?)?)? {
        (stored, st) if stored == id => Some(st),
        _ => None,
    }
}

/// What a group write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupWrite {
    /// Stored under this version.
    Written(u64),
    /// Nothing to change: nothing written.
    Unchanged,
    /// The patch found an entry other than the caller expected (see [`Patch::Stale`]).
    Stale,
    /// The group is missing or undecodable, or an entry is not at its slot.
    Missing,
    /// Every CAS attempt lost.
    GaveUp,
}

/// What a patch function made of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Patch {
    Changed,
    Same,
    /// The stored entry is not what the caller decided on: the write is abandoned.
    Stale,
}

/// One CAS write of group `g`: for each `(slot, id)` of `wanted`, the stored entry at that
/// slot (which must hold `id`) is decoded and given to `f` with its index in `wanted`; the
/// entries `f` changed are rewritten under the next version, which becomes their stamp.
/// `floor`: the header's version of the group (the next version exceeds it too, so a group
/// reset by garbage still moves up). Retried on CAS conflicts with the fresh bytes.
pub fn patch_group(
    store: &dyn Store,
    g: usize,
    floor: u64,
    wanted: &[(usize, u32)],
    mut f: impl FnMut(usize, &mut EndpointState) -> Patch,
) -> GroupWrite {
    let result = update_owned(store, &group_key(g), |bytes| {
        let Some(mut bytes) = bytes else {
            return (None, GroupWrite::Missing);
        };
        let Some((version, _)) = parse_group(&bytes) else {
            return (None, GroupWrite::Missing);
        };
        let next = next_version(version, floor);
        let mut changed = false;
        for (k, &(slot, id)) in wanted.iter().enumerate() {
            let Some(at) = slot
                .checked_mul(ENTRY_BYTES)
                .and_then(|a| a.checked_add(GROUP_HEAD_BYTES))
            else {
                return (None, GroupWrite::Missing);
            };
            let Some(chunk) = bytes.get_mut(at..at.saturating_add(ENTRY_BYTES)) else {
                return (None, GroupWrite::Missing);
            };
            let Some((stored, mut st)) = decode_entry(chunk) else {
                return (None, GroupWrite::Missing);
            };
            if stored != id {
                return (None, GroupWrite::Missing);
            }
            match f(k, &mut st) {
                Patch::Stale => return (None, GroupWrite::Stale),
                Patch::Same => {}
                Patch::Changed => {
                    let mut w = Writer::with_capacity(ENTRY_BYTES);
                    encode_entry(&mut w, id, next, &st);
                    if w.buf.len() != ENTRY_BYTES {
                        return (None, GroupWrite::Missing);
                    }
                    chunk.copy_from_slice(&w.buf);
                    changed = true;
                }
            }
        }
        if !changed {
            return (None, GroupWrite::Unchanged);
        }
        match bytes.get_mut(1..9) {
            Some(dst) => dst.copy_from_slice(&next.to_le_bytes()),
            None => return (None, GroupWrite::Missing),
        }
        (Some(bytes), GroupWrite::Written(next))
    });
    match result {
        Ok(w) => w,
        Err(GroupWrite::Written(_)) => GroupWrite::GaveUp,
        Err(other) => other,
    }
}

/// The slot of endpoint `id` in group `g`, if it is there.
fn slot_of(store: &dyn Store, g: usize, id: u32) -> Option<usize> {
    let bytes = store.get(&group_key(g)).0?;
    let (_, chunks) = parse_group(&bytes)?;
    chunks
        .chunks_exact(ENTRY_BYTES)
        .position(|c| u32_at(c, 0) == Some(id))
}

/// Records in the header that groups `written` reached their versions (a maximum: a lost
/// race can only have recorded a higher one) and applies `budget` to the stored budget, under
/// the header's CAS (`first`: the header and token already read, saving one read). False when
/// there is no header to record in (or every attempt lost).
pub fn note_versions(
    store: &dyn Store,
    first: Option<(Option<Head>, Option<u32>)>,
    written: &[(usize, u64)],
    mut budget: impl FnMut(&mut RetryBudget),
) -> bool {
    let mut first = first;
    for _ in 0..CAS_RETRIES {
        let (head, cas) = first.take().unwrap_or_else(|| Head::read(store));
        let Some(mut head) = head else {
            return false;
        };
        for &(g, v) in written {
            head.record(g, v);
        }
        budget(&mut head.budget);
        if store.set(TABLE_KEY, &head.into_bytes(), cas).is_ok() {
            return true;
        }
    }
    false
}

/// Applies `change` to endpoint `id`'s stored entry in one CAS write of its group, then
/// records the group's version (and `budget`'s change) in the header: at position `hint` of the
/// stored layout, else wherever its id is (a reload moved it: every group is looked at).
/// `change` returns whether it changed the entry. `Some(Ok(changed))`, `Some(Err(()))` when
/// every CAS attempt lost, `None` when the entry is stored nowhere (the caller lays the table
/// out).
pub fn update_entry(
    store: &dyn Store,
    hint: Option<usize>,
    id: u32,
    mut change: impl FnMut(&mut EndpointState) -> bool,
    budget: impl FnMut(&mut RetryBudget),
) -> Option<Result<bool, ()>> {
    let (head, cas) = Head::read(store);
    let n = head.as_ref()?.entries;
    let floor = |g: usize| head.as_ref().map_or(0, |h| h.version(g));
    let mut patch = |g: usize, slot: usize| {
        patch_group(store, g, floor(g), &[(slot, id)], |_, st| {
            if change(st) {
                Patch::Changed
            } else {
                Patch::Same
            }
        })
    };
    let mut outcome = hint
        .filter(|&i| i < n)
        .map(|i| patch(i / GROUP_LEN, i % GROUP_LEN))
        .map(|w| (hint.unwrap_or(0) / GROUP_LEN, w));
    if matches!(outcome, None | Some((_, GroupWrite::Missing))) {
        outcome = (0..groups(n)).find_map(|g| {
            let slot = slot_of(store, g, id)?;
            Some((g, patch(g, slot)))
        });
    }
    match outcome? {
        (g, GroupWrite::Written(v)) => {
            note_versions(store, Some((head, cas)), &[(g, v)], budget);
            Some(Ok(true))
        }
        (_, GroupWrite::Unchanged) => Some(Ok(false)),
        (_, GroupWrite::Missing | GroupWrite::Stale) => None,
        (_, GroupWrite::GaveUp) => Some(Err(())),
    }
}

/// Lays the stored table out as `table` (its endpoints, in its order, at its generation):
/// every group written under its CAS with the next version, then the header. Entries not in
/// `changed` are taken from the store by endpoint id when stored (a write that came between
/// the caller's read and this one is kept), else from `table`. Over a table of a newer
/// generation (this writer is a request of an older configuration, still draining) the layout
/// is kept: only the `changed` entries it holds are patched, found by id, and the budget.
/// False when a CAS was lost (nothing or part written: the caller may try again).
pub fn lay_out(
    store: &dyn Store,
    table: &Table,
    changed: &[usize],
    mut budget: impl FnMut(&mut RetryBudget),
) -> bool {
    let (head, head_cas) = Head::read(store);
    if let Some(h) = head.as_ref().filter(|h| h.generation > table.generation) {
        let mut written = Vec::new();
        for &p in changed {
            let Some(&(id, st)) = table.entries.get(p) else {
                continue;
            };
            for g in 0..groups(h.entries) {
                if let Some(slot) = slot_of(store, g, id) {
                    let w = patch_group(store, g, h.version(g), &[(slot, id)], |_, stored| {
                        *stored = st;
                        Patch::Changed
                    });
                    if let GroupWrite::Written(v) = w {
                        written.push((g, v));
                    }
                    break;
                }
            }
        }
        return note_versions(store, Some((head, head_cas)), &written, budget);
    }
    let stored = read_stored(store)
        .map(|(t, _)| t.entries)
        .unwrap_or_default();
    let n = table.entries.len();
    let mut versions = Vec::with_capacity(groups(n));
    for g in 0..groups(n) {
        let key = group_key(g);
        let (bytes, cas) = store.get(&key);
        let own = bytes.as_deref().and_then(parse_group).map_or(0, |(v, _)| v);
        let version = next_version(own, head.as_ref().map_or(0, |h| h.version(g)));
        let from = g * GROUP_LEN;
        let part = group_part(table, g);
        let entries: Vec<(u32, EndpointState)> = part
            .iter()
            .enumerate()
            .map(|(k, &(id, st))| {
                let fresh = (!changed.contains(&(from + k)))
                    .then(|| stored.iter().find(|(s, _)| *s == id).map(|(_, s)| *s))
                    .flatten();
                (id, fresh.unwrap_or(st))
            })
            .collect();
        let bytes = encode_group(version, entries.iter().map(|(id, st)| (*id, version, st)));
        if store.set(&key, &bytes, cas).is_err() {
            return false;
        }
        versions.push(version);
    }
    let mut head_cas = head_cas;
    let mut stored_budget = head.as_ref().map(|h| h.budget);
    for _ in 0..CAS_RETRIES {
        let mut b = stored_budget.unwrap_or(table.budget);
        budget(&mut b);
        let header = Header {
            budget: b,
            generation: table.generation,
            entries: n,
            versions: versions.clone(),
        };
        if store.set(TABLE_KEY, &header.encode(), head_cas).is_ok() {
            clear_past(store, n, head.as_ref());
            return true;
        }
        // Someone else recorded a version meanwhile: keep the higher ones, and their budget.
        let (fresh, cas) = Head::read(store);
        match fresh {
            Some(f) if f.generation > table.generation => return false,
            Some(f) => {
                if f.entries == n {
                    for (v, o) in versions.iter_mut().zip(f.versions()) {
                        *v = (*v).max(o);
                    }
                }
                stored_budget = Some(f.budget);
            }
            None => stored_budget = None,
        }
        head_cas = cas;
    }
    false
}

/// Empties the groups a smaller layout no longer uses (those of the layout `previous` held,
/// past the `entries` just laid out): Envoy never frees a key, but their values, the entries
/// of endpoints that are gone (a pool's departed hosts), would stay as they were, never read
/// again. Each becomes an empty group of the next version (versions only move up, so a later,
/// larger layout reusing the key goes on from there), under its own CAS; a group another
/// writer changed meanwhile is left to it. Called once the header naming `entries` is
/// written, so no reader of the new header reads them.
fn clear_past(store: &dyn Store, entries: usize, previous: Option<&Head>) {
    let Some(prev) = previous else { return };
    for g in groups(entries)..groups(prev.entries) {
        let key = group_key(g);
        let (bytes, cas) = store.get(&key);
        let Some(own) = bytes.as_deref().and_then(parse_group) else {
            continue;
        };
        if own.1.is_empty() {
            continue;
        }
        let version = next_version(own.0, prev.version(g));
        let _ = store.set(&key, &encode_group(version, std::iter::empty()), cas);
    }
}

/// Writes `table` as the stored table, unconditionally (tests and tools: a table set up at
/// once). Versions still move up, so workers' caches see the change.
pub fn write_table(store: &dyn Store, table: &Table) {
    let head = Head::read(store).0;
    let n = table.entries.len();
    let mut versions = Vec::with_capacity(groups(n));
    for g in 0..groups(n) {
        let key = group_key(g);
        let own = store
            .get(&key)
            .0
            .as_deref()
            .and_then(parse_group)
            .map_or(0, |(v, _)| v);
        let version = next_version(own, head.as_ref().map_or(0, |h| h.version(g)));
        let part = group_part(table, g);
        let bytes = encode_group(version, part.iter().map(|(id, st)| (*id, version, st)));
        let _ = store.set(&key, &bytes, None);
        versions.push(version);
    }
    let header = Header {
        budget: table.budget,
        generation: table.generation,
        entries: n,
        versions,
    };
    let _ = store.set(TABLE_KEY, &header.encode(), None);
}
