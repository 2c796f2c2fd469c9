//! The gateway-side wait queue: when every candidate backend of a request is at its concurrency
//! cap (configured `max_concurrent`, or learned from TGI `/info`), the request waits here
//! instead of stampeding an overloaded engine.
//!
//! Fairness: start-time fair queueing by tenant. Each waiter gets a virtual tag
//! `max(vtime, tenant's last tag) + 1 / weight`; a freed slot wakes the waiter with the smallest
//! tag, and `vtime` moves to that tag. A tenant that floods the queue therefore only delays its
//! own requests: another tenant's first request is tagged near `vtime` and goes next.
//!
//! Invariants: the queue never holds more than `size` waiters (the next one is refused at once);
//! every wait ends by its deadline; a waiter that gives up (deadline, client gone) leaves the
//! queue when its [`Ticket`] is dropped. Being woken is a hint, not a reservation: the woken
//! request routes again and may wait again (keeping its tag, so it stays at the front).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

/// Why a request could not wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("the wait queue is full")]
    Full,
    #[error("no backend slot freed up within the queue timeout")]
    Timeout,
}

/// A virtual finish time, totally ordered (`f64::total_cmp`) so it can key a `BTreeMap`.
#[derive(Debug, Clone, Copy)]
struct Tag(f64);
impl PartialEq for Tag {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Tag {}
impl PartialOrd for Tag {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Tag {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Default)]
struct Inner {
    vtime: f64,
    /// Tenant → tag of its last queued request.
    last_tag: HashMap<String, f64>,
    waiters: BTreeMap<(Tag, u64), oneshot::Sender<()>>,
    seq: u64,
}

/// The wait queue of one gateway (outlives reloads).
#[derive(Debug, Default)]
pub struct WaitQueue {
    inner: Mutex<Inner>,
    len: AtomicUsize,
}

/// A place in the queue; dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<WaitQueue>,
    key: Option<(Tag, u64)>,
    tag: f64,
    rx: Option<oneshot::Receiver<()>>,
}

impl WaitQueue {
    pub fn new() -> Arc<WaitQueue> {
        Arc::new(WaitQueue::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Take a place for `tenant` (weight ≥ 1 means a larger share), unless `size` are waiting.
    pub fn enter(
        self: &Arc<Self>,
        tenant: &str,
        weight: f64,
        size: usize,
    ) -> Result<Ticket, QueueError> {
        let mut inner = self.lock();
        if inner.waiters.len() >= size {
            return Err(QueueError::Full);
        }
        let last = inner.last_tag.get(tenant).copied().unwrap_or(0.0);
        let tag = inner.vtime.max(last) + 1.0 / weight.max(0.001);
        inner.last_tag.insert(tenant.to_string(), tag);
        if inner.last_tag.len() > 4096 {
            let vtime = inner.vtime;
            inner.last_tag.retain(|_, t| *t > vtime);
        }
        drop(inner);
        let mut t = Ticket {
            queue: self.clone(),
            key: None,
            tag,
            rx: None,
        };
        self.park(&mut t);
        Ok(t)
    }

    fn park(&self, t: &mut Ticket) {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.lock();
        inner.seq += 1;
        let key = (Tag(t.tag), inner.seq);
        inner.waiters.insert(key, tx);
        self.len.store(inner.waiters.len(), Ordering::Relaxed);
        t.key = Some(key);
        t.rx = Some(rx);
    }

    /// A slot was freed somewhere: wake the waiter with the smallest tag.
    pub fn slot_freed(&self) {
        if self.is_empty() {
            return;
        }
        let mut inner = self.lock();
        while let Some(((tag, _), tx)) = inner.waiters.pop_first() {
            inner.vtime = inner.vtime.max(tag.0);
            if tx.send(()).is_ok() {
                break;
            }
        }
        self.len.store(inner.waiters.len(), Ordering::Relaxed);
    }

    fn leave(&self, key: (Tag, u64)) {
        let mut inner = self.lock();
        inner.waiters.remove(&key);
        self.len.store(inner.waiters.len(), Ordering::Relaxed);
    }
}

impl Ticket {
    /// Wait until woken, or `recheck` passes (so health changes are noticed too), or the
    /// deadline. `Ok(())` means "route again".
    pub async fn wait(&mut self, deadline: Instant, recheck: Duration) -> Result<(), QueueError> {
        if self.rx.is_none() {
            let q = self.queue.clone();
            q.park(self);
        }
        let Some(rx) = self.rx.as_mut() else {
            return Err(QueueError::Timeout);
        };
        let until = deadline.min(Instant::now() + recheck);
        let woken = tokio::time::timeout_at(until, rx).await;
        if let Ok(Ok(())) = woken {
            // Popped by `slot_freed`: no longer in the queue.
            self.key = None;
            self.rx = None;
        }
        if Instant::now() >= deadline {
            return Err(QueueError::Timeout);
        }
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.queue.leave(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wakes_in_fair_order_across_tenants() {
        let q = WaitQueue::new();
        // tenant a floods first, then b arrives
        let mut a: Vec<Ticket> = (0..5).map(|_| q.enter("a", 1.0, 100).unwrap()).collect();
        let mut b = q.enter("b", 1.0, 100).unwrap();
        assert_eq!(q.len(), 6);
        q.slot_freed(); // a's first (tag 1)
        q.slot_freed(); // b's first (tag 1, later seq) before a's second (tag 2)
        let far = Instant::now() + Duration::from_secs(5);
        assert!(a[0].wait(far, Duration::from_secs(1)).await.is_ok());
        assert!(b.wait(far, Duration::from_secs(1)).await.is_ok());
        assert_eq!(q.len(), 4);
        // the others of a are still parked
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(
            a[1].wait(soon, Duration::from_secs(1)).await,
            Err(QueueError::Timeout)
        );
        drop(a);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn bounded() {
        let q = WaitQueue::new();
        let _t = q.enter("a", 1.0, 1).unwrap();
        assert_eq!(q.enter("b", 1.0, 1).unwrap_err(), QueueError::Full);
    }

    #[test]
    fn weight_gives_a_larger_share() {
        let q = WaitQueue::new();
        let heavy: Vec<Ticket> = (0..4).map(|_| q.enter("h", 2.0, 100).unwrap()).collect();
        let light: Vec<Ticket> = (0..2).map(|_| q.enter("l", 1.0, 100).unwrap()).collect();
        // tags: h 0.5 1 1.5 2, l 1 2 → order h h l h h l (ties by arrival)
        let tags: Vec<f64> = {
            let inner = q.lock();
            inner.waiters.keys().map(|(t, _)| t.0).collect()
        };
        assert_eq!(tags, vec![0.5, 1.0, 1.0, 1.5, 2.0, 2.0]);
        drop((heavy, light));
    }
}
