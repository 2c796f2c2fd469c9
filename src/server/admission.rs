//! Connection admission: how many connections a listener holds open, in total and per client
//! address.
//!
//! [`Admission::try_admit`] is called by the accept loop for every accepted socket and either
//! returns a [`ConnectionGuard`], which the connection's task owns for as long as the
//! connection lives (its drop gives the slot back on every exit path: normal close, error,
//! timeout, shutdown, panic), or refuses, and the accept loop closes the socket at once.
//!
//! Invariants:
//! - The accept loop never waits for a slot. Every pending connection is accepted as fast as
//!   the loop can run and, over a limit, closed immediately (no task spawned, nothing read, at
//!   most one non-blocking write of a fixed 503 on plain HTTP). A flood beyond the limit
//!   therefore drains the kernel's backlog at accept speed instead of filling it: a real
//!   client's SYN is not dropped behind thousands of queued flood connections, and it is
//!   admitted as soon as a slot is free. Pausing `accept` while full would do the opposite
//!   (backlog full, SYNs dropped, and the next connection admitted is the oldest queued one,
//!   most likely the flood's), and the per-address cap could not work at all since the address
//!   is only known after `accept`.
//! - Counts are exact: a slot is taken under the same lock that checks the limit, and given
//!   back by the guard's drop; the per-address table only holds addresses with at least one
//!   open connection, so its size is bounded by `max_connections`.
//! - IPv4 addresses (and IPv4-mapped IPv6) are counted one by one; IPv6 addresses by /64, the
//!   block one subscriber usually gets, so rotating through one's own prefix does not multiply
//!   the cap.
//! - The per-address cap applies only to peers [`Peers::capped`] says it does: loopback (by
//!   default) and trusted proxies stand for many clients each, so only `max_connections` bounds
//!   them. They are counted all the same.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use super::peers::Peers;
use crate::telemetry::metrics as m;

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The listener holds `max_connections` already.
    Listener,
    /// This client address holds `max_connections_per_ip` already.
    PerIp,
}

impl Refused {
    /// The `reason` label of `sluice_connections_rejected_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Listener => "max_connections",
            Refused::PerIp => "max_connections_per_ip",
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// The connection counts of one listener and its limits.
#[derive(Debug)]
pub struct Admission {
    listener: &'static str,
    max: usize,
    /// 0: no per-address cap.
    max_per_ip: usize,
    /// Which peers the per-address cap applies to.
    peers: Arc<Peers>,
    counts: Mutex<Counts>,
}

impl Admission {
    /// Limits for the listener labelled `listener` (`client` or `admin`) in metrics; the
    /// per-address cap applies to the peers `peers` caps.
    pub fn new(
        listener: &'static str,
        max: usize,
        max_per_ip: usize,
        peers: Arc<Peers>,
    ) -> Arc<Admission> {
        metrics::gauge!(m::CONNECTIONS_OPEN, "listener" => listener).set(0.0);
        for r in [Refused::Listener, Refused::PerIp] {
            metrics::counter!(m::CONNECTIONS_REJECTED_TOTAL, "listener" => listener, "reason" => r.as_str())
                .increment(0);
        }
        Arc::new(Admission {
            listener,
            max: max.max(1),
            max_per_ip,
            peers,
            counts: Mutex::new(Counts::default()),
        })
    }

    /// The listener's metric label.
    pub fn listener(&self) -> &'static str {
        self.listener
    }

    /// Take a slot for a connection from `peer`, or say which limit refuses it (counted in
    /// `sluice_connections_rejected_total`). Never waits.
    pub fn try_admit(self: &Arc<Self>, peer: IpAddr) -> Result<ConnectionGuard, Refused> {
        let key = bucket(peer);
        let capped = self.max_per_ip > 0 && self.peers.capped(peer);
        let refused = {
            let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            if c.total >= self.max {
                Some(Refused::Listener)
            } else if capped && c.per_ip.get(&key).copied().unwrap_or(0) >= self.max_per_ip {
                Some(Refused::PerIp)
            } else {
                c.total += 1;
                *c.per_ip.entry(key).or_insert(0) += 1;
                None
            }
        };
        if let Some(r) = refused {
            metrics::counter!(m::CONNECTIONS_REJECTED_TOTAL, "listener" => self.listener, "reason" => r.as_str())
                .increment(1);
            return Err(r);
        }
        metrics::gauge!(m::CONNECTIONS_OPEN, "listener" => self.listener).increment(1.0);
        Ok(ConnectionGuard {
            admission: self.clone(),
            key,
        })
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    /// Open connections from `peer`'s address (or /64) now.
    pub fn open_from(&self, peer: IpAddr) -> usize {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.per_ip.get(&bucket(peer)).copied().unwrap_or(0)
    }

    fn release(&self, key: IpAddr) {
        {
            let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            c.total = c.total.saturating_sub(1);
            if let Some(n) = c.per_ip.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.per_ip.remove(&key);
                }
            }
        }
        metrics::gauge!(m::CONNECTIONS_OPEN, "listener" => self.listener).decrement(1.0);
    }
}

/// One admitted connection's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct ConnectionGuard {
    admission: Arc<Admission>,
    key: IpAddr,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.admission.release(self.key);
    }
}

/// The address a connection is counted under: IPv4 as is, IPv6 by its /64.
fn bucket(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every peer capped, loopback included.
    fn all_capped() -> Arc<Peers> {
        Arc::new(Peers::new(Vec::new(), false))
    }

    #[test]
    fn per_ip_and_total_limits_with_release() {
        let a = Admission::new("test", 3, 2, all_capped());
        let ip1: IpAddr = "10.0.0.1".parse().unwrap();
        let ip2: IpAddr = "10.0.0.2".parse().unwrap();
        let g1 = a.try_admit(ip1).unwrap();
        let _g2 = a.try_admit(ip1).unwrap();
        assert_eq!(a.try_admit(ip1).unwrap_err(), Refused::PerIp);
        let _g3 = a.try_admit(ip2).unwrap();
        assert_eq!(a.try_admit(ip2).unwrap_err(), Refused::Listener);
        assert_eq!(a.open(), 3);
        drop(g1);
        assert_eq!(a.open_from(ip1), 1);
        let _g4 = a.try_admit(ip1).unwrap();
        assert_eq!(a.open(), 3);
    }

    #[test]
    fn ipv6_counted_by_slash_64_and_mapped_v4_as_v4() {
        let a = Admission::new("test", 10, 1, all_capped());
        let _g = a.try_admit("2001:db8:1:2::1".parse().unwrap()).unwrap();
        assert!(a.try_admit("2001:db8:1:2::ffff".parse().unwrap()).is_err());
        assert!(a.try_admit("2001:db8:1:3::1".parse().unwrap()).is_ok());
        let _v4 = a.try_admit("192.0.2.7".parse().unwrap()).unwrap();
        assert!(a.try_admit("::ffff:192.0.2.7".parse().unwrap()).is_err());
    }

    #[test]
    fn no_per_ip_cap_when_zero() {
        let a = Admission::new("test", 5, 0, all_capped());
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let guards: Vec<_> = (0..5).map(|_| a.try_admit(ip).unwrap()).collect();
        assert_eq!(a.try_admit(ip).unwrap_err(), Refused::Listener);
        drop(guards);
        assert_eq!(a.open(), 0);
        assert_eq!(a.open_from(ip), 0);
    }

    #[test]
    fn exempt_peers_are_counted_but_only_the_listener_cap_bounds_them() {
        let peers = Peers::new(vec!["10.0.0.0/8".parse().unwrap()], true);
        let a = Admission::new("test", 6, 1, Arc::new(peers));
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let lb: IpAddr = "10.1.2.3".parse().unwrap();
        let other: IpAddr = "192.0.2.1".parse().unwrap();
        let mut held: Vec<_> = (0..2).map(|_| a.try_admit(lo).unwrap()).collect();
        held.extend((0..2).map(|_| a.try_admit(lb).unwrap()));
        held.push(a.try_admit(other).unwrap());
        assert_eq!(a.try_admit(other).unwrap_err(), Refused::PerIp);
        assert_eq!((a.open_from(lo), a.open_from(lb)), (2, 2));
        held.push(a.try_admit("::1".parse().unwrap()).unwrap());
        assert_eq!(a.try_admit(lo).unwrap_err(), Refused::Listener);
        drop(held);
        assert_eq!(a.open(), 0);
    }
}
