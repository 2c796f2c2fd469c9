//! The idle connections of one backend on one serving thread.
//!
//! Invariants: only connections whose last response was read to its end are here; one is
//! handed out only if it is younger than the idle timeout and the backend has neither closed
//! it nor sent anything on it (a non-blocking read that would block); at most `max_idle` are
//! kept per authority, the oldest closed first.

use std::collections::VecDeque;
use std::io;
use std::sync::Mutex;
use std::time::Instant;

use super::body::Conn;
use super::Settings;

/// One backend's idle connections for one thread. The lock is uncontended: a serving thread
/// uses its own pool (shared only by threads beyond the cores, see [`super::super::Pools`]).
#[derive(Debug)]
pub struct Pool {
    settings: Settings,
    idle: Mutex<Vec<(String, VecDeque<Idle>)>>,
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

impl Pool {
    pub fn new(settings: Settings) -> Pool {
        Pool {
            settings,
            idle: Mutex::new(Vec::new()),
        }
    }

    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// The newest usable idle connection to `authority`; stale and closed ones are dropped.
    pub(super) fn checkout(&self, authority: &str) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = &mut idle.iter_mut().find(|(a, _)| a == authority)?.1;
        let now = Instant::now();
        while list
            .front()
            .is_some_and(|i| now.duration_since(i.since) > self.settings.idle_timeout)
        {
            list.pop_front();
        }
        while let Some(Idle { mut conn, .. }) = list.pop_back() {
            if still_open(&conn) {
                conn.reused = true;
                return Some(conn);
            }
            tracing::debug!(backend = authority, "idle connection closed by the backend");
        }
        None
    }

    /// Keep `conn` for the next request.
    pub(super) fn give_back(&self, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let i = match idle.iter().position(|(a, _)| *a == conn.authority) {
            Some(i) => i,
            None => {
                idle.push((conn.authority.clone(), VecDeque::new()));
                idle.len() - 1
            }
        };
        let list = &mut idle[i].1;
        if list.len() >= self.settings.max_idle {
            list.pop_front();
        }
        list.push_back(Idle {
            conn,
            since: Instant::now(),
        });
    }

    /// Idle connections kept (all authorities).
    pub fn idle_count(&self) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.iter().map(|(_, l)| l.len()).sum()
    }
}

/// An idle connection is usable when peeking at it would block: nothing arrived, not even
/// the end. Bytes or an end mean the backend closed or broke it. A system call, not tokio's
/// cached readiness, which may not have seen a close that arrived while the thread was busy.
fn still_open(conn: &Conn) -> bool {
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    let peeked = socket2::SockRef::from(&conn.io).peek(&mut probe);
    matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}
