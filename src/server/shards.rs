//! Data-path shards: the client listener's connections are served by N OS threads, each with
//! its own single-threaded tokio runtime (thread per core, as nginx's and Envoy's workers).
//!
//! The accept loop stays on the caller's runtime (admission, refusals and the TLS decision are
//! there, see [`super`]) and hands each admitted connection to the shard with the fewest open
//! connections. From then on everything that connection does runs on its shard: hyper's
//! connection task, every request's handler, and the backend connections those requests use,
//! because each shard draws from its own connection pool per backend
//! ([`crate::upstream::Pools`] picks it by [`crate::rt::current`]). A proxied request therefore
//! wakes no other thread: no work-stealing queues, no cross-core hand-off between the client
//! connection and the backend connection.
//!
//! Invariants:
//! - A connection is moved to its shard once, right after it is admitted; it never migrates.
//!   Its admission slot moves with it and is freed on that shard when the connection ends.
//! - [`current`] is 0 outside the shards (the control runtime: probes, scraping, reload, the
//!   admin listener), so their backend traffic uses the shared pool 0 and never a shard's.
//! - Shutdown: when the accept loop ends the shards stop receiving, keep serving what they have
//!   until those connections end (they follow the listener's [`Stage`]), and their threads
//!   exit; [`Closing::wait`] waits for that. Background work started by a request (a shared
//!   limit's settlement) is spawned on the control runtime, not a shard's (see
//!   [`crate::limits`]), so a shard ending first does not cut it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch, Notify};

use super::Stage;
pub(crate) use crate::rt::enter;
pub use crate::rt::{current, default_count};

/// What the accept loop hands a shard: run on the shard's runtime (so it may spawn there),
/// given the connection's [`Placement`].
pub type Job = Box<dyn FnOnce(Placement) + Send + 'static>;

/// One shard's count of open connections (also its `sluice_shard_connections_open`), and the
/// wake-up for its last one ending.
struct Load {
    open: AtomicUsize,
    idle: Notify,
    gauge: metrics::Gauge,
}

/// One shard as the accept loop sees it.
struct Shard {
    jobs: mpsc::UnboundedSender<Job>,
    load: Arc<Load>,
    done: oneshot::Receiver<()>,
}

/// The running shards of one listener.
pub struct Shards {
    shards: Vec<Shard>,
    next: usize,
}

/// Held by a connection's task on its shard: counts the connection in the shard's load until
/// it is dropped.
pub struct Placement {
    load: Arc<Load>,
}

impl Drop for Placement {
    fn drop(&mut self) {
        self.load.gauge.decrement(1.0);
        if self.load.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.load.idle.notify_one();
        }
    }
}

/// Why the shards could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("cannot start a shard's runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot start a shard thread: {0}")]
    Thread(std::io::Error),
}

impl Shards {
    /// Start `n` shard threads named `sluice-{listener}-N`. Each runs until the accept loop
    /// has let go of the [`Shards`] ([`Shards::close`]) and its last connection has ended, or
    /// the stage is [`Stage::Abort`].
    pub(super) fn start(
        n: usize,
        listener: &'static str,
        stage: &watch::Receiver<Stage>,
    ) -> Result<Shards, ShardError> {
        let mut shards = Vec::with_capacity(n);
        for i in 1..=n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(ShardError::Runtime)?;
            let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
            let (done_tx, done) = oneshot::channel();
            let gauge = metrics::gauge!(crate::telemetry::metrics::SHARD_CONNECTIONS_OPEN, "listener" => listener, "shard" => i.to_string());
            gauge.set(0.0);
            let load = Arc::new(Load {
                open: AtomicUsize::new(0),
                idle: Notify::new(),
                gauge,
            });
            let shard_load = load.clone();
            let mut stage = stage.clone();
            std::thread::Builder::new()
                .name(format!("sluice-{listener}-{i}"))
                .spawn(move || {
                    enter(i);
                    runtime.block_on(async move {
                        while let Some(job) = rx.recv().await {
                            job(Placement {
                                load: shard_load.clone(),
                            });
                        }
                        // No more connections come: serve those here until they end, or until
                        // the grace is over.
                        loop {
                            if shard_load.open.load(Ordering::Acquire) == 0 {
                                break;
                            }
                            tokio::select! {
                                () = shard_load.idle.notified() => {}
                                _ = stage.wait_for(|s| *s == Stage::Abort) => break,
                            }
                        }
                    });
                    // Whatever is left on the runtime (connections past the grace) is dropped
                    // with it.
                    drop(runtime);
                    let _ = done_tx.send(());
                })
                .map_err(ShardError::Thread)?;
            shards.push(Shard { jobs, load, done });
        }
        Ok(Shards { shards, next: 0 })
    }

    /// Run `job` on the shard with the fewest open connections (ties in turn); the connection
    /// counts there until the [`Placement`] given to `job` is dropped. `Err` when that shard's
    /// thread is gone (it panicked), with the job given back.
    pub(super) fn place(&mut self, job: Job) -> Result<(), Job> {
        let n = self.shards.len();
        if n == 0 {
            return Err(job);
        }
        let mut best = self.next % n;
        let mut least = usize::MAX;
        for k in 0..n {
            let i = (self.next + k) % n;
            let open = self.shards[i].load.open.load(Ordering::Acquire);
            if open < least {
                least = open;
                best = i;
            }
        }
        self.next = (best + 1) % n;
        let shard = &self.shards[best];
        shard.load.open.fetch_add(1, Ordering::AcqRel);
        shard.load.gauge.increment(1.0);
        if let Err(mpsc::error::SendError(job)) = shard.jobs.send(job) {
            shard.load.open.fetch_sub(1, Ordering::AcqRel);
            shard.load.gauge.decrement(1.0);
            return Err(job);
        }
        Ok(())
    }

    /// Open connections per shard, in shard order.
    #[cfg(test)]
    fn open(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| s.load.open.load(Ordering::Acquire))
            .collect()
    }

    /// Hand out no more connections; the shards end once their connections have.
    pub fn close(self) -> Closing {
        Closing {
            done: self.shards.into_iter().map(|s| s.done).collect(),
        }
    }
}

/// Shards that take no more connections.
pub struct Closing {
    done: Vec<oneshot::Receiver<()>>,
}

impl Closing {
    /// Wait until every shard thread has ended.
    pub async fn wait(self) {
        for d in self.done {
            let _ = d.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn connections_go_to_the_least_loaded_shard_and_run_there() {
        let (_tx, stage) = watch::channel(Stage::Running);
        let mut shards = Shards::start(3, "test", &stage).unwrap();
        let held: Arc<Mutex<Vec<(usize, Placement)>>> = Arc::default();
        for _ in 0..6 {
            let held = held.clone();
            let placed = shards.place(Box::new(move |p| {
                held.lock().unwrap().push((current(), p));
            }));
            assert!(placed.is_ok());
        }
        wait_until("six placements", || held.lock().unwrap().len() == 6);
        assert_eq!(shards.open(), vec![2, 2, 2]);
        let mut on: Vec<usize> = held.lock().unwrap().iter().map(|(s, _)| *s).collect();
        on.sort_unstable();
        assert_eq!(on, vec![1, 1, 2, 2, 3, 3], "jobs run on the shard threads");
        assert_eq!(current(), 0, "the caller is not a shard");
        // two connections of shard 2 end: the next two go there
        held.lock().unwrap().retain(|(s, _)| *s != 2);
        assert_eq!(shards.open(), vec![2, 0, 2]);
        for _ in 0..2 {
            let held = held.clone();
            let _ = shards.place(Box::new(move |p| {
                held.lock().unwrap().push((current(), p));
            }));
        }
        wait_until("two more", || held.lock().unwrap().len() == 6);
        assert_eq!(
            held.lock().unwrap().iter().filter(|(s, _)| *s == 2).count(),
            2
        );
    }

    #[tokio::test]
    async fn closed_shards_end_when_their_connections_end() {
        let (tx, stage) = watch::channel(Stage::Running);
        let mut shards = Shards::start(2, "test", &stage).unwrap();
        let held: Arc<Mutex<Vec<Placement>>> = Arc::default();
        for _ in 0..2 {
            let held = held.clone();
            let _ = shards.place(Box::new(move |p| held.lock().unwrap().push(p)));
        }
        wait_until("placements", || held.lock().unwrap().len() == 2);
        let closing = shards.close();
        let wait = tokio::spawn(closing.wait());
        // still serving their connections
        tokio::task::yield_now().await;
        assert!(!wait.is_finished());
        held.lock().unwrap().clear();
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("shards ended")
            .unwrap();
        drop(tx);
    }

    #[tokio::test]
    async fn abort_ends_shards_with_connections_still_open() {
        let (tx, stage) = watch::channel(Stage::Running);
        let mut shards = Shards::start(2, "test", &stage).unwrap();
        // a connection that never ends on its own
        let _ = shards.place(Box::new(move |p| {
            tokio::spawn(async move {
                let _p = p;
                std::future::pending::<()>().await;
            });
        }));
        let closing = shards.close();
        tx.send(Stage::Abort).unwrap();
        tokio::time::timeout(Duration::from_secs(10), closing.wait())
            .await
            .expect("shards ended on abort");
    }
}
