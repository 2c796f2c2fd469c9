//! What the gateway makes of the address a connection comes from: whether the per-address
//! connection cap applies to it, and which client a request on it stands for.
//!
//! Two kinds of peer are exempt from `max_connections_per_ip`, because one address there stands
//! for many clients: loopback (a sidecar, a local proxy; unless `per_ip_exempt_loopback` is
//! off) and the `trusted_proxies` ranges (every client behind a load balancer shares its
//! address). `max_connections` still bounds them, with everyone else.
//!
//! The client of a request is the peer itself, except when the peer is a trusted proxy: then it
//! is read from `X-Forwarded-For`, right to left, skipping the trusted proxies' own entries;
//! the first entry that is not one is the client ([`Peers::client`]).
//!
//! Invariants:
//! - `X-Forwarded-For` from a peer that is not a trusted proxy is never read: anyone can write
//!   it, so only the hops our own proxies appended (the right end of the list) are believed.
//!   Entries left of the first untrusted one are the client's to invent and are never used.
//! - A malformed entry ends the walk: nothing left of it can be attributed, so the client is
//!   the nearest trusted hop seen (the peer, at worst), never an address read past it.
//! - IPv4-mapped IPv6 addresses count as the IPv4 address they carry, for both rules (a
//!   dual-stack listener sees IPv4 peers that way).
//! - The walk is bounded by [`MAX_HOPS`] entries whatever the header holds.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;
use ipnet::IpNet;

/// Entries of `X-Forwarded-For` read at most, from the right.
pub const MAX_HOPS: usize = 32;

/// The trusted proxies and the loopback exemption of a listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peers {
    trusted: Vec<IpNet>,
    exempt_loopback: bool,
}

impl Default for Peers {
    /// Loopback exempt from the per-address cap, no trusted proxy.
    fn default() -> Self {
        Peers::new(Vec::new(), true)
    }
}

impl Peers {
    pub fn new(trusted: Vec<IpNet>, exempt_loopback: bool) -> Peers {
        Peers {
            trusted,
            exempt_loopback,
        }
    }

    /// The client listener's peers (`[server]`).
    pub fn of(c: &crate::config::ServerConfig) -> Peers {
        Peers::new(
            c.trusted_proxies.clone(),
            c.connections.per_ip_exempt_loopback,
        )
    }

    /// Whether `ip` is in a `trusted_proxies` range.
    pub fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.trusted.iter().any(|net| net.contains(&ip))
    }

    /// Whether the per-address connection cap applies to a connection from `peer`.
    pub fn capped(&self, peer: IpAddr) -> bool {
        let loopback = self.exempt_loopback && peer.to_canonical().is_loopback();
        !loopback && !self.is_trusted(peer)
    }

    /// The client a request from `peer` with `headers` stands for: the peer, or, from a trusted
    /// proxy, the rightmost `X-Forwarded-For` entry that is not a trusted proxy itself (the
    /// leftmost entry when all are; the nearest trusted hop when the walk meets a malformed
    /// entry).
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return peer;
        }
        let mut nearest = peer;
        for entry in forwarded_for(headers).take(MAX_HOPS) {
            let Some(ip) = parse_entry(entry) else {
                return nearest;
            };
            if !self.is_trusted(ip) {
                return ip;
            }
            nearest = ip;
        }
        nearest
    }
}

/// The entries of every `X-Forwarded-For` field, the rightmost (nearest) first; empty entries
/// (a stray comma) skipped. A field that is not text yields one malformed entry.
fn forwarded_for(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let fields: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .map(|v| v.to_str().unwrap_or("\u{0}"))
        .collect();
    fields
        .into_iter()
        .rev()
        .flat_map(|f| f.rsplit(','))
        .map(str::trim)
        .filter(|e| !e.is_empty())
}

/// One entry: an address, optionally with a port (`203.0.113.7:5123`, `[2001:db8::1]:443`).
fn parse_entry(entry: &str) -> Option<IpAddr> {
    let ip = match entry.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => entry.parse::<SocketAddr>().ok()?.ip(),
    };
    Some(ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(trusted: &[&str]) -> Peers {
        Peers::new(trusted.iter().map(|n| n.parse().unwrap()).collect(), true)
    }

    fn client(p: &Peers, peer: &str, xff: &[&str]) -> String {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        p.client(peer.parse().unwrap(), &h).to_string()
    }

    const LB: &str = "10.0.0.5";

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_forwards() {
        let p = peers(&["10.0.0.0/8"]);
        assert_eq!(client(&p, "198.51.100.1", &["203.0.113.9"]), "198.51.100.1");
        assert_eq!(client(&p, "198.51.100.1", &[]), "198.51.100.1");
        assert_eq!(
            client(&Peers::default(), "127.0.0.1", &["1.2.3.4"]),
            "127.0.0.1"
        );
    }

    #[test]
    fn rightmost_untrusted_entry_wins_over_spoofed_leftmost_ones() {
        let p = peers(&["10.0.0.0/8"]);
        assert_eq!(client(&p, LB, &["203.0.113.9"]), "203.0.113.9");
        // The client wrote the first two; the load balancer appended what it saw.
        assert_eq!(
            client(&p, LB, &["1.1.1.1, 10.9.9.9, 203.0.113.9"]),
            "203.0.113.9"
        );
        // Two trusted hops appended after the client.
        assert_eq!(
            client(&p, LB, &["6.6.6.6, 203.0.113.9, 10.1.1.1, 10.2.2.2"]),
            "203.0.113.9"
        );
        // Several fields are one list, in order.
        assert_eq!(
            client(&p, LB, &["6.6.6.6", "203.0.113.9", "10.1.1.1"]),
            "203.0.113.9"
        );
    }

    #[test]
    fn all_trusted_chain_gives_the_farthest_hop_and_none_the_peer() {
        let p = peers(&["10.0.0.0/8"]);
        assert_eq!(client(&p, LB, &["10.3.3.3, 10.1.1.1"]), "10.3.3.3");
        assert_eq!(client(&p, LB, &[]), LB);
        assert_eq!(client(&p, LB, &[" , "]), LB);
    }

    #[test]
    fn malformed_entry_stops_at_the_nearest_trusted_hop() {
        let p = peers(&["10.0.0.0/8"]);
        assert_eq!(client(&p, LB, &["203.0.113.9, unknown"]), LB);
        assert_eq!(
            client(&p, LB, &["203.0.113.9, bogus, 10.1.1.1"]),
            "10.1.1.1"
        );
        // Garbage left of the client's own entry is never reached.
        assert_eq!(client(&p, LB, &["bogus, 203.0.113.9"]), "203.0.113.9");
        assert_eq!(client(&p, LB, &["300.1.1.1"]), LB);
    }

    #[test]
    fn ports_ipv6_and_mapped_addresses() {
        let p = peers(&["10.0.0.0/8", "fd00::/8"]);
        assert_eq!(client(&p, LB, &["203.0.113.9:5123"]), "203.0.113.9");
        assert_eq!(client(&p, LB, &["[2001:db8::7]:443"]), "2001:db8::7");
        assert_eq!(client(&p, LB, &["2001:db8::7, fd00::1"]), "2001:db8::7");
        assert_eq!(client(&p, "fd00::9", &["2001:db8::7"]), "2001:db8::7");
        // A dual-stack listener sees the IPv4 proxy as mapped; the entry too may be mapped.
        assert_eq!(
            client(&p, "::ffff:10.0.0.5", &["::ffff:203.0.113.9"]),
            "203.0.113.9"
        );
        assert_eq!(
            client(&p, "::ffff:198.51.100.1", &["1.2.3.4"]),
            "198.51.100.1"
        );
    }

    #[test]
    fn the_walk_is_bounded() {
        let p = peers(&["10.0.0.0/8"]);
        let hops = vec!["10.0.0.1"; MAX_HOPS + 5].join(",");
        let xff = format!("203.0.113.9, {hops}");
        assert_eq!(client(&p, LB, &[&xff]), "10.0.0.1");
    }

    #[test]
    fn cap_exemptions() {
        let p = peers(&["10.0.0.0/8", "fd00::/8"]);
        for ip in [
            "127.0.0.1",
            "127.8.9.10",
            "::1",
            "::ffff:127.0.0.1",
            "10.1.2.3",
            "fd00::5",
            "::ffff:10.0.0.1",
        ] {
            assert!(!p.capped(ip.parse().unwrap()), "{ip} should be exempt");
        }
        for ip in ["192.0.2.1", "11.0.0.1", "2001:db8::1", "::ffff:192.0.2.1"] {
            assert!(p.capped(ip.parse().unwrap()), "{ip} should be capped");
        }
        let strict = Peers::new(Vec::new(), false);
        assert!(strict.capped("127.0.0.1".parse().unwrap()));
        assert!(strict.capped("::1".parse().unwrap()));
    }
}
