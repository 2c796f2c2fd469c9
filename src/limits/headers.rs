//! OpenAI's rate-limit headers, sent on every answer to an admitted or refused request so SDKs
//! can pace themselves: `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
//! `x-ratelimit-reset-requests` and the same three for `-tokens`. Resets are Go-style durations
//! ("1s", "6m0s", "20ms", "1.5s"), as OpenAI sends them. When a key and its tenant both limit a
//! quantity, the one with the least remaining is reported.

use http::{HeaderMap, HeaderName, HeaderValue};

use super::plan::{Check, CheckState, Kind};

/// A duration in milliseconds written like Go's `time.Duration.String()` (at ms precision).
pub fn go_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let h = ms / 3_600_000;
    let m = (ms / 60_000) % 60;
    let s_ms = ms % 60_000;
    let mut secs = format!("{}", s_ms / 1000);
    let frac = s_ms % 1000;
    if frac != 0 {
        let f = format!("{frac:03}");
        secs.push('.');
        secs.push_str(f.trim_end_matches('0'));
    }
    if h > 0 {
        format!("{h}h{m}m{secs}s")
    } else if m > 0 {
        format!("{m}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

/// The tightest check of `kind`: (limit, state).
pub fn tightest(checks: &[Check], states: &[CheckState], kind: Kind) -> Option<(u64, CheckState)> {
    checks
        .iter()
        .zip(states)
        .filter(|(c, _)| c.kind == kind)
        .min_by_key(|(_, s)| s.remaining)
        .map(|(c, s)| (c.limit, *s))
}

/// Header names of (limit, remaining, reset) per quantity.
const REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];
const TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// The `x-ratelimit-*` headers for the evaluated checks.
pub fn rate_headers(checks: &[Check], states: &[CheckState]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (kind, [limit_name, remaining_name, reset_name]) in
        [(Kind::Requests, REQUESTS), (Kind::Tokens, TOKENS)]
    {
        if let Some((limit, s)) = tightest(checks, states, kind) {
            h.insert(limit_name, HeaderValue::from(limit));
            h.insert(remaining_name, HeaderValue::from(s.remaining));
            if let Ok(v) = HeaderValue::from_str(&go_duration(s.reset_ms)) {
                h.insert(reset_name, v);
            }
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_style() {
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(20), "20ms");
        assert_eq!(go_duration(1000), "1s");
        assert_eq!(go_duration(1200), "1.2s");
        assert_eq!(go_duration(1234), "1.234s");
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(90_500), "1m30.5s");
        assert_eq!(go_duration(3_723_000), "1h2m3s");
        assert_eq!(go_duration(3_600_000), "1h0m0s");
    }
}
