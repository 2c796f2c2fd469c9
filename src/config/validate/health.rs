//! `[health]`: active probes, passive ejection, slow start and engine load signals.

use std::time::Duration;

use super::{at_least, duration, zero_ok_duration, Problems};
use crate::config::file::HealthSection;
use crate::config::runtime::HealthConfig;

pub(super) fn health(p: &mut Problems, h: &HealthSection) -> HealthConfig {
    let interval = duration(
        p,
        "health.interval",
        &h.interval,
        Duration::from_millis(1000),
    );
    let threshold = |p: &mut Problems, at: &str, v: Option<u32>, default: u32| {
        at_least(p, at, v.map(u64::from), default, 1)
    };
    let health = HealthConfig {
        interval,
        timeout: duration(p, "health.timeout", &h.timeout, Duration::from_millis(800)),
        healthy_threshold: threshold(p, "health.healthy_threshold", h.healthy_threshold, 2),
        unhealthy_threshold: threshold(p, "health.unhealthy_threshold", h.unhealthy_threshold, 2),
        eject_after_failures: threshold(
            p,
            "health.eject_after_failures",
            h.eject_after_failures,
            3,
        ),
        base_ejection: duration(
            p,
            "health.base_ejection",
            &h.base_ejection,
            Duration::from_secs(2),
        ),
        max_ejection: duration(
            p,
            "health.max_ejection",
            &h.max_ejection,
            Duration::from_secs(60),
        ),
        slow_start: zero_ok_duration(
            p,
            "health.slow_start",
            &h.slow_start,
            Duration::from_secs(5),
        ),
        overload_waiting: h.overload_waiting.unwrap_or(0),
        signals_interval: zero_ok_duration(
            p,
            "health.signals_interval",
            &h.signals_interval,
            interval,
        ),
        hang_factor: hang_factor(p, h.hang_factor),
        hang_grace: zero_ok_duration(
            p,
            "health.hang_grace",
            &h.hang_grace,
            Duration::from_secs(5),
        ),
    };
    // An ejection lasts base_ejection doubled per repeat, capped at max_ejection: a base above
    // the cap would be cut to it without a word.
    if health.base_ejection > health.max_ejection {
        p.push(
            "health.base_ejection",
            format!(
                "must not exceed health.max_ejection ({})",
                humantime::format_duration(health.max_ejection)
            ),
        );
    }
    health
}

/// Most a hang deadline may multiply the expected time by.
const MAX_HANG_FACTOR: f64 = 1000.0;

fn hang_factor(p: &mut Problems, v: Option<f64>) -> f64 {
    match v {
        None => 4.0,
        Some(f) if f == 0.0 || (1.0..=MAX_HANG_FACTOR).contains(&f) => f,
        Some(f) => {
            p.push(
                "health.hang_factor",
                format!("must be 0 (off) or between 1 and {MAX_HANG_FACTOR}, got {f}"),
            );
            4.0
        }
    }
}
