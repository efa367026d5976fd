//! Property tests of the parsers that read hostile input on the OpenAI-compatible surface:
//! the multipart model scan, the JSON prefix scanner, the response-id scan and the per-path
//! policy. They never panic, stay within their memory bounds, and give the same answer however
//! the body is cut into chunks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use computeflux::scheduler::routing::select::responses::{AnswerFormat, IdScan};
use computeflux::scheduler::wire::api::{policy, Handling};
use computeflux::scheduler::wire::json_scan::{remove_member, string_at, Scan};
use computeflux::scheduler::wire::multipart::{
    read_model, ModelScan, MultipartError, Progress, MAX_PART_HEADER_BYTES,
};
use computeflux::scheduler::wire::request::MAX_MODEL_BYTES;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const BOUNDARY: &str = "b0und4ry";

/// The most a `ModelScan` may hold between chunks.
const SCAN_BOUND: usize = MAX_PART_HEADER_BYTES + 6 + MAX_MODEL_BYTES + 80;

/// Feeds `body` cut at `cuts` (sorted positions) and returns the final result.
fn scan_in_chunks(body: &[u8], cuts: &[usize]) -> Result<String, MultipartError> {
    let mut scan = ModelScan::new(&format!("multipart/form-data; boundary={BOUNDARY}")).unwrap();
    let mut start = 0;
    let mut ends: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    ends.sort_unstable();
    ends.push(body.len());
    for end in ends {
        let end = end.max(start);
        match scan.feed(&body[start..end]) {
            Progress::Found(m) => return Ok(m),
            Progress::Failed(e) => return Err(e),
            Progress::NeedMore => assert!(scan.buffered() <= SCAN_BOUND),
        }
        start = end;
    }
    scan.finish()
}

/// Bytes that cannot contain the delimiter (no CR), as a file part's content.
fn file_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>().prop_filter("no CR", |b| *b != b'\r'), 0..4000)
}

fn form(model_first: bool, model: &str, file: &[u8]) -> Vec<u8> {
    let mut b = format!("preamble\r\n--{BOUNDARY}\r\n").into_bytes();
    let model_part = format!(
        "Content-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--{BOUNDARY}\r\n"
    );
    let file_part = [
        b"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
          Content-Type: audio/wav\r\n\r\n"
            .to_vec(),
        file.to_vec(),
        format!("\r\n--{BOUNDARY}\r\n").into_bytes(),
    ]
    .concat();
    if model_first {
        b.extend_from_slice(model_part.as_bytes());
        b.extend_from_slice(&file_part);
    } else {
        b.extend_from_slice(&file_part);
        b.extend_from_slice(model_part.as_bytes());
    }
    b.extend_from_slice(
        format!("Content-Disposition: form-data; name=\"user\"\r\n\r\nu\r\n--{BOUNDARY}--\r\n")
            .as_bytes(),
    );
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn multipart_model_whatever_the_chunking(
        model in "[a-zA-Z0-9._/-]{1,64}",
        model_first in any::<bool>(),
        file in file_bytes(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let body = form(model_first, &model, &file);
        prop_assert_eq!(scan_in_chunks(&body, &cuts), Ok(model.clone()));
        let ct = format!("multipart/form-data; boundary=\"{BOUNDARY}\"");
        prop_assert_eq!(read_model(&ct, &body), Ok(model));
    }

    #[test]
    fn multipart_never_panics_and_stays_bounded(
        body in prop::collection::vec(any::<u8>(), 0..6000),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        let whole = scan_in_chunks(&body, &[]);
        // Chunking never changes the verdict.
        prop_assert_eq!(scan_in_chunks(&body, &cuts), whole);
    }

    #[test]
    fn multipart_hostile_structure(
        parts in prop::collection::vec(
            (prop::sample::select(vec!["model", "file", "x", ""]),
             prop::collection::vec(prop::sample::select(vec![b'a', b'\r', b'\n', b'-', b'b']), 0..80)),
            0..20),
        cuts in prop::collection::vec(any::<usize>(), 0..8),
    ) {
        // Delimiter-like noise inside part contents: chunking never changes the verdict.
        let mut body = Vec::new();
        for (name, content) in &parts {
            body.extend_from_slice(format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes());
            body.extend_from_slice(content);
            body.extend_from_slice(b"\r\n");
        }
        let whole = scan_in_chunks(&body, &[]);
        prop_assert_eq!(scan_in_chunks(&body, &cuts), whole);
    }

    #[test]
    fn json_scan_prefixes_never_lie(
        extra in prop::collection::btree_map("[a-z_]{1,8}", any::<i64>().prop_map(Value::from), 0..6),
        nested in prop::collection::vec("[ -~]{0,12}", 0..5),
        id in "[ -~]{1,40}",
        cut in any::<usize>(),
    ) {
        let mut obj = Map::new();
        for (k, v) in extra {
            if k != "id" {
                obj.insert(k, v);
            }
        }
        obj.insert("noise".into(), json!({"id": nested, "s": "}\"]"}));
        obj.insert("id".into(), Value::String(id.clone()));
        let doc = Value::Object(obj).to_string();
        let bytes = doc.as_bytes();
        prop_assert_eq!(string_at(bytes, &["id"], 256), Scan::Found(id.clone()));
        let prefix = &bytes[..cut % (bytes.len() + 1)];
        let r = string_at(prefix, &["id"], 256);
        prop_assert!(r == Scan::NeedMore || r == Scan::Found(id), "{:?}", r);
    }

    #[test]
    fn json_scan_never_panics(doc in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = string_at(&doc, &["id"], 256);
        let _ = string_at(&doc, &["response", "id"], 256);
        if let Some(out) = remove_member(&doc, "id") {
            prop_assert!(out.len() < doc.len());
        }
    }

    #[test]
    fn remove_member_keeps_everything_else(
        fields in prop::collection::btree_map("[a-z]{1,6}", "[ -~]{0,10}", 0..6),
        position in any::<usize>(),
        spaced in any::<bool>(),
    ) {
        let mut entries: Vec<(String, Value)> =
            fields.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
        let at = position % (entries.len() + 1);
        entries.insert(at, ("previous_response_id".into(), json!("resp_1")));
        let sep = if spaced { " , " } else { "," };
        let members: Vec<String> = entries
            .iter()
            .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), v))
            .collect();
        let doc = format!("{{{}}}", members.join(sep));
        let out = remove_member(doc.as_bytes(), "previous_response_id").unwrap();
        let got: Value = serde_json::from_slice(&out).unwrap();
        let mut want: Value = serde_json::from_str(&doc).unwrap();
        want.as_object_mut().unwrap().remove("previous_response_id");
        prop_assert_eq!(got, want);
    }

    #[test]
    fn sse_id_whatever_the_chunking(
        id in "resp_[a-z0-9]{1,40}",
        size in 1usize..64,
        crlf in any::<bool>(),
    ) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let stream = format!(
            "event: response.created{nl}data: {}{nl}{nl}data: {}{nl}{nl}",
            json!({"type": "response.created", "response": {"id": id, "instructions": "x\n\ny"}}),
            json!({"type": "response.output_text.delta", "delta": "hi"}),
        );
        let mut scan = IdScan::new(AnswerFormat::EventStream);
        let mut last = Scan::NeedMore;
        for chunk in stream.as_bytes().chunks(size) {
            last = scan.feed(chunk);
            if last != Scan::NeedMore {
                break;
            }
        }
        if last == Scan::NeedMore {
            last = scan.finish().map_or(Scan::Absent, Scan::Found);
        }
        prop_assert_eq!(last, Scan::Found(id));
    }

    #[test]
    fn policy_never_panics(method in "[A-Z]{0,7}", path in "\\PC{0,60}", ct in proptest::option::of("\\PC{0,40}")) {
        let h = policy(&method, &path, ct.as_deref());
        // A path that is not canonical or is ambiguous is refused whatever it names (issue 22).
        if !path.starts_with("/v1/") && !matches!(h, Handling::InvalidPath(_)) {
            prop_assert_eq!(h, Handling::PassThrough);
        }
    }
}
