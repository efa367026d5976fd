//! Finding one member of a JSON object in a prefix of the document, without parsing the rest.
//!
//! Why: a Responses API answer names its `id` in its first bytes (`{"id":"resp_…",…}`, or the
//! first SSE event `response.created`), but the answer can be megabytes long and a stream never
//! ends while the filter watches it. A full parse would need the whole body; this scanner reads
//! only as far as the member it looks for, says [`Scan::NeedMore`] when the prefix ends first,
//! and never allocates beyond the value it returns. It is also how a request body loses its
//! `previous_response_id` member ([`remove_member`]) with every other byte kept as it was.
//!
//! It is not a validator: values it skips are only delimited (strings with their escapes,
//! brackets counted outside strings), so it is linear in the bytes read and needs no recursion.
//! Keys are compared as their raw bytes (a key spelt with escapes does not match).

use std::ops::Range;

/// The outcome of a scan over a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scan<T> {
    Found(T),
    /// The prefix ended before the member (or the end of its object) was reached.
    NeedMore,
    /// The member is not there (its object ended without it, or the document is not an
    /// object of that shape).
    Absent,
}

enum Stop {
    /// Ran out of input.
    Incomplete,
    /// Not the JSON expected.
    Invalid,
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\r' | b'\n')) {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), Stop> {
        self.ws();
        match self.peek() {
            None => Err(Stop::Incomplete),
            Some(x) if x == c => {
                self.i += 1;
                Ok(())
            }
            Some(_) => Err(Stop::Invalid),
        }
    }

    /// At a `"`: moves past the closing quote.
    fn string(&mut self) -> Result<(), Stop> {
        if self.peek() != Some(b'"') {
            return Err(Stop::Invalid);
        }
        self.i += 1;
        loop {
            match self.peek() {
                None => return Err(Stop::Incomplete),
                Some(b'\\') => self.i += 2,
                Some(b'"') => {
                    self.i += 1;
                    return Ok(());
                }
                Some(_) => self.i += 1,
            }
        }
    }

    /// Moves past one value (whitespace before it skipped).
    fn value(&mut self) -> Result<(), Stop> {
        self.ws();
        match self.peek() {
            None => Err(Stop::Incomplete),
            Some(b'"') => self.string(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        None => return Err(Stop::Incomplete),
                        Some(b'"') => self.string()?,
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.i += 1;
                        }
                        Some(b'}' | b']') => {
                            depth = depth.saturating_sub(1);
                            self.i += 1;
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(_) => self.i += 1,
                    }
                }
            }
            Some(_) => {
                let start = self.i;
                while let Some(c) = self.peek() {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n') {
                        break;
                    }
                    self.i += 1;
                }
                match self.peek() {
                    // A number at the end of the prefix may go on.
                    None => Err(Stop::Incomplete),
                    Some(_) if self.i == start => Err(Stop::Invalid),
                    Some(_) => Ok(()),
                }
            }
        }
    }

    /// At a key: its raw bytes between the quotes, then past the `:`.
    fn key(&mut self) -> Result<Range<usize>, Stop> {
        let start = self.i + 1;
        self.string()?;
        let end = self.i.saturating_sub(1);
        self.expect(b':')?;
        Ok(start..end)
    }
}

fn finish<T>(r: Result<Scan<T>, Stop>) -> Scan<T> {
    match r {
        Ok(s) => s,
        Err(Stop::Incomplete) => Scan::NeedMore,
        Err(Stop::Invalid) => Scan::Absent,
    }
}

/// The byte range of the value at `path` (object keys from the top level down).
pub fn find_member(doc: &[u8], path: &[&str]) -> Scan<Range<usize>> {
    finish(find_inner(doc, path))
}

fn find_inner(doc: &[u8], mut path: &[&str]) -> Result<Scan<Range<usize>>, Stop> {
    let mut c = Cursor { b: doc, i: 0 };
    c.expect(b'{')?;
    loop {
        c.ws();
        match c.peek() {
            None => return Err(Stop::Incomplete),
            Some(b'}') => return Ok(Scan::Absent),
            Some(b'"') => {}
            Some(_) => return Err(Stop::Invalid),
        }
        let key = c.key()?;
        let Some((want, deeper)) = path.split_first() else {
            return Ok(Scan::Absent);
        };
        if doc.get(key) == Some(want.as_bytes()) {
            c.ws();
            if deeper.is_empty() {
                let start = c.i;
                c.value()?;
                return Ok(Scan::Found(start..c.i));
            }
            // Descend: scan the nested object's members instead.
            c.expect(b'{')?;
            path = deeper;
            continue;
        }
        c.value()?;
        c.ws();
        match c.peek() {
            None => return Err(Stop::Incomplete),
            Some(b',') => c.i += 1,
            Some(b'}') => return Ok(Scan::Absent),
            Some(_) => return Err(Stop::Invalid),
        }
    }
}

/// The string value at `path`; [`Scan::Absent`] if it is there but not a string (or longer
/// than `max_bytes`).
pub fn string_at(doc: &[u8], path: &[&str], max_bytes: usize) -> Scan<String> {
    match find_member(doc, path) {
        Scan::Found(r) => {
            let raw = doc.get(r).unwrap_or(&[]);
            match serde_json::from_slice::<String>(raw) {
                Ok(s) if s.len() <= max_bytes => Scan::Found(s),
                _ => Scan::Absent,
            }
        }
        Scan::NeedMore => Scan::NeedMore,
        Scan::Absent => Scan::Absent,
    }
}

/// `doc` (a whole JSON object) without its top-level member `key`, every other byte kept.
/// `None` if the member is not there or the document is not an object.
pub fn remove_member(doc: &[u8], key: &str) -> Option<Vec<u8>> {
    let mut c = Cursor { b: doc, i: 0 };
    c.expect(b'{').ok()?;
    let mut first = true;
    // Where the previous member's value ended (its comma follows).
    let mut prev_end = c.i;
    loop {
        c.ws();
        if c.peek()? != b'"' {
            return None;
        }
        let member_start = c.i;
        let k = c.key().ok()?;
        c.value().ok()?;
        let value_end = c.i;
        c.ws();
        let next = c.peek()?;
        if doc.get(k) == Some(key.as_bytes()) {
            let cut = if !first {
                // `, "key": value` goes: from the previous member's end.
                prev_end..value_end
            } else if next == b',' {
                // `"key": value, ` goes, up to the next member.
                c.i += 1;
                c.ws();
                member_start..c.i
            } else {
                member_start..value_end
            };
            let mut out = Vec::with_capacity(doc.len());
            out.extend_from_slice(doc.get(..cut.start)?);
            out.extend_from_slice(doc.get(cut.end..)?);
            return Some(out);
        }
        match next {
            b',' => c.i += 1,
            _ => return None,
        }
        first = false;
        prev_end = value_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const ANSWER: &str = r#"{"object":"response","meta":{"id":"nested","x":[1,{"id":2}]},
        "s":"a \"}\" b","n":-1.5e3,"t":true,"id":"resp_123","output":[]}"#;

    #[test]
    fn finds_top_level_and_nested_members() {
        let doc = ANSWER.as_bytes();
        assert_eq!(string_at(doc, &["id"], 64), Scan::Found("resp_123".into()));
        assert_eq!(
            string_at(doc, &["meta", "id"], 64),
            Scan::Found("nested".into())
        );
        assert_eq!(string_at(doc, &["nope"], 64), Scan::Absent);
        assert_eq!(string_at(doc, &["n"], 64), Scan::Absent, "not a string");
        assert_eq!(string_at(doc, &["id"], 3), Scan::Absent, "too long");
        assert_eq!(
            string_at(br#"{"id":"a\u00e9"}"#, &["id"], 64),
            Scan::Found("aé".into())
        );
        let sse_data = br#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_9","object":"response"}}"#;
        assert_eq!(
            string_at(sse_data, &["response", "id"], 64),
            Scan::Found("resp_9".into())
        );
    }

    #[test]
    fn prefixes_need_more_until_the_member_is_complete() {
        let doc = ANSWER.as_bytes();
        let at = ANSWER.find("resp_123").unwrap() + "resp_123".len() + 1;
        for cut in 0..at {
            assert_eq!(
                string_at(&doc[..cut], &["id"], 64),
                Scan::NeedMore,
                "prefix {cut}"
            );
        }
        assert_eq!(
            string_at(&doc[..at], &["id"], 64),
            Scan::Found("resp_123".into())
        );
    }

    #[test]
    fn not_objects_are_absent() {
        for doc in [
            &b"[1]"[..],
            b"\"x\"",
            b"{1:2}",
            b"{\"a\" 1}",
            b"{\"a\":1 2}",
            b"{,}",
        ] {
            assert_eq!(string_at(doc, &["id"], 64), Scan::Absent, "{doc:?}");
        }
        assert_eq!(string_at(b"", &["id"], 64), Scan::NeedMore);
        assert_eq!(string_at(b"  {\"n\":12", &["id"], 64), Scan::NeedMore);
    }

    #[test]
    fn removes_a_member_keeping_the_rest() {
        let cases = [
            (
                r#"{"a":1,"previous_response_id":"r","b":2}"#,
                r#"{"a":1,"b":2}"#,
            ),
            (r#"{"previous_response_id":"r", "b":2}"#, r#"{"b":2}"#),
            (
                r#"{ "a" : [1,{"x":"}"}] , "previous_response_id" : "r" }"#,
                r#"{ "a" : [1,{"x":"}"}] }"#,
            ),
            (r#"{"previous_response_id":null}"#, r#"{}"#),
        ];
        for (doc, want) in cases {
            let out = remove_member(doc.as_bytes(), "previous_response_id").unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), want);
            let v: serde_json::Value = serde_json::from_str(want).unwrap();
            assert!(v.get("previous_response_id").is_none());
        }
        assert_eq!(remove_member(br#"{"a":1}"#, "previous_response_id"), None);
        assert_eq!(
            remove_member(
                br#"{"x":{"previous_response_id":1}}"#,
                "previous_response_id"
            ),
            None
        );
        assert_eq!(remove_member(b"[]", "a"), None);
        assert_eq!(remove_member(br#"{"a":1"#, "a"), None);
    }
}
