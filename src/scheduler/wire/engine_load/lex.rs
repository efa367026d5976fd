//! The Prometheus text format's lexer: one line at a time into a sample (name, label body,
//! value), a comment or garbage; label pairs and their escaped values. No allocation.

use super::MAX_NUMBER_BYTES;

/// Whether a label value as written (with `\\`, `\"`, `\n` escapes) equals `want`.
pub(super) fn label_value_eq(raw: &[u8], want: &[u8]) -> bool {
    let mut want = want.iter();
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        let (c, step) = match (b, raw.get(i + 1)) {
            (b'\\', Some(b'\\')) => (b'\\', 2),
            (b'\\', Some(b'"')) => (b'"', 2),
            (b'\\', Some(b'n')) => (b'\n', 2),
            _ => (b, 1),
        };
        if want.next() != Some(&c) {
            return false;
        }
        i += step;
    }
    want.next().is_none()
}

pub(super) struct Sample<'a> {
    pub(super) name: &'a [u8],
    /// The bytes between `{` and `}` (empty without labels), well-formed.
    pub(super) labels: &'a [u8],
    pub(super) value: f64,
}

pub(super) enum Line<'a> {
    Blank,
    Comment,
    Sample(Sample<'a>),
    Garbage,
}

pub(super) fn is_space(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

pub(super) fn skip_space(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| is_space(**b)).count();
    s.get(n..).unwrap_or(&[])
}

/// Splits a leading name (`[A-Za-z_:][A-Za-z0-9_:]*`, or without `:` for labels).
pub(super) fn split_name(s: &[u8], colon: bool) -> Option<(&[u8], &[u8])> {
    let ok_first = |b: u8| b.is_ascii_alphabetic() || b == b'_' || (colon && b == b':');
    if !s.first().is_some_and(|b| ok_first(*b)) {
        return None;
    }
    let n = s
        .iter()
        .take_while(|b| ok_first(**b) || b.is_ascii_digit())
        .count();
    Some((s.get(..n).unwrap_or(&[]), s.get(n..).unwrap_or(&[])))
}

/// The label pairs of a `{…}` body, each as (name, raw value without its quotes).
pub(super) struct Labels<'a> {
    rest: &'a [u8],
}

impl<'a> Labels<'a> {
    pub(super) fn new(s: &'a [u8]) -> Self {
        Labels { rest: s }
    }

    fn pair(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        let (name, after) = split_name(skip_space(self.rest), false)?;
        let after = skip_space(after).strip_prefix(b"=")?;
        let after = skip_space(after).strip_prefix(b"\"")?;
        let mut i = 0;
        loop {
            match after.get(i)? {
                b'\\' => i += 2,
                b'"' => break,
                _ => i += 1,
            }
        }
        let value = after.get(..i)?;
        let after = skip_space(after.get(i + 1..)?);
        self.rest = match after.first() {
            None => after,
            Some(b',') => after.get(1..)?,
            Some(_) => return None,
        };
        Some((name, value))
    }
}

impl<'a> Iterator for Labels<'a> {
    /// `Err` once on malformed labels; the iteration then ends.
    type Item = Result<(&'a [u8], &'a [u8]), ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if skip_space(self.rest).is_empty() {
            return None;
        }
        match self.pair() {
            Some(p) => Some(Ok(p)),
            None => {
                self.rest = &[];
                Some(Err(()))
            }
        }
    }
}

/// The closing `}` of a label set starting after `{`: outside quoted values.
pub(super) fn label_end(s: &[u8]) -> Option<usize> {
    let mut quoted = false;
    let mut i = 0;
    while let Some(&b) = s.get(i) {
        match (quoted, b) {
            (true, b'\\') => i += 1,
            (_, b'"') => quoted = !quoted,
            (false, b'}') => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

pub(super) fn number(tok: &[u8]) -> Option<f64> {
    if tok.is_empty() || tok.len() > MAX_NUMBER_BYTES {
        return None;
    }
    std::str::from_utf8(tok).ok()?.parse::<f64>().ok()
}

pub(super) fn split_token(s: &[u8]) -> (&[u8], &[u8]) {
    let n = s.iter().take_while(|b| !is_space(**b)).count();
    (s.get(..n).unwrap_or(&[]), s.get(n..).unwrap_or(&[]))
}

/// One line (without its `\n` and `\r`).
pub(super) fn classify(line: &[u8]) -> Line<'_> {
    let line = skip_space(line);
    match line.first() {
        None => return Line::Blank,
        Some(b'#') => return Line::Comment,
        Some(_) => {}
    }
    let Some((name, rest)) = split_name(line, true) else {
        return Line::Garbage;
    };
    // Blanks may separate the name from its labels (as Prometheus's own parser allows).
    let (labels, rest) = match skip_space(rest).first() {
        Some(b'{') => {
            let inner = skip_space(rest).get(1..).unwrap_or(&[]);
            let Some(end) = label_end(inner) else {
                return Line::Garbage;
            };
            let labels = inner.get(..end).unwrap_or(&[]);
            if Labels::new(labels).any(|p| p.is_err()) {
                return Line::Garbage;
            }
            (labels, inner.get(end + 1..).unwrap_or(&[]))
        }
        _ if rest.first().is_some_and(|b| is_space(*b)) => (&[][..], rest),
        _ => return Line::Garbage,
    };
    let (value, rest) = split_token(skip_space(rest));
    let Some(value) = number(value) else {
        return Line::Garbage;
    };
    // An optional integer timestamp (milliseconds), which this module ignores.
    let (ts, rest) = split_token(skip_space(rest));
    let ts_ok = ts.is_empty() || {
        let digits = ts.strip_prefix(b"-").unwrap_or(ts);
        !digits.is_empty()
            && digits.len() <= MAX_NUMBER_BYTES
            && digits.iter().all(u8::is_ascii_digit)
    };
    if !ts_ok || !skip_space(rest).is_empty() {
        return Line::Garbage;
    }
    Line::Sample(Sample {
        name,
        labels,
        value,
    })
}
