//! The answer as JSON, for programs.

use super::super::selfcheck::SelfCheck;
use super::super::Report;

/// The answer as JSON: the workload's size, the SLO, and per candidate the smallest count
/// meeting it (`null`: none within the limit), its cost per server-hour, its engine or why it
/// does not fit, and the figures of every fleet size evaluated (keyed by server count).
pub fn json(r: &Report) -> String {
    let candidates: Vec<serde_json::Value> = r
        .candidates
        .iter()
        .map(|c| {
            let engine = match &c.engine {
                Ok(e) => serde_json::json!({
                    "per_server": e.per_server,
                    "tp": e.tp,
                    "max_num_seqs": e.timing.max_num_seqs,
                    "kv_capacity_tokens": e.timing.kv_capacity_tokens,
                    "prefill_per_token_s": e.timing.prefill_per_token.as_secs_f64(),
                    "decode_base_s": e.timing.decode_base.as_secs_f64(),
                    "decode_per_seq_s": e.timing.decode_per_seq.as_secs_f64(),
                }),
                Err(why) => serde_json::json!({ "does_not_fit": why }),
            };
            serde_json::json!({
                "name": c.name,
                "engine": engine,
                "smallest": c.curve.smallest,
                "server_cost_per_hour": c.server_cost_per_hour,
                "fit": c.fit,
                "points": c.curve.points,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "requests": r.requests,
        "duration_s": r.duration_s,
        "slo": {
            "ttft_p99_s": r.slo.ttft_p99,
            "tpot_p99_s": r.slo.tpot_p99,
            "max_queue_wait_s": r.slo.max_queue_wait,
        },
        "cheapest": r.cheapest.map(|i| r.candidates[i].name.clone()),
        "candidates": candidates,
        "self_check": r.self_check,
        "self_check_flagged": r.self_check.as_ref().is_some_and(SelfCheck::flagged),
        "self_check_missing": r.self_check_missing,
    });
    let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    text.push('\n');
    text
}
