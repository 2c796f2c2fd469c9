//! Limits shared by every gateway replica through Redis: the same checks and arithmetic as
//! [`super::local`], run by two Lua scripts so that one request's checks are evaluated and taken
//! atomically on the Redis server, with the server's clock (`TIME`), never a replica's.
//!
//! Storage (prefix `sluice:v1:`, the `v1` changes whenever a script's data layout does):
//! - rate meters: a hash `{u: units used, t: ms of last update}`, expiring once drained;
//! - concurrency: a sorted set of permit leases scored by their expiry. A running request's
//!   lease is renewed every third of its lifetime ([`RedisStore::renew`]), so a stream may run
//!   for hours, while a replica that dies mid-request frees its slots one lifetime later
//!   (`[limits] concurrency_lease`, default [`DEFAULT_LEASE_TTL`]);
//! - budgets: `<id>:<day or month number>` holding the tokens used, expiring after the period.
//!
//! Failure: every call has a short deadline. After a failure the store is skipped for
//! [`RETRY_AFTER_FAILURE`] (no request waits on a dead Redis), and the caller applies
//! `[limits] fail_open`: enforce the limits per replica from local state, or refuse with 503.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

use super::plan::{Check, CheckState, Decision, Kind};

/// How long a concurrency slot survives a replica that stopped renewing it.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5 * 60);
/// Deadline of one Redis call (connect or script).
pub const CALL_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failure, Redis is not tried again for this long.
pub const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);

const KEY_PREFIX: &str = "sluice:v1:";

const CALENDAR: &str = r#"
local DAY = 86400000
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  return y, m
end
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
local function period(kind, ms)
  local day = math.floor(ms / DAY)
  if kind == 'm' then
    local y, m = civil_from_days(day)
    local ny, nm = y, m + 1
    if m == 12 then ny, nm = y + 1, 1 end
    return y * 12 + m - 1, days_from_civil(ny, nm, 1) * DAY
  end
  return day, (day + 1) * DAY
end
local function drained(k, now, limit, window)
  local h = redis.call('HMGET', k, 'u', 't')
  local u = tonumber(h[1]) or 0
  local at = tonumber(h[2]) or now
  local el = now - at
  if el < 0 then el = 0 end
  u = u - el * limit / window
  if u < 0 then u = 0 end
  return u
end
"#;

/// ARGV: window_ms, lease, lease_ttl_ms, then (kind, limit, cost) per KEYS entry.
/// Returns {refused index or 0, retry ms or -1, now ms, then (remaining, reset ms, used,
/// period) per check}.
const ADMIT: &str = r#"
-- sluice limits v1: admit
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local lease = ARGV[2]
local lease_ttl = tonumber(ARGV[3])
local out = {0, -1, now}
local refused, retry = 0, -1
local used_of, end_of = {}, {}
for i = 1, #KEYS do
  local b = 3 + (i - 1) * 3
  local kind, limit, cost = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local k = KEYS[i]
  local allowed, remaining, reset, used, per, r = false, 0, 0, 0, 0, -1
  if kind == 'r' then
    local u = drained(k, now, limit, window)
    local unit = window / limit
    allowed = cost <= limit and u + cost <= limit + 1e-9
    local shown = u
    if allowed then shown = u + cost end
    remaining = math.max(0, math.floor(limit - shown))
    reset = math.ceil(shown * unit)
    used = u
    if cost <= limit then r = math.max(1, math.ceil((u + cost - limit) * unit)) end
  elseif kind == 'c' then
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
    local c = redis.call('ZCARD', k)
    allowed = c < limit
    remaining = limit - c
    if allowed then remaining = remaining - 1 end
    if remaining < 0 then remaining = 0 end
    used = c
    r = 1000
  else
    local id, e = period(kind, now)
    per = id
    end_of[i] = e
    local u = tonumber(redis.call('GET', k .. ':' .. id)) or 0
    allowed = u + cost <= limit
    remaining = limit - u
    if allowed then remaining = remaining - cost end
    if remaining < 0 then remaining = 0 end
    reset = e - now
    used = u
    if cost <= limit then r = math.max(1, reset) end
  end
  if (not allowed) and refused == 0 then
    refused = i
    retry = r
  end
  used_of[i] = used
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = math.ceil(used)
  out[#out + 1] = per
end
out[1] = refused
out[2] = retry
if refused == 0 then
  for i = 1, #KEYS do
    local b = 3 + (i - 1) * 3
    local kind, limit, cost = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
    local k = KEYS[i]
    if kind == 'r' then
      local u = used_of[i] + cost
      redis.call('HSET', k, 'u', u, 't', now)
      redis.call('PEXPIRE', k, math.ceil(u * window / limit) + 1000)
    elseif kind == 'c' then
      redis.call('ZADD', k, now + lease_ttl, lease)
      if redis.call('PTTL', k) < lease_ttl + 1000 then
        redis.call('PEXPIRE', k, lease_ttl + 1000)
      end
    else
      local id = out[3 + (i - 1) * 4 + 4]
      redis.call('SET', k .. ':' .. id, used_of[i] + cost, 'PX', end_of[i] - now + DAY)
    end
  end
end
return out
"#;

/// KEYS: concurrency keys. ARGV: lease, lease_ttl_ms. Extends the lease where it still exists
/// (a lease already expired and swept is not brought back). Returns how many were extended.
const RENEW: &str = r#"
-- sluice limits v1: renew
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = ARGV[1]
local lease_ttl = tonumber(ARGV[2])
local n = 0
for i = 1, #KEYS do
  local k = KEYS[i]
  if redis.call('ZSCORE', k, lease) then
    redis.call('ZADD', k, 'XX', now + lease_ttl, lease)
    if redis.call('PTTL', k) < lease_ttl + 1000 then
      redis.call('PEXPIRE', k, lease_ttl + 1000)
    end
    n = n + 1
  end
end
return n
"#;

/// KEYS: state keys (budgets with their period suffix). ARGV: window_ms, lease, delta, then
/// (kind, limit) per KEYS entry.
const SETTLE: &str = r#"
-- sluice limits v1: settle
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local lease = ARGV[2]
local delta = tonumber(ARGV[3])
for i = 1, #KEYS do
  local kind, limit = ARGV[3 + (i - 1) * 2 + 1], tonumber(ARGV[3 + (i - 1) * 2 + 2])
  local k = KEYS[i]
  if kind == 'r' then
    if delta ~= 0 then
      local u = drained(k, now, limit, window) + delta
      if u < 0 then u = 0 end
      redis.call('HSET', k, 'u', u, 't', now)
      redis.call('PEXPIRE', k, math.ceil(u * window / limit) + 1000)
    end
  elseif kind == 'c' then
    redis.call('ZREM', k, lease)
  else
    local u = tonumber(redis.call('GET', k))
    if u then
      u = u + delta
      if u < 0 then u = 0 end
      redis.call('SET', k, u, 'KEEPTTL')
    end
  end
end
return 1
"#;

/// Why the shared store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis failed recently; not retried yet")]
    Resting,
    #[error("unexpected reply from the limits script")]
    BadReply,
    #[error("no runtime to reach Redis from")]
    NoRuntime,
}

/// The Redis-backed store of one gateway process.
pub struct RedisStore {
    url: String,
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<ConnectionManager>>,
    rest_until_ms: AtomicU64,
    lease_ttl: Duration,
    admit: Script,
    settle: Script,
    renew: Script,
    /// The runtime the store was made on (the control runtime): its Redis connection, lease
    /// renewals and settlements run there, not on the shard that served the request, so they
    /// outlive any one shard at shutdown (see `crate::server::shards`).
    background: Option<tokio::runtime::Handle>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").finish_non_exhaustive()
    }
}

/// The result of a shared admission.
#[derive(Debug, Clone)]
pub struct SharedDecision {
    pub decision: Decision,
    /// Redis server time of the decision, ms since the epoch.
    pub now_ms: i64,
}

impl RedisStore {
    /// A store for `url` whose concurrency leases live `lease_ttl` unless renewed (no
    /// connection is made until the first request).
    pub fn new(url: &str, lease_ttl: Duration) -> Result<RedisStore, SharedError> {
        Ok(RedisStore {
            url: url.to_string(),
            client: redis::Client::open(url)?,
            conn: tokio::sync::Mutex::new(None),
            rest_until_ms: AtomicU64::new(0),
            lease_ttl,
            admit: Script::new(&format!("{CALENDAR}{ADMIT}")),
            settle: Script::new(&format!("{CALENDAR}{SETTLE}")),
            renew: Script::new(RENEW),
            background: tokio::runtime::Handle::try_current().ok(),
        })
    }

    /// Run `task` on the store's runtime (the current one if it was made outside any); `None`
    /// outside every runtime.
    pub(super) fn spawn<F>(&self, task: F) -> Option<tokio::task::JoinHandle<F::Output>>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.background {
            Some(h) => Some(h.spawn(task)),
            None => Some(tokio::runtime::Handle::try_current().ok()?.spawn(task)),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    fn resting(&self) -> bool {
        super::unix_ms() < self.rest_until_ms.load(Ordering::Relaxed) as f64
    }

    fn failed(&self) {
        let until = super::unix_ms() as u64 + RETRY_AFTER_FAILURE.as_millis() as u64;
        self.rest_until_ms.store(until, Ordering::Relaxed);
        metrics::counter!(crate::telemetry::metrics::RATELIMIT_REDIS_ERRORS_TOTAL).increment(1);
    }

    async fn connection(&self) -> Result<ConnectionManager, SharedError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CALL_TIMEOUT)
            .set_response_timeout(CALL_TIMEOUT)
            .set_number_of_retries(1)
            .set_max_delay(200);
        // Made on the store's runtime, so the connection's driver task lives there.
        let client = self.client.clone();
        let made = self
            .spawn(async move {
                tokio::time::timeout(
                    CALL_TIMEOUT * 2,
                    ConnectionManager::new_with_config(client, config),
                )
                .await
            })
            .ok_or(SharedError::NoRuntime)?
            .await
            .map_err(|_| SharedError::NoRuntime)?;
        let c = made.map_err(|_| SharedError::Timeout(CALL_TIMEOUT * 2))??;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, SharedError> {
        if self.resting() {
            return Err(SharedError::Resting);
        }
        let result = async {
            let mut conn = self.connection().await?;
            tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async::<T>(&mut conn))
                .await
                .map_err(|_| SharedError::Timeout(CALL_TIMEOUT))?
                .map_err(SharedError::from)
        }
        .await;
        if result.is_err() {
            self.failed();
        }
        result
    }

    /// Evaluate and (if all pass) take every check, atomically, on the Redis server.
    pub async fn admit(
        &self,
        checks: &[Check],
        window_ms: f64,
        lease: &str,
    ) -> Result<SharedDecision, SharedError> {
        let mut inv = self.admit.prepare_invoke();
        inv.arg(window_ms.round() as u64)
            .arg(lease)
            .arg(self.lease_ttl.as_millis() as u64);
        for c in checks {
            inv.key(format!("{KEY_PREFIX}{}", c.id))
                .arg(c.kind.code())
                .arg(c.limit)
                .arg(c.cost);
        }
        let reply: Vec<i64> = self.run(&inv).await?;
        parse_admit(&reply, checks.len())
    }

    /// Reconcile what an admitted request took (see [`super::local::LocalStore::settle`]).
    pub async fn settle(
        &self,
        checks: &[Check],
        periods: &[i64],
        delta: i64,
        window_ms: f64,
        lease: &str,
    ) -> Result<(), SharedError> {
        let mut inv = self.settle.prepare_invoke();
        inv.arg(window_ms.round() as u64).arg(lease).arg(delta);
        let mut any = false;
        for (i, c) in checks.iter().enumerate() {
            let key = match c.kind {
                Kind::Requests => continue,
                Kind::Tokens if delta == 0 => continue,
                Kind::Daily | Kind::Monthly if delta == 0 => continue,
                Kind::Daily | Kind::Monthly => {
                    format!(
                        "{KEY_PREFIX}{}:{}",
                        c.id,
                        periods.get(i).copied().unwrap_or(0)
                    )
                }
                _ => format!("{KEY_PREFIX}{}", c.id),
            };
            inv.key(key).arg(c.kind.code()).arg(c.limit);
            any = true;
        }
        if !any {
            return Ok(());
        }
        let _: i64 = self.run(&inv).await?;
        Ok(())
    }
}

impl RedisStore {
    /// Extend `lease` on every concurrency check of `checks` by another lease lifetime.
    /// Returns how many slots were still held (0: the lease expired, e.g. Redis was out of
    /// reach for longer than a lifetime).
    pub async fn renew(&self, checks: &[Check], lease: &str) -> Result<i64, SharedError> {
        let mut inv = self.renew.prepare_invoke();
        inv.arg(lease).arg(self.lease_ttl.as_millis() as u64);
        let mut any = false;
        for c in checks.iter().filter(|c| c.kind == Kind::Concurrency) {
            inv.key(format!("{KEY_PREFIX}{}", c.id));
            any = true;
        }
        if !any {
            return Ok(0);
        }
        self.run(&inv).await
    }
}

/// Keeps a running request's concurrency leases alive: renews them every third of their
/// lifetime until aborted (dropping the guard aborts it).
pub(super) struct Renewal(tokio::task::AbortHandle);

impl Renewal {
    /// `None` when no check is a concurrency check, or outside a runtime.
    pub(super) fn start(
        store: std::sync::Arc<RedisStore>,
        checks: &[Check],
        lease: &str,
    ) -> Option<Renewal> {
        let checks: Vec<Check> = checks
            .iter()
            .filter(|c| c.kind == Kind::Concurrency)
            .cloned()
            .collect();
        if checks.is_empty() {
            return None;
        }
        let lease = lease.to_string();
        let every = store.lease_ttl / 3;
        let renewing = store.clone();
        let task = renewing.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match store.renew(&checks, &lease).await {
                    Ok(0) => {
                        tracing::warn!("shared limits: a running request's concurrency lease had expired; its slot is no longer counted");
                        return;
                    }
                    Ok(_) => {}
                    // Retried at the next turn; the lease outlives two missed renewals.
                    Err(e) => tracing::debug!("shared limits: lease renewal failed: {e}"),
                }
            }
        })?;
        Some(Renewal(task.abort_handle()))
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn parse_admit(reply: &[i64], n: usize) -> Result<SharedDecision, SharedError> {
    if reply.len() != 3 + 4 * n {
        return Err(SharedError::BadReply);
    }
    let states = reply[3..]
        .chunks_exact(4)
        .map(|s| CheckState {
            remaining: s[0].max(0) as u64,
            reset_ms: s[1].max(0) as u64,
            used: s[2].max(0) as u64,
            period: s[3],
        })
        .collect();
    let refused = match reply[0] {
        0 => None,
        i if i >= 1 && (i as usize) <= n => {
            Some((i as usize - 1, (reply[1] >= 0).then_some(reply[1] as u64)))
        }
        _ => return Err(SharedError::BadReply),
    };
    Ok(SharedDecision {
        decision: Decision { states, refused },
        now_ms: reply[2],
    })
}
