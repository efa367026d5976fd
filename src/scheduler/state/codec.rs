//! The byte format of values kept in Envoy shared data.
//!
//! Little-endian fixed-width fields behind a version byte. A value that does not decode (wrong
//! version, truncated, trailing garbage) reads as absent: the scheduler then starts that piece
//! of state afresh rather than trusting bytes it does not understand.

/// Appends fixed-width little-endian fields.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(n: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f64(&mut self, v: f64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reads fields written by [`Writer`]; every read is checked and returns `None` past the end.
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, tail) = self.rest.split_first_chunk::<N>()?;
        self.rest = tail;
        Some(*head)
    }
    pub fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    /// A finite f64; NaN and infinities are treated as corruption.
    pub fn f64(&mut self) -> Option<f64> {
        self.take::<8>()
            .map(f64::from_le_bytes)
            .filter(|v| v.is_finite())
    }
    /// The bytes not read yet (for fixed-width entries read in exact chunks).
    pub fn rest(&self) -> &'a [u8] {
        self.rest
    }
    pub fn remaining(&self) -> usize {
        self.rest.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::default();
        w.u8(7);
        w.u32(0xdead_beef);
        w.u64(u64::MAX - 1);
        w.f64(1.5);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8(), Some(7));
        assert_eq!(r.u32(), Some(0xdead_beef));
        assert_eq!(r.u64(), Some(u64::MAX - 1));
        assert_eq!(r.f64(), Some(1.5));
        assert!(r.is_empty());
        assert_eq!(r.u8(), None);
        let mut short = Reader::new(&w.buf[..3]);
        assert_eq!(short.u8(), Some(7));
        assert_eq!(short.u32(), None);
        let mut w = Writer::default();
        w.f64(f64::NAN);
        assert_eq!(Reader::new(&w.buf).f64(), None);
    }
}
