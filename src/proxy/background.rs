//! Background responses reconciled: a create with `background: true` is answered at once
//! (`queued`/`in_progress`, no usage), so its token reservation cannot be reconciled when the
//! request ends. The gateway that created it follows the response on its holder instead, and
//! reconciles the reservation and the usage accounting with the real usage once it is final.
//!
//! Invariants:
//! - The request's limits hook runs exactly once: at the end of the request for every answer
//!   that is final, or by the follower for a pending one — with the real usage when the
//!   response ends with one, else keeping the reservation as the charge (a cancelled, failed
//!   or lost response, or one still running when the follow gives up: cancelling is not a way
//!   around token limits). Dropping the follower (shutdown) also keeps the reservation.
//! - The follow is bounded: at most [`MAX_POLLS`] `GET`s, spaced from [`FIRST_POLL`] doubling
//!   to [`MAX_GAP`], for at most [`FOLLOW_FOR`]; each `GET` within the backend's response
//!   timeout. It runs on the gateway's control runtime, not on a serving thread.
//! - Nothing is persisted: a gateway that restarts forgets what it was following; those
//!   reservations were in its own memory (local limits) or expire with their window (shared
//!   limits), and the responses' tokens are not added to usage.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::BodyExt;

use crate::api::{ClientApi, Usage};
use crate::fleet::Backend;
use crate::settle::{Outcome, SettleHook};

/// The first poll comes this long after the create's answer.
pub const FIRST_POLL: Duration = Duration::from_millis(200);
/// Polls are spaced at most this far apart.
pub const MAX_GAP: Duration = Duration::from_secs(5);
/// Most polls of one response.
pub const MAX_POLLS: u32 = 1000;
/// Longest follow of one response.
pub const FOLLOW_FOR: Duration = Duration::from_secs(3600);
/// Largest status body read.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// What following one response needs.
pub struct Follow {
    pub api: &'static dyn ClientApi,
    pub backend: Arc<Backend>,
    pub tenant: String,
    pub model: String,
    pub main: tokio::runtime::Handle,
}

/// The request's limits hook: run at once for a final answer, handed to a follower for a
/// pending one.
pub fn settle_or_follow(hook: SettleHook, follow: Follow) -> SettleHook {
    Box::new(move |outcome: &Outcome| match &outcome.pending {
        None => hook(outcome),
        Some(id) => {
            let pending = Pending {
                hook: Some(hook),
                elapsed: outcome.elapsed,
            };
            let id = id.clone();
            let main = follow.main.clone();
            main.spawn(run(follow, id, pending));
        }
    })
}

/// The limits hook of a pending response: runs exactly once, with the real usage when it is
/// known, else (dropped) keeping the reservation.
struct Pending {
    hook: Option<SettleHook>,
    elapsed: Duration,
}

impl Pending {
    fn settle(mut self, usage: Option<Usage>) {
        if let Some(hook) = self.hook.take() {
            hook(&Outcome {
                usage,
                complete: true, // without usage: the reservation is kept
                ttft: None,
                elapsed: self.elapsed,
                pending: None,
                continued: false,
                queue_seen: false,
                finish: None,
            });
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(hook) = self.hook.take() {
            hook(&Outcome {
                usage: None,
                complete: true,
                ttft: None,
                elapsed: self.elapsed,
                pending: None,
                continued: false,
                queue_seen: false,
                finish: None,
            });
        }
    }
}

/// Where one poll left the response.
enum Polled {
    /// Still queued or running (or the poll failed): ask again.
    Running,
    /// Final, with its usage if it has one.
    Final(Option<Usage>),
    /// The holder no longer has it.
    Lost,
}

async fn run(f: Follow, id: String, pending: Pending) {
    let started = tokio::time::Instant::now();
    let mut gap = FIRST_POLL;
    for poll in 1..=MAX_POLLS {
        tokio::time::sleep(gap).await;
        gap = (gap * 2).min(MAX_GAP);
        match poll_once(&f, &id).await {
            Polled::Running => {}
            Polled::Final(usage) => {
                if let Some(u) = usage {
                    crate::telemetry::access::count_tokens(
                        f.api.label(),
                        &f.model,
                        &f.tenant,
                        f.backend.name(),
                        u.prompt_tokens,
                        u.completion_tokens,
                    );
                }
                tracing::debug!(
                    backend = f.backend.name(),
                    id,
                    poll,
                    "background response reconciled"
                );
                pending.settle(usage);
                return;
            }
            Polled::Lost => {
                tracing::warn!(
                    backend = f.backend.name(),
                    id,
                    "background response lost by its holder; its reservation is kept"
                );
                return;
            }
        }
        if started.elapsed() >= FOLLOW_FOR {
            break;
        }
    }
    tracing::warn!(
        backend = f.backend.name(),
        id,
        "background response still running when the follow ended; its reservation is kept"
    );
}

/// One `GET` of the response on its holder.
async fn poll_once(f: &Follow, id: &str) -> Polled {
    let path = format!("{}/{id}", f.api.path());
    let mut headers = HeaderMap::new();
    if let Some(key) = f.backend.config.api_key.as_deref() {
        if let Ok(mut v) = http::HeaderValue::from_str(&format!("Bearer {key}")) {
            v.set_sensitive(true);
            headers.insert(http::header::AUTHORIZATION, v);
        }
    }
    let timeout = f.backend.config.timeouts.response;
    let sent = crate::upstream::send_method(
        f.backend.as_ref(),
        Method::GET,
        &path,
        headers,
        Bytes::new(),
        timeout,
    )
    .await;
    let Ok(resp) = sent else {
        return Polled::Running;
    };
    match resp.status() {
        StatusCode::NOT_FOUND => return Polled::Lost,
        s if !s.is_success() => return Polled::Running,
        _ => {}
    }
    let body = http_body_util::Limited::new(resp.into_body(), MAX_BODY);
    let Ok(Ok(body)) = tokio::time::timeout(timeout, body.collect()).await else {
        return Polled::Running;
    };
    let body = body.to_bytes();
    if f.api.pending(&body).is_some() {
        return Polled::Running;
    }
    Polled::Final(f.api.whole_usage(&body).ok().flatten())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// The outcomes a hook was run with: usage and completeness.
    type Log = Arc<Mutex<Vec<(Option<Usage>, bool)>>>;

    /// A hook that records every outcome it is run with.
    fn recording() -> (SettleHook, Log) {
        let seen: Log = Arc::default();
        let log = seen.clone();
        let hook: SettleHook = Box::new(move |o: &Outcome| {
            log.lock().unwrap().push((o.usage, o.complete));
        });
        (hook, seen)
    }

    #[test]
    fn the_hook_runs_once_with_the_real_usage() {
        let (hook, seen) = recording();
        let u = Usage {
            prompt_tokens: 5,
            completion_tokens: 30,
            cached_tokens: None,
        };
        let p = Pending {
            hook: Some(hook),
            elapsed: Duration::ZERO,
        };
        p.settle(Some(u));
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0.map(|u| u.completion_tokens), Some(30));
    }

    #[test]
    fn a_dropped_follow_keeps_the_reservation_once() {
        let (hook, seen) = recording();
        drop(Pending {
            hook: Some(hook),
            elapsed: Duration::ZERO,
        });
        // usage None with complete = true: the limits keep what was reserved
        assert_eq!(seen.lock().unwrap().as_slice(), &[(None, true)]);
    }
}
