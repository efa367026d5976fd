//! The quota an answer states in its headers: OpenAI's and Anthropic's rate-limit header
//! names, their counts parsed, and the tighter of two statements kept ([`QuotaHint::read`]).

use super::*;

/// The header names of one count: what remains, when it resets, the limit.
#[derive(Clone, Copy)]
pub(super) struct Names {
    pub(super) remaining: &'static str,
    pub(super) reset: &'static str,
    pub(super) limit: &'static str,
}

pub(super) const OPENAI_REQUESTS: Names = Names {
    remaining: "x-ratelimit-remaining-requests",
    reset: "x-ratelimit-reset-requests",
    limit: "x-ratelimit-limit-requests",
};
pub(super) const OPENAI_TOKENS: Names = Names {
    remaining: "x-ratelimit-remaining-tokens",
    reset: "x-ratelimit-reset-tokens",
    limit: "x-ratelimit-limit-tokens",
};
pub(super) const ANTHROPIC_REQUESTS: Names = Names {
    remaining: "anthropic-ratelimit-requests-remaining",
    reset: "anthropic-ratelimit-requests-reset",
    limit: "anthropic-ratelimit-requests-limit",
};
pub(super) const ANTHROPIC_TOKENS: [Names; 3] = [
    Names {
        remaining: "anthropic-ratelimit-tokens-remaining",
        reset: "anthropic-ratelimit-tokens-reset",
        limit: "anthropic-ratelimit-tokens-limit",
    },
    Names {
        remaining: "anthropic-ratelimit-input-tokens-remaining",
        reset: "anthropic-ratelimit-input-tokens-reset",
        limit: "anthropic-ratelimit-input-tokens-limit",
    },
    Names {
        remaining: "anthropic-ratelimit-output-tokens-remaining",
        reset: "anthropic-ratelimit-output-tokens-reset",
        limit: "anthropic-ratelimit-output-tokens-limit",
    },
];

/// A remaining count: ASCII digits only, at most [`MAX_REMAINING`].
pub fn parse_count(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 13 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v)
        .ok()?
        .parse::<u64>()
        .ok()
        .filter(|n| *n <= MAX_REMAINING)
}

pub(super) fn stated<H: HeaderSource + ?Sized>(
    h: &H,
    Names {
        remaining,
        reset,
        limit,
    }: Names,
    parse_reset: &dyn Fn(&[u8]) -> Option<u64>,
) -> Option<Stated> {
    let left = parse_count(&h.header(remaining)?)?;
    Some(Stated {
        left,
        reset_in_ms: h.header(reset).and_then(|v| parse_reset(&v)),
        // A limit below what is left is not a limit.
        limit: h
            .header(limit)
            .and_then(|v| parse_count(&v))
            .filter(|l| *l >= left),
    })
}

/// The smaller of two stated counts (the one that runs out first).
pub(super) fn tighter(a: Option<Stated>, b: Option<Stated>) -> Option<Stated> {
    match (a, b) {
        (Some(x), Some(y)) => Some(if y.left < x.left { y } else { x }),
        (x, y) => x.or(y),
    }
}

impl QuotaHint {
    /// The quota a successful answer's headers state. Reads two headers when the answer
    /// carries OpenAI's family, six when it carries none (each read is a host call in Envoy),
    /// plus the resets and limits of the counts found. `sent_ms`: when the request was sent
    /// (a duration counts from there, an instant is taken as it is).
    pub fn read<H: HeaderSource + ?Sized>(h: &H, sent_ms: u64) -> QuotaHint {
        let duration = |v: &[u8]| std::str::from_utf8(v).ok().and_then(parse_go_duration_ms);
        let hint = QuotaHint {
            requests: stated(h, OPENAI_REQUESTS, &duration),
            tokens: stated(h, OPENAI_TOKENS, &duration),
            at_ms: Some(sent_ms),
        };
        if !hint.is_empty() {
            return hint;
        }
        let instant = |v: &[u8]| parse_rfc3339_ms(v).map(|at| at.saturating_sub(sent_ms));
        QuotaHint {
            requests: stated(h, ANTHROPIC_REQUESTS, &instant),
            tokens: ANTHROPIC_TOKENS
                .iter()
                .map(|&names| stated(h, names, &instant))
                .fold(None, tighter),
            at_ms: Some(sent_ms),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }
}
