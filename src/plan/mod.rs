//! `sluice plan`: capacity planning. Given a workload (described or recorded), candidate
//! servers (specified by GPU and model through a roofline, measured by a live gateway, or given
//! as engine timing), an SLO and costs, it finds for each candidate the smallest fleet meeting
//! the SLO, its predicted latencies, utilisation and cost, the cheapest candidate and the N+1
//! answer (the fleet with one server down).
//!
//! # Module map
//! - [`fleet`]: the fleet in virtual time: the [`crate::batching`] engine model that
//!   `sluice sim` runs in real time, driven by an event queue, with every request routed by
//!   [`crate::routing`]'s own policies over real [`crate::fleet::Backend`]s.
//! - [`workload`]: described and recorded workloads, scaling, the trace record format.
//! - [`roofline`]: the accelerator catalogue and the roofline estimate of an engine.
//! - [`profile`]: measured profiles (`GET /admin/profile`) into engine timing.
//! - [`input`]: the plan file and its validation.
//! - [`trust`]: where a measured candidate's plan leaves what its profile knows.
//! - [`search`]: percentiles, SLO verdicts, the smallest-count search.
//! - [`selfcheck`]: a recorded trace replayed on its recorded fleet against what the gateway
//!   measured.
//! - [`report`]: the plain-text answer, the JSON answer and the self-contained HTML report.
//!
//! Invariant: the planner never re-implements the engine model or the routing policies; it
//! supplies a clock and the bookkeeping the proxy would do.

pub mod fleet;
pub mod input;
pub mod profile;
pub mod report;
pub mod roofline;
pub mod search;
pub mod selfcheck;
pub mod trust;
pub mod workload;

use input::{Candidate, PlanInput, Price, ServerSource, WorkloadSource};
use search::Curve;

use crate::batching::Timing;

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the plan file is not valid TOML for a plan: {0}")]
    Parse(String),
    #[error("invalid plan file: {0}")]
    Invalid(String),
    #[error("invalid trace: {0}")]
    Trace(String),
    #[error("invalid profile: {0}")]
    Profile(String),
    #[error("the workload has no requests")]
    EmptyWorkload,
}

/// The engine a candidate's servers run, and how many per server.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    pub timing: Timing,
    /// Engines per server (GPUs / tensor-parallel degree for specified servers).
    pub per_server: usize,
    /// Tensor-parallel degree (specified servers).
    pub tp: Option<u32>,
    /// Weight bytes (specified servers), for load times.
    pub weights_bytes: Option<f64>,
}

/// The answer for one candidate.
#[derive(Debug, Clone)]
pub struct CandidateReport {
    pub name: String,
    /// The engine, or why the model does not fit.
    pub engine: Result<EngineInfo, String>,
    pub curve: Curve,
    pub server_cost_per_hour: f64,
    pub power_watts: f64,
    /// For a measured candidate: how well its engine timing is known.
    pub fit: Option<profile::FitSummary>,
}

impl CandidateReport {
    /// Cost per hour of `n` servers.
    pub fn cost_per_hour(&self, n: usize) -> f64 {
        self.server_cost_per_hour * n as f64
    }

    /// Cost per million (prompt + completion) tokens at `n` servers.
    pub fn cost_per_million_tokens(&self, n: usize) -> Option<f64> {
        let st = self.curve.points.get(&n)?;
        (st.tokens_per_hour > 0.0).then(|| self.cost_per_hour(n) / (st.tokens_per_hour / 1e6))
    }
}

/// The whole answer.
#[derive(Debug, Clone)]
pub struct Report {
    pub requests: usize,
    pub duration_s: f64,
    pub slo: input::Slo,
    pub max_servers: usize,
    pub candidates: Vec<CandidateReport>,
    /// Index of the cheapest candidate meeting the SLO.
    pub cheapest: Option<usize>,
    /// The recorded traffic replayed on the recorded fleet (recorded workloads).
    pub self_check: Option<selfcheck::SelfCheck>,
    /// Why a recorded workload has no self-check.
    pub self_check_missing: Option<String>,
}

/// The requests of the plan's workload.
pub fn requests(input: &PlanInput) -> Result<Vec<fleet::Request>, PlanError> {
    load(input).map(|(reqs, _)| reqs)
}

/// The requests of the plan's workload and, for a recorded one, the trace as recorded
/// (unscaled, with what was measured).
fn load(input: &PlanInput) -> Result<(Vec<fleet::Request>, Option<workload::Recorded>), PlanError> {
    let (reqs, recorded) = match &input.workload {
        WorkloadSource::Described(d) => (d.generate(), None),
        WorkloadSource::Recorded {
            trace,
            scale,
            model,
            seed,
            ..
        } => {
            let text = std::fs::read_to_string(trace).map_err(|source| PlanError::Read {
                path: trace.display().to_string(),
                source,
            })?;
            let recorded = workload::read_recorded(&text, model.as_deref())?;
            let reqs = if *scale == 1.0 {
                recorded.requests.clone()
            } else {
                workload::scale(&recorded.requests, *scale, *seed)
            };
            (reqs, Some(recorded))
        }
    };
    if reqs.is_empty() {
        return Err(PlanError::EmptyWorkload);
    }
    Ok((reqs, recorded))
}

/// The engine of a candidate for this workload (`Err`: the model does not fit), and for a
/// measured one how well its timing is known.
pub fn engine(
    c: &Candidate,
    input: &PlanInput,
    reqs: &[fleet::Request],
) -> Result<(Result<EngineInfo, String>, Option<profile::FitSummary>), PlanError> {
    if let ServerSource::Measured {
        profile,
        backends,
        max_num_seqs,
    } = &c.source
    {
        let text = std::fs::read_to_string(profile).map_err(|source| PlanError::Read {
            path: profile.display().to_string(),
            source,
        })?;
        let (timing, fit) =
            profile::measured(&text, backends, *max_num_seqs).map_err(PlanError::Profile)?;
        let info = EngineInfo {
            timing,
            per_server: 1,
            tp: None,
            weights_bytes: None,
        };
        return Ok((Ok(info), Some(fit)));
    }
    modelled(c, input, reqs).map(|e| (e, None))
}

/// The engine of a candidate given by timing or specified by GPU.
fn modelled(
    c: &Candidate,
    input: &PlanInput,
    reqs: &[fleet::Request],
) -> Result<Result<EngineInfo, String>, PlanError> {
    match &c.source {
        ServerSource::Timing(t) => Ok(Ok(EngineInfo {
            timing: t.clone(),
            per_server: 1,
            tp: None,
            weights_bytes: None,
        })),
        ServerSource::Measured { .. } => Err(PlanError::Invalid(
            "a measured candidate's engine comes from its profile".into(),
        )),
        ServerSource::Specified {
            gpu,
            gpus,
            tp,
            max_num_seqs,
        } => {
            let Some(model) = &input.model else {
                return Err(PlanError::Invalid(
                    "a specified server needs [model]".into(),
                ));
            };
            let n = reqs.len() as f64;
            let ctx = reqs
                .iter()
                .map(|r| f64::from(r.prompt_tokens) + f64::from(r.output_tokens) / 2.0)
                .sum::<f64>()
                / n;
            let longest = reqs
                .iter()
                .map(|r| u64::from(r.prompt_tokens) + u64::from(r.output_tokens))
                .max()
                .unwrap_or(1);
            let est = match tp {
                Some(tp) => roofline::estimate(gpu, *tp, model, ctx, longest, *max_num_seqs),
                None => roofline::smallest_fit(gpu, *gpus, model, ctx, longest, *max_num_seqs),
            };
            Ok(est
                .map(|e| EngineInfo {
                    per_server: (*gpus / e.tp.max(1)).max(1) as usize,
                    tp: Some(e.tp),
                    weights_bytes: Some(e.weights_bytes),
                    timing: e.timing,
                })
                .map_err(|nf| {
                    format!(
                        "does not fit: needs {:.1} GB (weights and one longest request's KV), \
                         {} × {} at TP {} give {:.1} GB",
                        nf.need_bytes / 1e9,
                        gpus,
                        gpu.name,
                        nf.tp,
                        nf.usable_bytes / 1e9
                    )
                }))
        }
    }
}

/// Cost per server-hour and watts per server of a candidate.
fn costs(c: &Candidate, electricity_per_kwh: f64) -> (f64, f64) {
    let watts = c.power_watts.unwrap_or(match &c.source {
        ServerSource::Specified { gpu, gpus, .. } => gpu.watts * f64::from(*gpus),
        _ => 0.0,
    });
    let per_hour = match c.price {
        Price::PerHour(p) => p,
        Price::Purchase {
            price,
            lifetime_years,
        } => price / (lifetime_years * 8766.0) + watts / 1000.0 * electricity_per_kwh,
    };
    (per_hour, watts)
}

/// Plan: every candidate searched (in parallel, one thread each); `progress` hears each
/// evaluated fleet size.
pub fn plan(
    input: &PlanInput,
    progress: &(dyn Fn(&str, usize, &search::Stats) + Sync),
) -> Result<Report, PlanError> {
    let (reqs, recorded) = load(input)?;
    let mut engines = Vec::new();
    for c in &input.candidates {
        engines.push(engine(c, input, &reqs)?);
    }
    let check = recorded.map(|rec| {
        let over = match &input.workload {
            WorkloadSource::Recorded {
                recorded_servers, ..
            } => *recorded_servers,
            WorkloadSource::Described(_) => None,
        };
        let infos: Vec<&Result<EngineInfo, String>> = engines.iter().map(|(e, _)| e).collect();
        selfcheck::check(input, &rec, over, &infos)
    });
    let searched: Vec<(Curve, Option<profile::FitSummary>)> = std::thread::scope(|s| {
        let handles: Vec<_> = input
            .candidates
            .iter()
            .zip(&engines)
            .map(|(c, (e, fit))| {
                let reqs = &reqs;
                s.spawn(move || match e {
                    Ok(e) => {
                        let curve = search::smallest(
                            reqs,
                            &e.timing,
                            e.per_server,
                            input.max_servers,
                            &input.slo,
                            input.policy,
                            &mut |n, st| progress(&c.name, n, st),
                        );
                        let fit = fit.clone().map(|mut f| {
                            let check = trust::Check {
                                reqs,
                                timing: &e.timing,
                                per_server: e.per_server,
                                slo: &input.slo,
                                policy: input.policy,
                            };
                            trust::assess(&mut f, &curve, &check);
                            f
                        });
                        (curve, fit)
                    }
                    Err(_) => (Curve::default(), fit.clone()),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let candidates: Vec<CandidateReport> = input
        .candidates
        .iter()
        .zip(engines)
        .zip(searched)
        .map(|((c, (engine, _)), (curve, fit))| {
            let (server_cost_per_hour, power_watts) = costs(c, input.electricity_per_kwh);
            CandidateReport {
                name: c.name.clone(),
                engine,
                curve,
                server_cost_per_hour,
                power_watts,
                fit,
            }
        })
        .collect();
    let cheapest = candidates
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.curve.smallest.map(|n| (i, c.cost_per_hour(n))))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i);
    let first = reqs.first().map_or(0, |r| r.at_ns);
    let last = reqs.last().map_or(0, |r| r.at_ns);
    Ok(Report {
        requests: reqs.len(),
        duration_s: (last - first) as f64 / 1e9,
        slo: input.slo,
        max_servers: input.max_servers,
        candidates,
        cheapest,
        self_check_missing: check
            .as_ref()
            .and_then(|c| c.as_ref().err().map(ToString::to_string)),
        self_check: check.and_then(Result::ok),
    })
}
