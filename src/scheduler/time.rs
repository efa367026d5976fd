//! The time formats upstreams state reset instants and durations in, as Unix milliseconds.
//!
//! - HTTP-date (IMF-fixdate, RFC 9110 §5.6.7): `Retry-After: Sun, 06 Nov 1994 08:49:37 GMT`;
//! - Go durations: OpenAI's `x-ratelimit-reset-*` (`1s`, `6m0s`, `20ms`);
//! - RFC 3339 instants: Anthropic's `anthropic-ratelimit-*-reset`.
//!
//! One module, so that the calendar arithmetic (`days_from_civil`) exists once. Pure functions
//! over text: malformed or out-of-range input (years outside 1970–9999) reads as `None`, never
//! a panic. Their worked examples are tested where the headers are read (`health::outcome`,
//! `routing::quota`). Imports nothing.

/// Durations such as `1s`, `6m0s`, `20ms`, `1m30.5s`, `2h` (OpenAI's reset headers).
pub fn parse_go_duration_ms(value: &str) -> Option<u64> {
    let s = value.trim();
    if s.is_empty() || s.len() > 32 {
        return None;
    }
    let mut total = 0.0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at_checked(num_len)?;
        let n: f64 = num.parse().ok()?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at_checked(unit_len)?;
        let scale = match unit {
            "ms" => 1.0,
            "s" => 1_000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            _ => return None,
        };
        total += n * scale;
        rest = next;
    }
    (total.is_finite() && total >= 0.0).then_some(total.round() as u64)
}

/// IMF-fixdate (RFC 9110 §5.6.7), the only form senders may generate. Returns Unix ms.
pub fn parse_http_date_ms(v: &str) -> Option<u64> {
    // "Sun, 06 Nov 1994 08:49:37 GMT"
    let mut parts = v.split_ascii_whitespace();
    let _weekday = parts.next().filter(|w| w.ends_with(','))?;
    let day: u64 = parts.next()?.parse().ok()?;
    let month = match parts.next()? {
        "Jan" => 1,
        "Feb" => 2,
        "Mar" => 3,
        "Apr" => 4,
        "May" => 5,
        "Jun" => 6,
        "Jul" => 7,
        "Aug" => 8,
        "Sep" => 9,
        "Oct" => 10,
        "Nov" => 11,
        "Dec" => 12,
        _ => return None,
    };
    let year: u64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':');
    let h: u64 = hms.next()?.parse().ok()?;
    let m: u64 = hms.next()?.parse().ok()?;
    let s: u64 = hms.next()?.parse().ok()?;
    if parts.next()? != "GMT" || parts.next().is_some() || hms.next().is_some() {
        return None;
    }
    if !(1970..=9999).contains(&year) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(((days * 86_400) + h * 3600 + m * 60 + s) * 1000)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// An RFC 3339 instant (`2026-11-30T16:05:09Z`, `…09.123+01:00`) as Unix ms; years 1970–9999.
pub fn parse_rfc3339_ms(v: &[u8]) -> Option<u64> {
    let v = std::str::from_utf8(v.trim_ascii()).ok()?;
    if v.len() > 40 || !v.is_ascii() {
        return None;
    }
    let num = |s: &str| -> Option<u64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let (date, time) = v.split_once(['T', 't', ' '])?;
    let mut d = date.split('-');
    let (year, month, day) = (num(d.next()?)?, num(d.next()?)?, num(d.next()?)?);
    if d.next().is_some() {
        return None;
    }
    // The offset: `Z`, or `±HH:MM` after the seconds.
    let (clock, offset_min): (&str, i64) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (c, off) = time.split_at_checked(at)?;
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (oh, om) = off.get(1..)?.split_once(':')?;
        let (oh, om) = (num(oh)?, num(om)?);
        if oh > 23 || om > 59 {
            return None;
        }
        (c, sign * (oh * 60 + om) as i64)
    };
    let (whole, frac) = clock.split_once('.').unwrap_or((clock, ""));
    let mut hms = whole.split(':');
    let (h, m, s) = (num(hms.next()?)?, num(hms.next()?)?, num(hms.next()?)?);
    if hms.next().is_some() || !frac.bytes().all(|b| b.is_ascii_digit()) || frac.len() > 9 {
        return None;
    }
    if !(1970..=9999).contains(&year)
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || h > 23
        || m > 59
        || s > 60
    {
        return None;
    }
    let ms = frac
        .bytes()
        .chain(std::iter::repeat(b'0'))
        .take(3)
        .fold(0u64, |acc, b| acc * 10 + u64::from(b - b'0'));
    let local =
        ((days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + s) * 1000 + ms) as i64;
    u64::try_from(local - offset_min * 60_000).ok()
}
