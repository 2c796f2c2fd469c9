//! `[server]`: the client listener, body bounds, shutdown, connection admission (and the
//! trusted proxies it exempts), client-side timeouts, HTTP/1 and HTTP/2 protocol bounds and
//! CORS.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;

use super::{addr, duration, fits, in_range, zero_ok_duration, Problems};
use crate::config::env::Env;
use crate::config::file::ServerSection;
use crate::config::runtime::{
    ConnectionLimits, ServerConfig, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
    MAX_SERVER_THREADS,
};

pub(super) fn server(p: &mut Problems, s: &ServerSection, env: &dyn Env) -> ServerConfig {
    let listen = s.listen.as_deref().unwrap_or("127.0.0.1:8080");
    let listen = addr(p, "server.listen", listen, env)
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080)));
    ServerConfig {
        listen,
        threads: s
            .threads
            .map(|n| in_range(p, "server.threads", Some(n), 1, 1..=MAX_SERVER_THREADS)),
        max_body_bytes: bytes(
            p,
            "server.max_body_bytes",
            s.max_body_bytes,
            DEFAULT_MAX_BODY_BYTES,
        ),
        max_response_bytes: bytes(
            p,
            "server.max_response_bytes",
            s.max_response_bytes,
            DEFAULT_MAX_RESPONSE_BYTES,
        ),
        shutdown_grace: duration(
            p,
            "server.shutdown_grace",
            &s.shutdown_grace,
            Duration::from_secs(30),
        ),
        shutdown_delay: zero_ok_duration(
            p,
            "server.shutdown_delay",
            &s.shutdown_delay,
            Duration::ZERO,
        ),
        connections: connection_limits(p, s),
        cors_allow_origins: cors_origins(p, s.cors_allow_origins.as_deref()),
        trusted_proxies: trusted_proxies(p, s.trusted_proxies.as_deref()),
    }
}

/// A byte bound greater than zero.
fn bytes(p: &mut Problems, at: &str, v: Option<u64>, default: usize) -> usize {
    match v {
        None => default,
        Some(0) => {
            p.push(at, "must be greater than zero");
            default
        }
        Some(n) => fits(p, at, n, default),
    }
}

/// HTTP/2 window sizes: RFC 9113 caps them at 2^31-1; below 64 KiB streams crawl.
const WINDOW: std::ops::RangeInclusive<u64> = 65_535..=(1 << 31) - 1;

/// `[server]`'s connection admission, client-side timeouts and protocol bounds.
fn connection_limits(p: &mut Problems, s: &ServerSection) -> ConnectionLimits {
    let d = ConnectionLimits::default();
    // `server.<field>` within `range`; the default when unset.
    macro_rules! num {
        ($field:ident, $range:expr) => {
            in_range(
                p,
                concat!("server.", stringify!($field)),
                s.$field,
                d.$field,
                $range,
            )
        };
    }
    macro_rules! timeout {
        ($field:ident) => {
            duration(
                p,
                concat!("server.", stringify!($field)),
                &s.$field,
                d.$field,
            )
        };
    }
    ConnectionLimits {
        max_connections: num!(max_connections, 1..=1 << 24),
        max_connections_per_ip: num!(max_connections_per_ip, 0..=1 << 24),
        per_ip_exempt_loopback: s.per_ip_exempt_loopback.unwrap_or(d.per_ip_exempt_loopback),
        header_read_timeout: timeout!(header_read_timeout),
        body_read_timeout: timeout!(body_read_timeout),
        idle_timeout: timeout!(idle_timeout),
        max_header_bytes: num!(
            max_header_bytes,
            ConnectionLimits::MIN_HEADER_BYTES as u64..=16 << 20
        ),
        max_headers: num!(max_headers, 1..=10_000),
        http2_max_concurrent_streams: num!(http2_max_concurrent_streams, 1..=1 << 20),
        http2_max_pending_accept_reset_streams: num!(
            http2_max_pending_accept_reset_streams,
            1..=1 << 20
        ),
        http2_max_local_error_reset_streams: num!(http2_max_local_error_reset_streams, 1..=1 << 20),
        http2_max_client_resets: num!(http2_max_client_resets, 1..=1 << 20),
        http2_max_send_buf_size: num!(http2_max_send_buf_size, 16 * 1024..=64 << 20),
        http2_initial_stream_window_size: num!(http2_initial_stream_window_size, WINDOW),
        http2_initial_connection_window_size: num!(http2_initial_connection_window_size, WINDOW),
    }
}

/// `server.cors_allow_origins`: "*" alone, or origins `http(s)://host[:port]` without a path.
fn cors_origins(p: &mut Problems, list: Option<&[String]>) -> Vec<String> {
    let Some(list) = list else {
        return Vec::new();
    };
    if list.iter().any(|o| o == "*") {
        if list.len() > 1 {
            p.push(
                "server.cors_allow_origins",
                "\"*\" allows every origin and must be the only entry",
            );
        }
        return vec!["*".to_string()];
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, o) in list.iter().enumerate() {
        let rest = o
            .strip_prefix("https://")
            .or_else(|| o.strip_prefix("http://"));
        let ok = rest.is_some_and(|host| {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
        });
        if ok {
            out.push(o.to_ascii_lowercase());
        } else {
            p.push(
                format!("server.cors_allow_origins[{i}]"),
                format!("`{o}` is not an origin like \"https://app.example.com\" (scheme, host, optional port; no path) or \"*\""),
            );
        }
    }
    out
}

/// `server.trusted_proxies`: CIDR ranges (`10.0.0.0/8`, `fd00::/8`) or single addresses (a
/// host's /32 or /128).
fn trusted_proxies(p: &mut Problems, list: Option<&[String]>) -> Vec<IpNet> {
    let mut out = Vec::new();
    for (i, v) in list.unwrap_or_default().iter().enumerate() {
        let v = v.trim();
        let parsed = v
            .parse::<IpNet>()
            .or_else(|_| v.parse::<IpAddr>().map(IpNet::from));
        match parsed {
            Ok(net) => out.push(net),
            Err(_) => p.push(
                format!("server.trusted_proxies[{i}]"),
                format!("`{v}` is not an address range like \"10.0.0.0/8\" or \"fd00::/8\", nor an address"),
            ),
        }
    }
    out
}
