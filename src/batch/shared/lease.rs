//! Leases on a batch's pieces of work in Redis: a key per chunk of lines (and one for the
//! batch's finalization), holding the token of the replica that works on it, with a TTL the
//! holder renews while it works. A replica that dies stops renewing; its lease expires and
//! another replica takes the work over.
//!
//! Keys: `sluice:v1:batch:<batch id>:<chunk number or "final">`. Renewal and release check the
//! token in one script, so a replica never extends or frees a lease another one has taken.
//!
//! A lease only shares the work out: it is not what keeps each line's result once. A replica
//! that lost its lease without noticing (a long pause) may finish the same chunk; the
//! folder's commit keeps whichever copy came first ([`super::folder`]).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use thiserror::Error;

/// Deadline of one Redis call.
const CALL_TIMEOUT: Duration = Duration::from_millis(500);

/// The first of KEYS nobody holds, taken: its 1-based index, or 0. One call for a batch's
/// chunks, however many other replicas hold.
const TAKE_FIRST: &str = r#"
for i, k in ipairs(KEYS) do
  if redis.call('SET', k, ARGV[1], 'NX', 'PX', ARGV[2]) then
    return i
  end
end
return 0
"#;

const RENEW: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#;

const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

#[derive(Debug, Error)]
pub enum LeaseError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

/// This replica's leases.
pub struct Leases {
    client: redis::Client,
    conn: tokio::sync::Mutex<Option<ConnectionManager>>,
    /// This replica's token (the value of the keys it holds).
    token: String,
    ttl: Duration,
    take_first: Script,
    renew: Script,
    release: Script,
}

/// The key of one piece of a batch's work.
pub fn key(batch: &str, piece: &str) -> String {
    format!("sluice:v1:batch:{batch}:{piece}")
}

impl Leases {
    pub fn new(url: &str, token: String, ttl: Duration) -> Result<Leases, LeaseError> {
        Ok(Leases {
            client: redis::Client::open(url)?,
            conn: tokio::sync::Mutex::new(None),
            token,
            ttl,
            take_first: Script::new(TAKE_FIRST),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
        })
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    async fn connection(&self) -> Result<ConnectionManager, LeaseError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CALL_TIMEOUT)
            .set_response_timeout(CALL_TIMEOUT)
            .set_number_of_retries(1)
            .set_max_delay(200);
        let made = tokio::time::timeout(
            CALL_TIMEOUT * 2,
            ConnectionManager::new_with_config(self.client.clone(), config),
        )
        .await
        .map_err(|_| LeaseError::Timeout(CALL_TIMEOUT * 2))??;
        *slot = Some(made.clone());
        Ok(made)
    }

    async fn script(&self, s: &Script, key: &str) -> Result<bool, LeaseError> {
        let mut conn = self.connection().await?;
        let ttl = self.ttl.as_millis() as u64;
        let mut inv = s.key(key);
        inv.arg(&self.token).arg(ttl);
        let n: i64 = tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| LeaseError::Timeout(CALL_TIMEOUT))??;
        Ok(n == 1)
    }

    /// Take the first of `keys` nobody holds: its index, `None` when all are held.
    pub async fn take_first(&self, keys: &[String]) -> Result<Option<usize>, LeaseError> {
        if keys.is_empty() {
            return Ok(None);
        }
        let mut conn = self.connection().await?;
        let mut inv = self.take_first.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg(&self.token).arg(self.ttl.as_millis() as u64);
        let i: i64 = tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| LeaseError::Timeout(CALL_TIMEOUT))??;
        Ok(usize::try_from(i).ok().and_then(|i| i.checked_sub(1)))
    }

    /// Extend a lease this replica holds: `false` when it no longer does.
    pub async fn renew(&self, key: &str) -> Result<bool, LeaseError> {
        self.script(&self.renew, key).await
    }

    /// Let a lease go (only if this replica still holds it).
    pub async fn release(&self, key: &str) -> Result<(), LeaseError> {
        self.script(&self.release, key).await.map(|_| ())
    }
}
