//! vLLM's `--kv-events-config`: the publisher settings with vLLM 0.32's defaults, where each of
//! its sockets goes (bind or connect, vLLM's rule), and the `GET /kv_event_sources` answer.
//!
//! Invariants: a parsed [`KvEventsConfig`] has vLLM's defaults for every key it did not name,
//! unknown keys are refused (vLLM's config class refuses them too), and an enabled one names
//! `tcp://` endpoints (the simulator has no ipc or inproc transport). The endpoints reported
//! by `/kv_event_sources` are the bound ones (see `place`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

use serde::{Deserialize, Serialize};

use super::SimError;

/// vLLM's `KVEventsConfig`, as `--kv-events-config` takes it (JSON).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    #[serde(default)]
    enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; absent: `"zmq"` when events are enabled.
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default = "default_endpoint")]
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default = "default_buffer_steps")]
    buffer_steps: usize,
    #[serde(default = "default_hwm")]
    hwm: u64,
    #[serde(default = "default_queue")]
    max_queue_size: usize,
    #[serde(default)]
    topic: String,
}

fn default_endpoint() -> String {
    "tcp://*:5557".into()
}

fn default_buffer_steps() -> usize {
    10_000
}

fn default_queue() -> usize {
    100_000
}

fn default_hwm() -> u64 {
    100_000
}

/// The resolved config of `/kv_event_sources`, in vLLM's key order.
#[derive(Serialize)]
struct Source<'a> {
    enable_kv_cache_events: bool,
    publisher: &'a str,
    endpoint: &'a str,
    replay_endpoint: Option<&'a str>,
    buffer_steps: usize,
    hwm: u64,
    max_queue_size: usize,
    topic: &'a str,
}

impl KvEventsConfig {
    /// Parse the flag's JSON.
    pub fn from_json(text: &str) -> Result<KvEventsConfig, SimError> {
        let mut c: KvEventsConfig = serde_json::from_str(text)
            .map_err(|e| SimError::Config(format!("--kv-events-config: {e}")))?;
        let publisher = match c.publisher.as_deref() {
            None if c.enable_kv_cache_events => "zmq",
            None => "null",
            Some(p @ ("zmq" | "null")) => p,
            Some(other) => {
                return Err(SimError::Config(format!(
                    "--kv-events-config: unknown publisher `{other}` (expected zmq or null)"
                )))
            }
        };
        c.publisher = Some(publisher.to_string());
        if c.enabled() {
            place(&c.endpoint, true, IpAddr::V4(Ipv4Addr::LOCALHOST))?;
            if let Some(r) = &c.replay_endpoint {
                place(r, true, IpAddr::V4(Ipv4Addr::LOCALHOST))?;
            }
        }
        Ok(c)
    }

    /// Events are published (enabled, with the `zmq` publisher).
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() == Some("zmq")
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Batches kept for replay.
    pub fn buffer_steps(&self) -> usize {
        self.buffer_steps
    }

    /// Batches queued between the engine and the publisher (at least 1, at most 2^24).
    pub fn max_queue_size(&self) -> usize {
        self.max_queue_size.clamp(1, 1 << 24)
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The `/kv_event_sources` body for a publisher whose sockets ended up at `endpoint` and
    /// `replay` (data-parallel rank 0, the simulator's only one).
    pub(crate) fn sources_json(&self, endpoint: &str, replay: Option<&str>) -> String {
        let source = Source {
            enable_kv_cache_events: true,
            publisher: "zmq",
            endpoint,
            replay_endpoint: replay,
            buffer_steps: self.buffer_steps,
            hwm: self.hwm,
            max_queue_size: self.max_queue_size,
            topic: &self.topic,
        };
        let doc = std::collections::BTreeMap::from([("0", source)]);
        serde_json::to_string(&doc).unwrap_or_else(|_| "{}".into())
    }
}

/// Where a socket goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Place {
    /// Bind `addr`; `report` is the endpoint `/kv_event_sources` shows, with `{port}` standing
    /// for the port bound (known only once bound, when `addr` asks for port 0).
    Bind { addr: SocketAddr, report: String },
    /// Connect to this endpoint (a subscriber binds it).
    Connect(String),
}

impl Place {
    /// The endpoint to report once bound at `port`.
    pub(crate) fn reported(&self, port: u16) -> String {
        match self {
            Place::Bind { report, .. } => report.replace("{port}", &port.to_string()),
            Place::Connect(e) => e.clone(),
        }
    }
}

/// Where a socket for `endpoint` goes on a simulator bound to `host`. The publisher's socket
/// (`bind_rule`) binds, as vLLM's does, only when the endpoint has a wildcard host (`*`, or
/// `::` anywhere in it) and connects otherwise; the replay socket always binds.
///
/// `tcp://*:0` binds the simulator's own host at a port the system picks and reports
/// `tcp://HOST:PORT`, as vLLM 0.32 does with its node's address. Any other port-0 bind also
/// reports the port picked (vLLM would report `:0`; a simulator convenience for tests).
pub(crate) fn place(endpoint: &str, bind_rule: bool, host: IpAddr) -> Result<Place, SimError> {
    let bad = |why: &str| SimError::Config(format!("--kv-events-config: `{endpoint}`: {why}"));
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| bad("only tcp:// endpoints are simulated"))?;
    let (h, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| bad("expected tcp://HOST:PORT"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let wildcard = h == "*" || endpoint.contains("::");
    if bind_rule && !wildcard {
        return Ok(Place::Connect(endpoint.to_string()));
    }
    let shown = |host: &str| match port {
        0 => format!("tcp://{host}:{{port}}"),
        _ => endpoint.to_string(),
    };
    let (ip, report) = match h {
        "*" if port == 0 => (host, shown(&host_text(host))),
        "*" => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), endpoint.to_string()),
        _ => {
            let ip = resolve(h).ok_or_else(|| bad("the host is not an address of this machine"))?;
            (ip, shown(h))
        }
    };
    Ok(Place::Bind {
        addr: SocketAddr::new(ip, port),
        report,
    })
}

/// `host` as an endpoint writes it: IPv6 in brackets, an unspecified address as `*`.
fn host_text(host: IpAddr) -> String {
    match host {
        h if h.is_unspecified() => "*".into(),
        IpAddr::V6(v6) => format!("[{v6}]"),
        IpAddr::V4(v4) => v4.to_string(),
    }
}

/// The address of an endpoint's host: an IP literal (IPv6 with or without brackets) or a
/// name resolved by the system.
fn resolve(h: &str) -> Option<IpAddr> {
    let bare = h.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Some(ip);
    }
    if bare == "::" {
        return Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    }
    (bare, 0).to_socket_addrs().ok()?.next().map(|a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    #[test]
    fn defaults_are_vllms() {
        let c = KvEventsConfig::from_json(r#"{"enable_kv_cache_events":true}"#).unwrap();
        assert!(c.enabled());
        assert_eq!(c.endpoint(), "tcp://*:5557");
        assert_eq!(c.replay_endpoint(), None);
        assert_eq!(c.buffer_steps(), 10_000);
        assert_eq!(c.max_queue_size(), 100_000);
        assert_eq!(c.topic(), "");
        assert_eq!(
            c.sources_json("tcp://*:5557", None),
            r#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":null,"buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":""}}"#
        );
        // off unless enabled, and the null publisher is off too
        assert!(!KvEventsConfig::from_json("{}").unwrap().enabled());
        let null = r#"{"enable_kv_cache_events":true,"publisher":"null"}"#;
        assert!(!KvEventsConfig::from_json(null).unwrap().enabled());
    }

    #[test]
    fn bad_configs_are_refused() {
        for bad in [
            r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#,
            r#"{"enable_kv_cache_events":true,"bogus":1}"#,
            r#"{"enable_kv_cache_events":true,"endpoint":"ipc://kv-events"}"#,
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:port"}"#,
            r#"{"enable_kv_cache_events":true,"buffer_steps":-1}"#,
            "not json",
        ] {
            assert!(KvEventsConfig::from_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_publisher_binds_wildcards_and_connects_otherwise() {
        let bind = |e: &str| place(e, true, LOCAL).unwrap();
        assert_eq!(
            bind("tcp://*:0"),
            Place::Bind {
                addr: "127.0.0.1:0".parse().unwrap(),
                report: "tcp://127.0.0.1:{port}".into()
            }
        );
        assert_eq!(bind("tcp://*:0").reported(4242), "tcp://127.0.0.1:4242");
        assert_eq!(
            bind("tcp://*:5557"),
            Place::Bind {
                addr: "0.0.0.0:5557".parse().unwrap(),
                report: "tcp://*:5557".into()
            }
        );
        assert!(matches!(bind("tcp://[::]:5557"), Place::Bind { addr, .. } if addr.is_ipv6()));
        assert_eq!(
            bind("tcp://127.0.0.1:5557"),
            Place::Connect("tcp://127.0.0.1:5557".into())
        );
        // the replay socket binds whatever the host
        let replay = place("tcp://127.0.0.1:0", false, LOCAL).unwrap();
        assert_eq!(replay.reported(9), "tcp://127.0.0.1:9");
        // on a simulator listening everywhere, `*` stays `*`
        let any = place("tcp://*:0", true, IpAddr::V4(Ipv4Addr::UNSPECIFIED)).unwrap();
        assert_eq!(any.reported(7), "tcp://*:7");
    }
}
