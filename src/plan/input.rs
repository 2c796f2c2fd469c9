//! The plan file (TOML, like the gateway's config): its serde types and their validation into
//! a [`PlanInput`]. Every rejected value names its field; see docs/capacity-planning.md for the
//! format and examples/plan.toml for a worked example.
//!
//! Invariant: a `PlanInput` has at least one candidate, a workload with at least one request's
//! worth of rate or trace, positive SLO bounds and a server limit ≥ 1.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::roofline::{self, ModelSpec};
use super::workload::{Described, Lengths, SharedPrefix};
use super::PlanError;
use crate::batching::Timing;
use crate::config::PolicyKind;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    workload: WorkloadDoc,
    slo: SloDoc,
    model: Option<ModelDoc>,
    #[serde(default)]
    search: SearchDoc,
    #[serde(default)]
    costs: CostsDoc,
    #[serde(default, rename = "candidate")]
    candidates: Vec<CandidateDoc>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadDoc {
    duration: Option<String>,
    rate: Option<f64>,
    #[serde(default)]
    daily_shape: Vec<f64>,
    #[serde(default)]
    start_hour: f64,
    #[serde(default)]
    seed: u64,
    prompt_tokens: Option<LengthsDoc>,
    output_tokens: Option<LengthsDoc>,
    shared_prefix: Option<PrefixDoc>,
    trace: Option<PathBuf>,
    scale: Option<f64>,
    model: Option<String>,
    recorded_servers: Option<usize>,
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct LengthsDoc {
    mean: f64,
    #[serde(default)]
    sd: f64,
    max: Option<u32>,
}

#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
struct PrefixDoc {
    share: f64,
    prefixes: u32,
    tokens: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SloDoc {
    ttft_p99: String,
    tpot_p99: String,
    max_queue_wait: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelDoc {
    params_b: f64,
    active_params_b: Option<f64>,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    #[serde(default = "bf16")]
    dtype: String,
    #[serde(default = "bf16")]
    kv_dtype: String,
}

fn bf16() -> String {
    "bf16".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchDoc {
    #[serde(default = "default_max_servers")]
    max_servers: usize,
    #[serde(default = "default_policy")]
    policy: String,
}

impl Default for SearchDoc {
    fn default() -> Self {
        SearchDoc {
            max_servers: default_max_servers(),
            policy: default_policy(),
        }
    }
}

fn default_max_servers() -> usize {
    64
}

fn default_policy() -> String {
    "token-aware".into()
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CostsDoc {
    #[serde(default)]
    electricity_per_kwh: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CandidateDoc {
    name: String,
    gpu: Option<String>,
    gpus: Option<u32>,
    tp: Option<u32>,
    max_num_seqs: Option<usize>,
    profile: Option<PathBuf>,
    backend: Option<OneOrMany>,
    timing: Option<TimingDoc>,
    price_per_hour: Option<f64>,
    purchase_price: Option<f64>,
    lifetime_years: Option<f64>,
    power_watts: Option<f64>,
}

/// One backend name, or several to merge.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimingDoc {
    max_num_seqs: usize,
    kv_capacity_tokens: u64,
    prefill_per_token: String,
    decode_base: String,
    decode_per_seq: String,
    #[serde(default = "default_block")]
    block_size: u32,
}

fn default_block() -> u32 {
    16
}

/// Where a workload comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSource {
    Described(Described),
    Recorded {
        trace: PathBuf,
        scale: f64,
        model: Option<String>,
        seed: u64,
        /// The fleet the trace was recorded on, in engines, when the plan file says (else the
        /// backends the trace names): the self-check replays the trace on it.
        recorded_servers: Option<usize>,
    },
}

/// The service level objective, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_p99: f64,
    pub tpot_p99: f64,
    pub max_queue_wait: f64,
}

/// How a candidate's engine is known.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerSource {
    /// GPU model and count, by the roofline.
    Specified {
        gpu: &'static roofline::Accelerator,
        gpus: u32,
        tp: Option<u32>,
        max_num_seqs: usize,
    },
    /// Backends of a profile exported by a live gateway (`GET /admin/profile`): one, or
    /// several of one kind whose measurements are merged.
    Measured {
        profile: PathBuf,
        backends: Vec<String>,
        /// Batch slots, overriding what the profile knows.
        max_num_seqs: Option<usize>,
    },
    /// The engine timing itself (the simulator's model).
    Timing(Timing),
}

/// What a server costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Price {
    PerHour(f64),
    Purchase { price: f64, lifetime_years: f64 },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub name: String,
    pub source: ServerSource,
    pub price: Price,
    /// Watts per server (`None`: from the catalogue for specified servers, else unknown).
    pub power_watts: Option<f64>,
}

/// A validated plan file.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    pub workload: WorkloadSource,
    pub slo: Slo,
    pub model: Option<ModelSpec>,
    pub max_servers: usize,
    pub policy: PolicyKind,
    pub electricity_per_kwh: f64,
    pub candidates: Vec<Candidate>,
}

impl PlanInput {
    /// Scale the traffic by `factor`: a recorded trace's copies, a described workload's rate.
    pub fn scale(&mut self, factor: f64) -> Result<(), PlanError> {
        let factor = positive("--scale", factor)?;
        match &mut self.workload {
            WorkloadSource::Described(d) => d.rate *= factor,
            WorkloadSource::Recorded { scale, .. } => *scale *= factor,
        }
        Ok(())
    }
}

/// Read and validate a plan file; relative paths in it are relative to its directory.
pub fn load(path: &Path) -> Result<PlanInput, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlanError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text, path.parent().unwrap_or(Path::new(".")))
}

/// Parse and validate plan-file text.
pub fn parse(text: &str, base: &Path) -> Result<PlanInput, PlanError> {
    let doc: FileDoc = toml::from_str(text).map_err(|e| PlanError::Parse(e.to_string()))?;
    let model = doc.model.as_ref().map(model).transpose()?;
    let candidates = doc
        .candidates
        .iter()
        .map(|c| candidate(c, base, model.is_some()))
        .collect::<Result<Vec<_>, _>>()?;
    if candidates.is_empty() {
        return Err(invalid("candidate", "at least one [[candidate]] is needed"));
    }
    let mut names: Vec<&str> = candidates.iter().map(|c| c.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(invalid(
            "candidate.name",
            &format!("`{}` is used twice", w[0]),
        ));
    }
    if doc.search.max_servers == 0 || doc.search.max_servers > 4096 {
        return Err(invalid("search.max_servers", "must be between 1 and 4096"));
    }
    let policy = doc
        .search
        .policy
        .parse::<PolicyKind>()
        .map_err(|e| invalid("search.policy", &e))?;
    if !(doc.costs.electricity_per_kwh >= 0.0 && doc.costs.electricity_per_kwh.is_finite()) {
        return Err(invalid("costs.electricity_per_kwh", "must be ≥ 0"));
    }
    Ok(PlanInput {
        workload: workload(&doc.workload, base)?,
        slo: Slo {
            ttft_p99: seconds("slo.ttft_p99", &doc.slo.ttft_p99)?,
            tpot_p99: seconds("slo.tpot_p99", &doc.slo.tpot_p99)?,
            max_queue_wait: seconds("slo.max_queue_wait", &doc.slo.max_queue_wait)?,
        },
        model,
        max_servers: doc.search.max_servers,
        policy,
        electricity_per_kwh: doc.costs.electricity_per_kwh,
        candidates,
    })
}

fn invalid(field: &str, why: &str) -> PlanError {
    PlanError::Invalid(format!("`{field}`: {why}"))
}

fn duration(field: &str, s: &str) -> Result<Duration, PlanError> {
    humantime::parse_duration(s.trim()).map_err(|e| {
        invalid(
            field,
            &format!("`{s}` is not a duration ({e}); e.g. \"1h\", \"250ms\""),
        )
    })
}

fn seconds(field: &str, s: &str) -> Result<f64, PlanError> {
    let d = duration(field, s)?;
    if d.is_zero() {
        return Err(invalid(field, "must be more than zero"));
    }
    Ok(d.as_secs_f64())
}

fn positive(field: &str, v: f64) -> Result<f64, PlanError> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(invalid(field, "must be a number above zero"))
    }
}

fn lengths(field: &str, d: Option<LengthsDoc>, default_max: u32) -> Result<Lengths, PlanError> {
    let d = d.ok_or_else(|| invalid(field, "is required for a described workload"))?;
    let mean = positive(&format!("{field}.mean"), d.mean)?;
    if !(d.sd >= 0.0 && d.sd.is_finite()) {
        return Err(invalid(&format!("{field}.sd"), "must be ≥ 0"));
    }
    let max = d.max.unwrap_or(default_max);
    if f64::from(max) < mean {
        return Err(invalid(
            &format!("{field}.max"),
            "must be at least the mean",
        ));
    }
    Ok(Lengths {
        mean,
        sd: d.sd,
        max,
    })
}

fn workload(w: &WorkloadDoc, base: &Path) -> Result<WorkloadSource, PlanError> {
    if let Some(trace) = &w.trace {
        if w.rate.is_some() || w.prompt_tokens.is_some() || w.output_tokens.is_some() {
            return Err(invalid(
                "workload.trace",
                "a recorded workload takes no rate or length distributions",
            ));
        }
        let scale = positive("workload.scale", w.scale.unwrap_or(1.0))?;
        if w.recorded_servers.is_some_and(|n| n == 0 || n > 4096) {
            return Err(invalid(
                "workload.recorded_servers",
                "must be between 1 and 4096",
            ));
        }
        return Ok(WorkloadSource::Recorded {
            trace: base.join(trace),
            scale,
            model: w.model.clone(),
            seed: w.seed,
            recorded_servers: w.recorded_servers,
        });
    }
    for (field, set) in [
        ("workload.scale", w.scale.is_some()),
        ("workload.recorded_servers", w.recorded_servers.is_some()),
    ] {
        if set {
            return Err(invalid(field, "applies to a recorded `trace` only"));
        }
    }
    let rate = positive(
        "workload.rate",
        w.rate
            .ok_or_else(|| invalid("workload", "needs a `trace` or a `rate`"))?,
    )?;
    let duration_s = duration("workload.duration", w.duration.as_deref().unwrap_or("1h"))?;
    let duration_s = positive("workload.duration", duration_s.as_secs_f64())?;
    if !w.daily_shape.is_empty()
        && (w.daily_shape.len() != 24
            || w.daily_shape.iter().any(|v| !(*v >= 0.0 && v.is_finite())))
    {
        return Err(invalid(
            "workload.daily_shape",
            "must be 24 numbers ≥ 0 (one per hour)",
        ));
    }
    if !(0.0..24.0).contains(&w.start_hour) {
        return Err(invalid("workload.start_hour", "must be in [0, 24)"));
    }
    let shared_prefix = match w.shared_prefix {
        None => None,
        Some(p) => {
            if !(0.0..=1.0).contains(&p.share) {
                return Err(invalid("workload.shared_prefix.share", "must be in [0, 1]"));
            }
            if p.prefixes == 0 || p.tokens == 0 {
                return Err(invalid(
                    "workload.shared_prefix",
                    "`prefixes` and `tokens` must be above zero",
                ));
            }
            Some(SharedPrefix {
                share: p.share,
                prefixes: p.prefixes,
                tokens: p.tokens,
            })
        }
    };
    Ok(WorkloadSource::Described(Described {
        duration_s,
        rate,
        daily_shape: w.daily_shape.clone(),
        start_hour: w.start_hour,
        prompt: lengths("workload.prompt_tokens", w.prompt_tokens, 32_768)?,
        output: lengths("workload.output_tokens", w.output_tokens, 8_192)?,
        shared_prefix,
        seed: w.seed,
    }))
}

fn model(m: &ModelDoc) -> Result<ModelSpec, PlanError> {
    let params = positive("model.params_b", m.params_b)? * 1e9;
    let active = positive(
        "model.active_params_b",
        m.active_params_b.unwrap_or(m.params_b),
    )? * 1e9;
    if m.layers == 0 || m.kv_heads == 0 || m.head_dim == 0 {
        return Err(invalid(
            "model",
            "`layers`, `kv_heads` and `head_dim` must be above zero",
        ));
    }
    let bytes = |field: &str, d: &str| {
        roofline::dtype_bytes(d).ok_or_else(|| {
            invalid(
                field,
                &format!("unknown dtype `{d}` (fp32, bf16, fp16, fp8, int8, int4)"),
            )
        })
    };
    Ok(ModelSpec {
        params,
        active_params: active.min(params),
        layers: m.layers,
        kv_heads: m.kv_heads,
        head_dim: m.head_dim,
        weight_bytes: bytes("model.dtype", &m.dtype)?,
        kv_bytes: bytes("model.kv_dtype", &m.kv_dtype)?,
    })
}

fn candidate(c: &CandidateDoc, base: &Path, have_model: bool) -> Result<Candidate, PlanError> {
    let at = |f: &str| format!("candidate `{}`: {f}", c.name);
    if c.name.trim().is_empty() {
        return Err(invalid("candidate.name", "must not be empty"));
    }
    let kinds = [c.gpu.is_some(), c.profile.is_some(), c.timing.is_some()];
    if kinds.iter().filter(|k| **k).count() != 1 {
        return Err(invalid(
            &at("gpu|profile|timing"),
            "give exactly one of `gpu` (specified), `profile` (measured) or `timing`",
        ));
    }
    let source = if let Some(g) = &c.gpu {
        let gpu = roofline::accelerator(g).ok_or_else(|| {
            let known: Vec<&str> = roofline::CATALOGUE.iter().map(|a| a.name).collect();
            invalid(
                &at("gpu"),
                &format!("unknown accelerator `{g}` (known: {})", known.join(", ")),
            )
        })?;
        if !have_model {
            return Err(invalid(
                &at("gpu"),
                "a specified server needs the [model] section",
            ));
        }
        let gpus = c.gpus.unwrap_or(1);
        if gpus == 0 || gpus > 64 {
            return Err(invalid(&at("gpus"), "must be between 1 and 64"));
        }
        if let Some(tp) = c.tp {
            if tp == 0 || !tp.is_power_of_two() || gpus % tp != 0 {
                return Err(invalid(&at("tp"), "must be a power of two dividing `gpus`"));
            }
        }
        ServerSource::Specified {
            gpu,
            gpus,
            tp: c.tp,
            max_num_seqs: c.max_num_seqs.unwrap_or(256).max(1),
        }
    } else if let Some(p) = &c.profile {
        let backends = match c.backend.clone() {
            Some(OneOrMany::One(b)) => vec![b],
            Some(OneOrMany::Many(bs)) => bs,
            None => Vec::new(),
        };
        if backends.is_empty() || backends.iter().any(|b| b.trim().is_empty()) {
            return Err(invalid(
                &at("backend"),
                "a measured server names the profile's backend (or a list of backends to merge)",
            ));
        }
        if c.max_num_seqs == Some(0) {
            return Err(invalid(&at("max_num_seqs"), "must be above zero"));
        }
        ServerSource::Measured {
            profile: base.join(p),
            backends,
            max_num_seqs: c.max_num_seqs,
        }
    } else {
        let t = c
            .timing
            .as_ref()
            .ok_or_else(|| invalid(&at("timing"), "missing"))?;
        if t.max_num_seqs == 0 || t.kv_capacity_tokens == 0 || t.block_size == 0 {
            return Err(invalid(
                &at("timing"),
                "`max_num_seqs`, `kv_capacity_tokens` and `block_size` must be above zero",
            ));
        }
        ServerSource::Timing(Timing {
            max_num_seqs: t.max_num_seqs,
            kv_capacity_tokens: t.kv_capacity_tokens,
            prefill_per_token: duration(&at("timing.prefill_per_token"), &t.prefill_per_token)?,
            decode_base: duration(&at("timing.decode_base"), &t.decode_base)?,
            decode_per_seq: duration(&at("timing.decode_per_seq"), &t.decode_per_seq)?,
            block_size: t.block_size,
            ..Timing::default()
        })
    };
    let price = match (c.price_per_hour, c.purchase_price, c.lifetime_years) {
        (Some(p), None, None) => Price::PerHour(non_negative(&at("price_per_hour"), p)?),
        (None, Some(p), Some(y)) => Price::Purchase {
            price: non_negative(&at("purchase_price"), p)?,
            lifetime_years: positive(&at("lifetime_years"), y)?,
        },
        _ => {
            return Err(invalid(
                &at("price"),
                "give `price_per_hour`, or `purchase_price` and `lifetime_years`",
            ))
        }
    };
    let power_watts = c
        .power_watts
        .map(|w| non_negative(&at("power_watts"), w))
        .transpose()?;
    Ok(Candidate {
        name: c.name.clone(),
        source,
        price,
        power_watts,
    })
}

fn non_negative(field: &str, v: f64) -> Result<f64, PlanError> {
    if v >= 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(invalid(field, "must be a number ≥ 0"))
    }
}
