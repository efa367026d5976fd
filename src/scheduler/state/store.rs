//! The only door to shared state: a key-value store with compare-and-swap.
//!
//! In Envoy this is the VM's shared data (one copy per Envoy process, shared by every worker
//! thread's VM with the same `vm_id`). Tests use [`MemStore`], which can inject CAS conflicts.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// The value changed since it was read (or another writer won the race).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CasMismatch;

pub trait Store {
    /// The value and its CAS token; `(None, None)` when the key was never written.
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's CAS token still equals `cas` (`None`: unconditionally).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch>;
}

/// A reference to a store is a store (so `&store` serves where `store` is itself a reference).
impl<S: Store + ?Sized> Store for &S {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        (**self).set(key, value, cas)
    }
}

/// How many times a read-modify-write is retried on CAS conflicts before giving up. Measured
/// conflict rates in Envoy are a few percent, so this bound is practically never reached.
pub const CAS_RETRIES: usize = 8;

/// Read-modify-write with bounded CAS retries. `f` gets the current bytes (or `None`) and
/// returns the new bytes plus a result. Returns `Err(last_result)` when every attempt lost
/// the race: the caller decides locally and counts it.
pub fn update<R>(
    store: &dyn Store,
    key: &str,
    mut f: impl FnMut(Option<&[u8]>) -> (Vec<u8>, R),
) -> Result<R, R> {
    update_if(store, key, |bytes| {
        let (new, r) = f(bytes);
        (Some(new), r)
    })
}

/// Like [`update`], but `f` may return `None` to leave the value as it is.
pub fn update_if<R>(
    store: &dyn Store,
    key: &str,
    mut f: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Result<R, R> {
    update_owned_if(store, key, |bytes, _| f(bytes.as_deref()))
}

/// [`update_if`] with `f` given the current bytes to own, and their CAS token: a change of a
/// few bytes of a large value is made in place, without copying the value (one instruction
/// per byte under wasm).
pub fn update_owned_if<R>(
    store: &dyn Store,
    key: &str,
    mut f: impl FnMut(Option<Vec<u8>>, Option<u32>) -> (Option<Vec<u8>>, R),
) -> Result<R, R> {
    let mut last = None;
    for _ in 0..CAS_RETRIES {
        let (bytes, cas) = store.get(key);
        let (new, result) = f(bytes, cas);
        let Some(new) = new else { return Ok(result) };
        match store.set(key, &new, cas) {
            Ok(()) => return Ok(result),
            Err(CasMismatch) => last = Some(result),
        }
    }
    match last {
        Some(r) => Err(r),
        None => {
            // Unreachable with CAS_RETRIES > 0; compute once more without writing.
            let (bytes, cas) = store.get(key);
            Err(f(bytes, cas).1)
        }
    }
}

/// A key made of `parts` and then `n` in decimal, as `format!` writes it, without `format!`'s
/// machinery (about 1 000 instructions per key under wasm; a request names several numbered
/// keys: table groups, session buckets).
pub fn numbered_key(parts: &[&str], n: u64) -> String {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = n;
    loop {
        at -= 1;
        if let Some(d) = digits.get_mut(at) {
            *d = b'0' + (rest % 10) as u8;
        }
        rest /= 10;
        if rest == 0 || at == 0 {
            break;
        }
    }
    let digits = digits.get(at..).unwrap_or(&[]);
    let len = parts.iter().map(|p| p.len()).sum::<usize>() + digits.len();
    let mut key = String::with_capacity(len);
    for p in parts {
        key.push_str(p);
    }
    key.extend(digits.iter().map(|&d| char::from(d)));
    key
}

/// Like [`update_if`], but `f` owns the bytes it read, so that it may return them changed in
/// place instead of a changed copy (a large value costs its copy in instructions under wasm).
pub fn update_owned<R>(
    store: &dyn Store,
    key: &str,
    mut f: impl FnMut(Option<Vec<u8>>) -> (Option<Vec<u8>>, R),
) -> Result<R, R> {
    update_owned_if(store, key, |bytes, _| f(bytes))
}

/// An in-memory store with Envoy's semantics (CAS tokens start at 1 and grow on each write;
/// a write to a missing key succeeds whatever its CAS), plus conflict injection for tests.
#[derive(Default)]
pub struct MemStore {
    map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// The next `n` writes fail with a CAS mismatch (as if another worker won the race).
    pub inject_conflicts: Cell<u32>,
    pub writes: Cell<u64>,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn keys(&self) -> usize {
        self.map.borrow().len()
    }
    pub fn bytes(&self) -> usize {
        self.map
            .borrow()
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

impl Store for MemStore {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.map.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        if self.inject_conflicts.get() > 0 {
            self.inject_conflicts.set(self.inject_conflicts.get() - 1);
            return Err(CasMismatch);
        }
        let mut map = self.map.borrow_mut();
        match map.get_mut(key) {
            Some((v, current)) => {
                if cas.is_some_and(|c| c != *current) {
                    return Err(CasMismatch);
                }
                *v = value.to_vec();
                *current = current.wrapping_add(1);
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), 1));
            }
        }
        self.writes.set(self.writes.get() + 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn cas_semantics() {
        let s = MemStore::new();
        assert_eq!(s.get("k"), (None, None));
        s.set("k", b"a", Some(99)).unwrap(); // creation ignores CAS, as Envoy does
        let (v, cas) = s.get("k");
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        s.set("k", b"b", cas).unwrap();
        assert_eq!(s.set("k", b"c", cas), Err(CasMismatch));
    }

    #[test]
    fn update_retries_conflicts_then_gives_up() {
        let s = MemStore::new();
        s.inject_conflicts.set(3);
        let r = update(&s, "n", |b| (vec![b.map_or(0, |b| b[0]) + 1], ()));
        assert_eq!(r, Ok(()));
        assert_eq!(s.get("n").0, Some(vec![1]));
        s.inject_conflicts.set(CAS_RETRIES as u32);
        assert_eq!(update(&s, "n", |_| (vec![9], 5)), Err(5));
        assert_eq!(s.get("n").0, Some(vec![1]));
    }
}
