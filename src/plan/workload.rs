//! Workloads for the planner: described (a rate with a daily shape, length distributions,
//! shared prefixes) or recorded (a trace the gateway wrote, see [`TraceRecord`]), optionally
//! scaled. Both become a list of [`Request`]s sorted by arrival.
//!
//! Invariants: generation is deterministic for a seed; every request has at least one prompt
//! token; arrivals are sorted and start at 0.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::fleet::Request;
use super::PlanError;

/// A length distribution: log-normal with this mean and standard deviation (0: fixed),
/// clamped to `[1, max]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lengths {
    pub mean: f64,
    pub sd: f64,
    pub max: u32,
}

impl Lengths {
    fn sample(&self, rng: &mut StdRng) -> u32 {
        let v = if self.sd <= 0.0 {
            self.mean
        } else {
            let s2 = (1.0 + (self.sd / self.mean).powi(2)).ln();
            let mu = self.mean.ln() - s2 / 2.0;
            (mu + s2.sqrt() * normal(rng)).exp()
        };
        (v.round() as u32).clamp(1, self.max.max(1))
    }
}

/// Shared prefixes: a `share` of requests start with one of `prefixes` prefixes of `tokens`
/// tokens (chosen uniformly).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharedPrefix {
    pub share: f64,
    pub prefixes: u32,
    pub tokens: u32,
}

/// A described workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Described {
    pub duration_s: f64,
    /// Mean requests per second at shape 1.
    pub rate: f64,
    /// Relative rate per hour of the day (24 values; empty: flat).
    pub daily_shape: Vec<f64>,
    /// Hour of the day the workload starts at.
    pub start_hour: f64,
    pub prompt: Lengths,
    pub output: Lengths,
    pub shared_prefix: Option<SharedPrefix>,
    pub seed: u64,
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(1e-12);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl Described {
    /// The rate at `t` seconds from the start.
    fn rate_at(&self, t: f64) -> f64 {
        if self.daily_shape.is_empty() {
            return self.rate;
        }
        let hour = ((self.start_hour + t / 3600.0).floor() as usize) % self.daily_shape.len();
        self.rate * self.daily_shape[hour]
    }

    /// The requests: Poisson arrivals at the shaped rate (thinned from the peak rate).
    pub fn generate(&self) -> Vec<Request> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let peak = self.daily_shape.iter().copied().fold(1.0f64, f64::max) * self.rate;
        let mut out = Vec::new();
        if peak <= 0.0 {
            return out;
        }
        let mut t = 0.0;
        loop {
            t += -rng.random::<f64>().max(1e-12).ln() / peak;
            if t >= self.duration_s {
                break;
            }
            if rng.random::<f64>() * peak > self.rate_at(t) {
                continue;
            }
            let mut prompt = self.prompt.sample(&mut rng);
            let prefix = self.shared_prefix.and_then(|p| {
                (rng.random::<f64>() < p.share).then(|| {
                    let which = rng.random_range(0..p.prefixes.max(1));
                    prompt = prompt.max(p.tokens + 1);
                    (fingerprint(u64::from(which)), p.tokens)
                })
            });
            out.push(Request {
                at_ns: (t * 1e9) as u64,
                prompt_tokens: prompt,
                output_tokens: self.output.sample(&mut rng),
                prefix,
                max_tokens: None,
            });
        }
        out
    }
}

fn fingerprint(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x5851_f42d_4c95_7f2d);
    z = (z ^ (z >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^ (z >> 29)
}

/// One line of a recorded trace (JSON Lines). Never any text: counts, the model, the API, a
/// fingerprint of the shared prefix, and what the gateway measured (traces written before it
/// did have none of those fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    /// Arrival, seconds since the Unix epoch.
    pub ts: f64,
    pub model: String,
    pub api: String,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    #[serde(default)]
    pub cached_tokens: u32,
    /// Fingerprint of the shared prefix (16 hex digits), if the request had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Tokens of the shared prefix.
    #[serde(default)]
    pub prefix_tokens: u32,
    /// The output the request asked for at most (`max_tokens` × `n`), if it set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// The backend that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Measured time to first token, milliseconds (streams only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Measured time per output token after the first, milliseconds (complete streams).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Measured time from arrival to the end of the answer, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
}

/// What the gateway measured of one recorded request, in seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measured {
    pub backend: Option<String>,
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
}

/// A recorded trace: its requests (sorted by arrival) and, in the same order, what was
/// measured of each.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recorded {
    pub requests: Vec<Request>,
    pub measured: Vec<Measured>,
}

impl Recorded {
    /// The distinct backends that answered (0: the trace does not name them).
    pub fn backends(&self) -> usize {
        let mut names: Vec<&str> = self
            .measured
            .iter()
            .filter_map(|m| m.backend.as_deref())
            .collect();
        names.sort_unstable();
        names.dedup();
        names.len()
    }
}

/// Milliseconds from a trace into seconds; a negative or non-finite value is an error.
fn seconds(field: &str, ms: Option<f64>, line: usize) -> Result<Option<f64>, PlanError> {
    match ms {
        Some(v) if !(v.is_finite() && v >= 0.0) => Err(PlanError::Trace(format!(
            "line {line}: `{field}` must be milliseconds ≥ 0"
        ))),
        v => Ok(v.map(|v| v / 1000.0)),
    }
}

/// Read a trace (one [`TraceRecord`] per line) into requests, keeping only `model` if given.
pub fn read_trace(text: &str, model: Option<&str>) -> Result<Vec<Request>, PlanError> {
    read_recorded(text, model).map(|r| r.requests)
}

/// Read a trace into requests and what was measured of each, keeping only `model` if given.
pub fn read_recorded(text: &str, model: Option<&str>) -> Result<Recorded, PlanError> {
    let mut recs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rec) = record(line, n + 1, model)? {
            recs.push(rec);
        }
    }
    recs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let t0 = recs.first().map_or(0.0, |r| r.0);
    let mut out = Recorded::default();
    for (ts, mut req, measured) in recs {
        req.at_ns = ((ts - t0) * 1e9) as u64;
        out.requests.push(req);
        out.measured.push(measured);
    }
    Ok(out)
}

/// One trace line (number `n`): its arrival, request and measurements; `None` for another
/// model than `model`.
fn record(
    line: &str,
    n: usize,
    model: Option<&str>,
) -> Result<Option<(f64, Request, Measured)>, PlanError> {
    let r: TraceRecord =
        serde_json::from_str(line).map_err(|e| PlanError::Trace(format!("line {n}: {e}")))?;
    if !r.ts.is_finite() || r.ts < 0.0 {
        return Err(PlanError::Trace(format!("line {n}: `ts` must be a time")));
    }
    if model.is_some_and(|m| m != r.model) {
        return Ok(None);
    }
    let prefix = match &r.prefix {
        None => None,
        Some(h) => Some(
            u64::from_str_radix(h, 16)
                .map_err(|_| PlanError::Trace(format!("line {n}: `prefix` is not hexadecimal")))?,
        ),
    };
    let prompt = r.prompt_tokens.max(1);
    let req = Request {
        at_ns: 0,
        prompt_tokens: prompt,
        output_tokens: r.completion_tokens,
        prefix: prefix.map(|f| (f, r.prefix_tokens.min(prompt))),
        max_tokens: r.max_tokens,
    };
    let measured = Measured {
        ttft: seconds("ttft_ms", r.ttft_ms, n)?,
        tpot: seconds("tpot_ms", r.tpot_ms, n)?,
        backend: r.backend,
    };
    seconds("duration_ms", r.duration_ms, n)?;
    Ok(Some((r.ts, req, measured)))
}

/// `factor` times the traffic: each request is there ⌊factor⌋ times (plus once more with the
/// fractional part's probability), the copies spread over one mean gap after the original.
pub fn scale(reqs: &[Request], factor: f64, seed: u64) -> Vec<Request> {
    if reqs.is_empty() || factor <= 0.0 {
        return Vec::new();
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let span = reqs.last().map_or(0, |r| r.at_ns).max(1);
    let gap = span as f64 / reqs.len() as f64;
    let mut out = Vec::with_capacity((reqs.len() as f64 * factor) as usize + 1);
    for r in reqs {
        let copies = factor.floor() as u32 + u32::from(rng.random::<f64>() < factor.fract());
        for c in 0..copies {
            let shift = if c == 0 {
                0.0
            } else {
                rng.random::<f64>() * gap
            };
            out.push(Request {
                at_ns: r.at_ns + shift as u64,
                ..*r
            });
        }
    }
    out.sort_by_key(|r| r.at_ns);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(rate: f64) -> Described {
        Described {
            duration_s: 600.0,
            rate,
            daily_shape: Vec::new(),
            start_hour: 0.0,
            prompt: Lengths {
                mean: 500.0,
                sd: 200.0,
                max: 4000,
            },
            output: Lengths {
                mean: 100.0,
                sd: 0.0,
                max: 1000,
            },
            shared_prefix: Some(SharedPrefix {
                share: 0.5,
                prefixes: 4,
                tokens: 256,
            }),
            seed: 3,
        }
    }

    #[test]
    fn described_traffic_has_its_rate_lengths_and_prefix_share() {
        let reqs = described(10.0).generate();
        let n = reqs.len() as f64;
        assert!((n / 600.0 - 10.0).abs() < 0.5, "{n} requests");
        let mean = reqs.iter().map(|r| f64::from(r.prompt_tokens)).sum::<f64>() / n;
        assert!((mean - 500.0).abs() < 30.0, "mean prompt {mean}");
        assert!(reqs.iter().all(|r| r.output_tokens == 100));
        let shared = reqs.iter().filter(|r| r.prefix.is_some()).count() as f64 / n;
        assert!((shared - 0.5).abs() < 0.05, "{shared}");
        assert!(reqs.windows(2).all(|w| w[0].at_ns <= w[1].at_ns));
        assert_eq!(reqs, described(10.0).generate(), "deterministic for a seed");
    }

    #[test]
    fn the_daily_shape_scales_the_rate_by_hour() {
        let mut d = described(4.0);
        d.duration_s = 7200.0;
        d.daily_shape = (0..24).map(|h| if h == 1 { 2.0 } else { 0.5 }).collect();
        let reqs = d.generate();
        let first = reqs.iter().filter(|r| r.at_ns < 3_600_000_000_000).count() as f64;
        let second = reqs.len() as f64 - first;
        assert!((second / first - 4.0).abs() < 0.6, "{first} then {second}");
    }

    #[test]
    fn a_trace_is_read_relative_to_its_first_arrival_and_scaled() {
        let text = r#"{"ts":1000.5,"model":"m","api":"chat","prompt_tokens":10,"completion_tokens":5,"cached_tokens":0,"prefix":"00000000000000ff","prefix_tokens":8,"max_tokens":64}
{"ts":1000.0,"model":"m","api":"chat","prompt_tokens":20,"completion_tokens":7}
{"ts":1001.0,"model":"other","api":"chat","prompt_tokens":20,"completion_tokens":7}
"#;
        let reqs = read_trace(text, Some("m")).expect("valid");
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[0].at_ns, 0);
        assert_eq!(reqs[1].at_ns, 500_000_000);
        assert_eq!(reqs[1].prefix, Some((255, 8)));
        assert_eq!((reqs[0].max_tokens, reqs[1].max_tokens), (None, Some(64)));
        assert_eq!(scale(&reqs, 3.0, 1).len(), 6);
        let err = read_trace("{\"ts\":1}\n", None).expect_err("fields missing");
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    #[test]
    fn measured_latencies_and_backends_are_read_in_arrival_order() {
        let text = r#"{"ts":2.0,"model":"m","api":"chat","prompt_tokens":10,"completion_tokens":5,"backend":"b","ttft_ms":120.0,"tpot_ms":20.0,"duration_ms":200.0}
{"ts":1.0,"model":"m","api":"chat","prompt_tokens":10,"completion_tokens":5,"backend":"a","duration_ms":90.0}
{"ts":3.0,"model":"m","api":"chat","prompt_tokens":10,"completion_tokens":5,"backend":"a","ttft_ms":80.0}
"#;
        let r = read_recorded(text, None).expect("valid");
        assert_eq!(r.backends(), 2);
        let ttft: Vec<Option<f64>> = r.measured.iter().map(|m| m.ttft).collect();
        assert_eq!(ttft, [None, Some(0.12), Some(0.08)]);
        assert_eq!(r.measured[1].tpot, Some(0.02));
        let bad = text.replace("120.0", "-1");
        let err = read_recorded(&bad, None).expect_err("negative");
        assert!(err.to_string().contains("line 1: `ttft_ms`"), "{err}");
        let old = r#"{"ts":1,"model":"m","api":"chat","prompt_tokens":1,"completion_tokens":1}"#;
        assert_eq!(read_recorded(old, None).expect("old").backends(), 0);
    }
}
