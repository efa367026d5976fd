use super::*;
use crate::scheduler::wire::request::{parse_form, RequestError};
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const CT: &str = "multipart/form-data; boundary=XyZ";

fn form(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, value) in parts {
        b.extend_from_slice(b"--XyZ\r\n");
        if *name == "file" {
            b.extend_from_slice(
                b"Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
                  Content-Type: audio/wav\r\n\r\n",
            );
        } else {
            b.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            );
        }
        b.extend_from_slice(value);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(b"--XyZ--\r\n");
    b
}

#[test]
fn boundary_forms() {
    assert_eq!(boundary(CT).unwrap(), b"XyZ");
    assert_eq!(
        boundary("Multipart/Form-Data ; charset=utf-8; BOUNDARY=\"a b;c\"").unwrap(),
        b"a b;c"
    );
    assert_eq!(
        boundary("multipart/form-data;boundary=\"q\\\"x\"").unwrap(),
        b"q\"x"
    );
    assert_eq!(
        boundary("application/json").unwrap_err(),
        MultipartError::NotMultipartForm
    );
    assert_eq!(
        boundary("multipart/form-data").unwrap_err(),
        MultipartError::MissingBoundary
    );
    assert_eq!(
        boundary("multipart/form-data; boundary=").unwrap_err(),
        MultipartError::InvalidBoundary
    );
    let long = format!("multipart/form-data; boundary={}", "b".repeat(71));
    assert_eq!(
        boundary(&long).unwrap_err(),
        MultipartError::InvalidBoundary
    );
    let seventy = format!("multipart/form-data; boundary={}", "b".repeat(70));
    assert_eq!(boundary(&seventy).unwrap().len(), 70);
    assert_eq!(
        boundary("multipart/form-data; boundary=\"ab \"").unwrap_err(),
        MultipartError::InvalidBoundary
    );
    assert_eq!(
        boundary("multipart/form-data; boundary=\"a\u{e9}\"").unwrap_err(),
        MultipartError::InvalidBoundary
    );
}

#[test]
fn model_before_or_after_the_file() {
    let audio: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let first = form(&[("model", b"whisper-1"), ("file", &audio)]);
    assert_eq!(read_model(CT, &first).unwrap(), "whisper-1");
    let last = form(&[
        ("file", &audio),
        ("user", b"u1"),
        ("model", b"whisper-large"),
    ]);
    assert_eq!(read_model(CT, &last).unwrap(), "whisper-large");
    // The first model field wins.
    let two = form(&[("model", b"a"), ("model", b"b")]);
    assert_eq!(read_model(CT, &two).unwrap(), "a");
}

#[test]
fn stops_at_the_model_without_reading_the_file() {
    let mut scan = ModelScan::new(CT).unwrap();
    let head = b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nm1\r\n--XyZ\r\n";
    assert_eq!(scan.feed(head), Progress::Found("m1".into()));
    // Whatever follows changes nothing.
    assert_eq!(scan.feed(b"garbage"), Progress::Found("m1".into()));
    assert_eq!(scan.finish(), Ok("m1".into()));
    assert_eq!(scan.buffered(), 0);
}

#[test]
fn byte_by_byte_equals_whole() {
    let audio = b"\r\n--XyZZ not a delimiter? it is: boundary is a prefix".repeat(3);
    let body = form(&[("file", &[]), ("model", b"m-2"), ("file", &audio)]);
    // "\r\n--XyZZ" contains the delimiter: RFC 2046 forbids it in content; here it comes
    // after the model, so it does not matter.
    let mut scan = ModelScan::new(CT).unwrap();
    let mut out = Progress::NeedMore;
    for b in &body {
        out = scan.feed(std::slice::from_ref(b));
        assert!(scan.buffered() <= MAX_PART_HEADER_BYTES + 6);
        if out != Progress::NeedMore {
            break;
        }
    }
    assert_eq!(out, Progress::Found("m-2".into()));
}

#[test]
fn preamble_padding_and_empty_headers() {
    let body = b"preamble text\r\n--XyZ \t\r\n\r\nanonymous\r\n--XyZ\r\n\
        content-disposition: FORM-DATA; Name=\"model\"\r\n\r\nm\r\n--XyZ--";
    assert_eq!(read_model(CT, body).unwrap(), "m");
}

#[test]
fn malformed_bodies_have_clear_errors() {
    let e = |body: &[u8]| read_model(CT, body).unwrap_err();
    assert_eq!(e(b""), MultipartError::NoDelimiter);
    assert_eq!(e(b"{\"model\":\"m\"}"), MultipartError::NoDelimiter);
    assert_eq!(e(&form(&[("file", b"x")])), MultipartError::MissingModel);
    assert_eq!(e(&form(&[("model", b"")])), MultipartError::MissingModel);
    assert_eq!(e(b"--XyZ junk\r\n"), MultipartError::MalformedDelimiter);
    assert_eq!(e(b"--XyZ"), MultipartError::Truncated);
    assert_eq!(
        e(b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm"),
        MultipartError::Truncated
    );
    let huge_headers = [
        b"--XyZ\r\nX-Pad: ".to_vec(),
        vec![b'a'; MAX_PART_HEADER_BYTES + 10],
    ]
    .concat();
    assert_eq!(e(&huge_headers), MultipartError::PartHeadersTooLarge);
    let long_model = vec![b'm'; MAX_MODEL_BYTES + 1];
    assert_eq!(
        e(&form(&[("model", &long_model)])),
        MultipartError::ModelTooLong
    );
    let max_model = vec![b'm'; MAX_MODEL_BYTES];
    assert_eq!(
        read_model(CT, &form(&[("model", &max_model)]))
            .unwrap()
            .len(),
        MAX_MODEL_BYTES
    );
    assert_eq!(
        e(&form(&[("model", b"\xff")])),
        MultipartError::ModelNotUtf8
    );
    let many: Vec<(&str, &[u8])> = vec![("x", &b"1"[..]); MAX_PARTS as usize];
    assert_eq!(e(&form(&many)), MultipartError::TooManyParts);
    assert_eq!(
        read_model("text/plain", b"").unwrap_err(),
        MultipartError::NotMultipartForm
    );
    let err = MultipartError::MalformedDelimiter;
    assert_eq!((err.status(), err.code()), (400, "invalid_multipart"));
    assert_eq!(MultipartError::MissingModel.code(), "missing_model");
}

#[test]
fn user_fields_are_not_sessions() {
    use crate::scheduler::wire::session::{derive_session, SessionHeaders, SessionSource};
    let body = form(&[("user", b"alice"), ("model", b"m")]);
    let req = parse_form(CT, &body).unwrap();
    assert_eq!((req.model.as_str(), req.user.as_deref()), ("m", None));
    let (session, src) = derive_session(Some(b"key"), SessionHeaders::default(), &req, &body);
    assert_eq!((session, src), (None, SessionSource::None));
    let (session, src) =
        derive_session(Some(b"key"), SessionHeaders::configured(b"s1"), &req, &body);
    assert!(session.is_some());
    assert_eq!(src, SessionSource::Header);
    assert_eq!(
        parse_form(CT, b"").unwrap_err(),
        RequestError::Multipart(MultipartError::NoDelimiter)
    );
}
