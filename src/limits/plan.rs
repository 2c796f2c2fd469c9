//! What one request is checked against: the list of [`Check`]s built from a key's limits, its
//! tenant's team limits and the `[limits]` defaults, and the calendar arithmetic of budgets.
//!
//! Both stores ([`super::local`] and [`super::shared`]) evaluate the same list with the same
//! arithmetic, all checks at once: a request is admitted only if every check passes, and only
//! then is anything taken (all or nothing).

use std::sync::{Arc, LazyLock};

use crate::config::validate::LimitSet;
use crate::telemetry::handles::LabelCache;

/// What a check limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Requests per window (cost 1).
    Requests,
    /// Tokens per window (cost = the reservation).
    Tokens,
    /// Requests in flight.
    Concurrency,
    /// Tokens per UTC day.
    Daily,
    /// Tokens per UTC calendar month.
    Monthly,
}

impl Kind {
    /// Metric label and storage-key suffix.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
            Kind::Concurrency => "concurrency",
            Kind::Daily => "daily_tokens",
            Kind::Monthly => "monthly_tokens",
        }
    }

    /// The one-letter code the Lua scripts switch on.
    pub fn code(self) -> &'static str {
        match self {
            Kind::Requests | Kind::Tokens => "r",
            Kind::Concurrency => "c",
            Kind::Daily => "d",
            Kind::Monthly => "m",
        }
    }

    /// Whether the check's cost is the token reservation (and is reconciled at the end).
    pub fn counts_tokens(self) -> bool {
        matches!(self, Kind::Tokens | Kind::Daily | Kind::Monthly)
    }
}

/// Whose limit a check is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Key,
    Tenant,
}

impl Scope {
    pub fn label(self) -> &'static str {
        match self {
            Scope::Key => "key",
            Scope::Tenant => "tenant",
        }
    }
}

/// One limit one request must fit in.
#[derive(Debug, Clone)]
pub struct Check {
    /// Storage id, unique per scope, name and kind (e.g. `key:alice:requests`).
    pub id: Arc<str>,
    pub scope: Scope,
    /// The key's or tenant's name.
    pub name: Arc<str>,
    pub kind: Kind,
    pub limit: u64,
    pub cost: u64,
}

/// The state of one check after evaluation (taken or not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckState {
    /// What would remain (admitted: after this request; refused: now).
    pub remaining: u64,
    /// Milliseconds until the limit is back to full (rates) or the period ends (budgets).
    pub reset_ms: u64,
    /// Used before this request (rates: rounded up).
    pub used: u64,
    /// The budget period the request fell in (day or month number; 0 for others).
    pub period: i64,
}

/// The outcome of evaluating all checks of a request.
#[derive(Debug, Clone, Default)]
pub struct Decision {
    pub states: Vec<CheckState>,
    /// The first check that refused, and how long to wait before it could pass.
    pub refused: Option<(usize, Option<u64>)>,
}

/// Build the checks of one request.
pub fn checks(
    key: &str,
    key_limits: LimitSet,
    tenant: &str,
    tenant_limits: Option<LimitSet>,
    tokens: u64,
) -> Vec<Check> {
    let mut out = Vec::new();
    push_scope(&mut out, Scope::Key, key, key_limits, tokens);
    if let Some(t) = tenant_limits {
        push_scope(&mut out, Scope::Tenant, tenant, t, tokens);
    }
    out
}

/// (id, name) of each check, made once per scope, name and kind.
static CHECK_IDS: LazyLock<LabelCache<3, (Arc<str>, Arc<str>)>> =
    LazyLock::new(LabelCache::default);

fn push_scope(out: &mut Vec<Check>, scope: Scope, name: &str, l: LimitSet, tokens: u64) {
    let mut push = |kind: Kind, limit: Option<u64>, cost: u64| {
        if let Some(limit) = limit {
            let (id, name) = CHECK_IDS.get([scope.label(), name, kind.label()], || {
                (
                    Arc::from(format!("{}:{}:{}", scope.label(), name, kind.label())),
                    Arc::from(name),
                )
            });
            out.push(Check {
                id,
                scope,
                name,
                kind,
                limit,
                cost,
            });
        }
    };
    push(Kind::Concurrency, l.max_concurrent.map(u64::from), 1);
    push(Kind::Tokens, l.tokens_per_minute, tokens);
    push(Kind::Daily, l.daily_tokens, tokens);
    push(Kind::Monthly, l.monthly_tokens, tokens);
    push(Kind::Requests, l.requests_per_minute.map(u64::from), 1);
}

pub const DAY_MS: i64 = 86_400_000;

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31) (H. Hinnant's `civil_from_days`).
pub fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) → days since 1970-01-01 (`days_from_civil`).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The budget period containing `now_ms` and when it ends (ms since the epoch).
pub fn period(kind: Kind, now_ms: i64) -> (i64, i64) {
    let day = now_ms.div_euclid(DAY_MS);
    match kind {
        Kind::Monthly => {
            let (y, m, _) = civil_from_days(day);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            (y * 12 + m - 1, days_from_civil(ny, nm, 1) * DAY_MS)
        }
        _ => (day, (day + 1) * DAY_MS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar_round_trips() {
        for z in [-1000, 0, 59, 60, 10_957, 19_782, 20_000, 40_000] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        // 2024-02-29
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }

    #[test]
    fn month_period_ends_at_next_month() {
        let now = days_from_civil(2024, 2, 10) * DAY_MS + 5;
        let (id, end) = period(Kind::Monthly, now);
        assert_eq!(id, 2024 * 12 + 1);
        assert_eq!(end, days_from_civil(2024, 3, 1) * DAY_MS);
        let (_, end) = period(Kind::Monthly, days_from_civil(2024, 12, 31) * DAY_MS);
        assert_eq!(end, days_from_civil(2025, 1, 1) * DAY_MS);
        let (d, end) = period(Kind::Daily, DAY_MS * 3 + 7);
        assert_eq!((d, end), (3, DAY_MS * 4));
    }

    #[test]
    fn checks_only_for_set_limits() {
        let key = LimitSet {
            requests_per_minute: Some(5),
            ..LimitSet::default()
        };
        let team = LimitSet {
            tokens_per_minute: Some(100),
            max_concurrent: Some(2),
            ..LimitSet::default()
        };
        let c = checks("alice", key, "team", Some(team), 40);
        let ids: Vec<_> = c.iter().map(|c| &*c.id).collect();
        assert_eq!(
            ids,
            [
                "key:alice:requests",
                "tenant:team:concurrency",
                "tenant:team:tokens"
            ]
        );
        assert_eq!(c[2].cost, 40);
    }
}
