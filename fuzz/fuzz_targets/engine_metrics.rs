//! The engine-metrics parser and the scrape record codec on arbitrary bytes: never panics,
//! never reads past its limit, reports only clamped values, and what it reads does not change
//! when CRLF replaces LF. Two pages scraped one after the other (the body and `second`) fold
//! into a record whose decode pace, if any, is at least 1 µs per token and round-trips. Run: `scripts/fuzz` (or `cargo +nightly fuzz run engine_metrics`).
#![no_main]

use arbitrary::Arbitrary;
use computeflux::scheduler::routing::scrape::{Lease, Scraped};
use computeflux::scheduler::wire::engine_load::{parse, Format};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    format: u8,
    max_bytes: u16,
    /// How much longer the whole response was than `body` (0: `body` is all of it).
    missing: u8,
    model: Option<&'a str>,
    body: &'a [u8],
    /// The page of the next scrape (for the decode pace window).
    second: &'a [u8],
}

const FORMATS: [Format; 5] = [
    Format::Vllm,
    Format::Sglang,
    Format::Llamacpp,
    Format::Tgi,
    Format::Auto,
];

fuzz_target!(|input: Input<'_>| {
    let format = FORMATS[usize::from(input.format) % FORMATS.len()];
    let models: Vec<&str> = input.model.into_iter().collect();
    let max = usize::from(input.max_bytes);
    let full = input.body.len() + usize::from(input.missing);
    let p = parse(input.body, full, format, &models, max);
    assert!(p.stats.bytes_read <= max.min(input.body.len()));
    assert!(p.stats.garbage_lines <= p.stats.lines);
    assert_eq!(
        p.stats.truncated,
        max < input.body.len() || input.missing > 0
    );
    if let Ok(l) = p.load {
        assert!(l.kv_usage_permille.is_none_or(|k| k <= 1000));
    }

    // Line endings do not matter (for a body read whole, whose lines hold no stray CR).
    if !input.body.contains(&b'\r') {
        let whole = parse(input.body, input.body.len(), format, &models, usize::MAX);
        let mut crlf = Vec::with_capacity(input.body.len() * 2);
        for &b in input.body {
            if b == b'\n' {
                crlf.push(b'\r');
            }
            crlf.push(b);
        }
        let other = parse(&crlf, crlf.len(), format, &models, usize::MAX);
        assert_eq!(whole.load, other.load);
        assert_eq!(whole.stats.garbage_lines, other.stats.garbage_lines);
    }

    // Two scrapes in a row: the pace window never panics and stays canonical.
    let next = parse(
        input.second,
        input.second.len(),
        format,
        &models,
        usize::MAX,
    );
    let mut rec = Scraped::default();
    for (i, load) in [p.load, next.load].into_iter().enumerate() {
        if let Ok(l) = load {
            rec.succeeded(l, i as u64 + 1);
        }
    }
    assert!(rec.pace.is_none_or(|pc| pc.us_per_token >= 1));
    assert_eq!(
        rec.decode_base.is_some(),
        rec.last.and_then(|l| l.decode).is_some()
    );
    assert_eq!(Scraped::decode(&rec.encode()), Some(rec));

    if let Some(r) = Scraped::decode(input.body) {
        assert_eq!(r.encode(), input.body);
    }
    if let Some(l) = Lease::decode(input.body) {
        assert_eq!(l.encode(), input.body);
    }
});
