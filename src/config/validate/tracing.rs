//! `[tracing]`: OpenTelemetry export, with each key the file leaves out taken from the
//! standard environment (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `…_PROTOCOL`, `…_HEADERS`,
//! `…_TIMEOUT`, `…_CERTIFICATE`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER_ARG`, `OTEL_SDK_DISABLED`). Off unless an endpoint is named, in the
//! file or the environment. An `https` collector, over either protocol, is trusted by the
//! system's roots and the `ca_file`'s (read and checked here).
//!
//! Invariant: the file wins over the environment, key by key; a value from either that is
//! out of range is a problem naming where it came from.

use std::time::Duration;

use super::{duration, in_range, Problems};
use crate::config::env::{expand, Env};
use crate::config::file::TracingSection;
use crate::telemetry::otel::{Protocol, Settings};

/// The path OTLP/HTTP takes traces on, under a collector's base URL.
const TRACES_PATH: &str = "/v1/traces";
const DEFAULT_QUEUE: usize = 2048;
const MAX_QUEUE: u64 = 1_000_000;

pub(super) fn tracing(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> Option<Settings> {
    let disabled = env
        .get("OTEL_SDK_DISABLED")
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if t.enabled == Some(false) || (disabled && t.enabled.is_none()) {
        return None;
    }
    let protocol = protocol(p, t, env)?;
    let Some(endpoint) = endpoint(p, t, env, protocol) else {
        if t.sets_any() || t.enabled == Some(true) {
            p.push(
                "tracing.otlp_endpoint",
                "is required to trace (or OTEL_EXPORTER_OTLP_ENDPOINT in the environment)",
            );
        }
        return None;
    };
    let sample_ratio = sample_ratio(p, t, env);
    let service_name = match t
        .service_name
        .clone()
        .or_else(|| env.get("OTEL_SERVICE_NAME"))
    {
        Some(n) if n.trim().is_empty() => {
            p.push("tracing.service_name", "is empty");
            String::new()
        }
        Some(n) => n.trim().to_string(),
        None => "sluice".to_string(),
    };
    let export_timeout = match &t.export_timeout {
        Some(_) => duration(
            p,
            "tracing.export_timeout",
            &t.export_timeout,
            Duration::ZERO,
        ),
        None => env_timeout(p, env).unwrap_or(Duration::from_secs(10)),
    };
    Some(Settings {
        endpoint,
        protocol,
        sample_ratio,
        service_name,
        headers: headers(p, t, env),
        resource: resource(p, t, env),
        queue_size: in_range(
            p,
            "tracing.queue_size",
            t.queue_size,
            DEFAULT_QUEUE,
            1..=MAX_QUEUE,
        ),
        export_interval: duration(
            p,
            "tracing.export_interval",
            &t.export_interval,
            Duration::from_secs(1),
        ),
        export_timeout,
        ca_pem: ca_pem(p, t, env),
    })
}

/// The extra roots for an https collector: the file's `ca_file`, else the standard variable's,
/// read and checked now (a bad one is a config problem, also on reload).
fn ca_pem(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> Option<Vec<u8>> {
    let (at, path) = match &t.ca_file {
        Some(v) => match expand(v, env) {
            Ok(v) => ("tracing.ca_file".to_string(), v.trim().to_string()),
            Err(e) => {
                p.push("tracing.ca_file", e);
                return None;
            }
        },
        None => first_env(
            env,
            &[
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
                "OTEL_EXPORTER_OTLP_CERTIFICATE",
            ],
        )?,
    };
    let path = std::path::Path::new(&path);
    match crate::tls::load_ca(path).and_then(|_| {
        std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    }) {
        Ok(pem) => Some(pem),
        Err(e) => {
            p.push(at, e);
            None
        }
    }
}

/// The first of these environment variables that is set and not empty.
fn first_env(env: &dyn Env, names: &[&str]) -> Option<(String, String)> {
    names.iter().find_map(|n| {
        env.get(n)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (n.to_string(), v.trim().to_string()))
    })
}

fn protocol(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> Option<Protocol> {
    let (at, v) = match &t.protocol {
        Some(v) => ("tracing.protocol".to_string(), v.trim().to_string()),
        None => first_env(
            env,
            &[
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ],
        )
        .unwrap_or_else(|| (String::new(), "http/protobuf".to_string())),
    };
    match v.as_str() {
        "http/protobuf" => Some(Protocol::HttpProtobuf),
        "grpc" => Some(Protocol::Grpc),
        other => {
            p.push(at, format!("`{other}` is not `http/protobuf` or `grpc`"));
            None
        }
    }
}

/// The URL spans go to: the file's base URL (`/v1/traces` added for HTTP), else the
/// environment's traces URL as it is, else its base URL.
fn endpoint(
    p: &mut Problems,
    t: &TracingSection,
    env: &dyn Env,
    proto: Protocol,
) -> Option<String> {
    let (at, url, base) = match &t.otlp_endpoint {
        Some(v) => match expand(v, env) {
            Ok(v) => (
                "tracing.otlp_endpoint".to_string(),
                v.trim().to_string(),
                true,
            ),
            Err(e) => {
                p.push("tracing.otlp_endpoint", e);
                return None;
            }
        },
        None => match first_env(env, &["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]) {
            Some((at, v)) => (at, v, false),
            None => {
                let (at, v) = first_env(env, &["OTEL_EXPORTER_OTLP_ENDPOINT"])?;
                (at, v, true)
            }
        },
    };
    match url.parse::<http::Uri>() {
        Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {}
        _ => {
            p.push(
                at,
                format!("`{url}` is not a URL like \"http://collector:4318\""),
            );
            return None;
        }
    }
    if proto == Protocol::HttpProtobuf && base && !url.trim_end_matches('/').ends_with(TRACES_PATH)
    {
        return Some(format!("{}{TRACES_PATH}", url.trim_end_matches('/')));
    }
    Some(url)
}

fn sample_ratio(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> f64 {
    let (at, v) = match t.sample_ratio {
        Some(r) => ("tracing.sample_ratio".to_string(), r),
        None => match first_env(env, &["OTEL_TRACES_SAMPLER_ARG"]) {
            Some((at, v)) => match v.parse::<f64>() {
                Ok(r) => (at, r),
                Err(_) => {
                    p.push(at, format!("`{v}` is not a number between 0 and 1"));
                    return 1.0;
                }
            },
            None => return 1.0,
        },
    };
    if !(0.0..=1.0).contains(&v) {
        p.push(at, "must be between 0 and 1");
        return 1.0;
    }
    v
}

/// `OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT`, in milliseconds.
fn env_timeout(p: &mut Problems, env: &dyn Env) -> Option<Duration> {
    let (at, v) = first_env(
        env,
        &[
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ],
    )?;
    match v.parse::<u64>() {
        Ok(ms) if ms > 0 => Some(Duration::from_millis(ms)),
        _ => {
            p.push(at, format!("`{v}` is not a number of milliseconds above 0"));
            None
        }
    }
}

/// `k=v,k2=v2` (the environment's form for headers and resource attributes), values
/// percent-decoded.
fn pairs(p: &mut Problems, at: &str, v: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                out.push((k.trim().to_string(), percent_decode(v.trim())));
            }
            _ => p.push(at, format!("`{item}` is not `key=value`")),
        }
    }
    out
}

fn percent_decode(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn headers(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> Vec<(String, String)> {
    let list: Vec<(String, String, String)> = if t.headers.is_empty() {
        let names = [
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ];
        match first_env(env, &names) {
            Some((at, v)) => pairs(p, &at, &v)
                .into_iter()
                .map(|(k, v)| (at.clone(), k, v))
                .collect(),
            None => Vec::new(),
        }
    } else {
        let mut out = Vec::new();
        for (k, v) in &t.headers {
            let at = format!("tracing.headers.{k}");
            match expand(v, env) {
                Ok(v) => out.push((at, k.clone(), v)),
                Err(e) => p.push(at, e),
            }
        }
        out
    };
    let mut checked = Vec::new();
    for (at, k, v) in list {
        let name = http::HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes());
        if name.is_err() || http::HeaderValue::from_str(&v).is_err() {
            p.push(at, format!("`{k}` with its value is not a valid header"));
            continue;
        }
        checked.push((k.to_ascii_lowercase(), v));
    }
    checked
}

fn resource(p: &mut Problems, t: &TracingSection, env: &dyn Env) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = t
        .resource
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some((at, v)) = first_env(env, &["OTEL_RESOURCE_ATTRIBUTES"]) {
        for (k, v) in pairs(p, &at, &v) {
            // the file's value wins; `service.name` is its own key
            if k != "service.name" && !out.iter().any(|(o, _)| *o == k) {
                out.push((k, v));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn run(toml: &str, env: &[(&str, &str)]) -> (Option<Settings>, Vec<String>) {
        let t: TracingSection = toml::from_str(toml).unwrap();
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut p = Problems(Vec::new());
        let s = tracing(&mut p, &t, &env);
        (s, p.0)
    }

    #[test]
    fn off_without_an_endpoint() {
        assert_eq!(run("", &[]), (None, vec![]));
        let (s, problems) = run("sample_ratio = 0.5", &[]);
        assert!(s.is_none());
        assert!(
            problems[0].starts_with("tracing.otlp_endpoint"),
            "{problems:?}"
        );
    }

    #[test]
    fn the_file_then_the_environment() {
        let (s, problems) = run(
            "otlp_endpoint = \"http://c:4318\"\nsample_ratio = 0.25\n[headers]\nAuthorization = \"Bearer ${T}\"\n[resource]\n\"deployment.environment\" = \"prod\"",
            &[("T", "x"), ("OTEL_SERVICE_NAME", "gw"), ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=dev,team=ml%20infra")],
        );
        assert!(problems.is_empty(), "{problems:?}");
        let s = s.unwrap();
        assert_eq!(s.endpoint, "http://c:4318/v1/traces");
        assert_eq!(s.protocol, Protocol::HttpProtobuf);
        assert_eq!(s.sample_ratio, 0.25);
        assert_eq!(s.service_name, "gw");
        assert_eq!(s.headers, vec![("authorization".into(), "Bearer x".into())]);
        let env_attr = ("team".to_string(), "ml infra".to_string());
        let file_attr = ("deployment.environment".to_string(), "prod".to_string());
        assert_eq!(s.resource, vec![file_attr, env_attr]);
        // Only the environment: its traces URL as it is, gRPC, headers, timeout.
        let (s, problems) = run(
            "",
            &[
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=k1"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            ],
        );
        assert!(problems.is_empty(), "{problems:?}");
        let s = s.unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.protocol),
            ("http://c:4317", Protocol::Grpc)
        );
        assert_eq!(s.headers, vec![("api-key".into(), "k1".into())]);
        assert_eq!(s.export_timeout, Duration::from_millis(2500));
        // Turned off by the file or the SDK switch.
        let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")];
        assert!(run("enabled = false", &env).0.is_none());
        let disabled = [env[0], ("OTEL_SDK_DISABLED", "true")];
        assert!(run("", &disabled).0.is_none());
    }

    #[test]
    fn bad_values_are_problems() {
        for (toml, at) in [
            ("otlp_endpoint = \"c:4318\"", "tracing.otlp_endpoint"),
            ("otlp_endpoint = \"ftp://c:4318\"", "tracing.otlp_endpoint"),
            (
                "otlp_endpoint = \"https:///v1/traces\"",
                "tracing.otlp_endpoint",
            ),
            (
                "otlp_endpoint = \"https://c\"\nprotocol = \"http/json\"",
                "tracing.protocol",
            ),
            (
                "otlp_endpoint = \"http://c\"\nprotocol = \"http/json\"",
                "tracing.protocol",
            ),
            (
                "otlp_endpoint = \"http://c\"\nsample_ratio = 1.5",
                "tracing.sample_ratio",
            ),
            (
                "otlp_endpoint = \"http://c\"\nqueue_size = 0",
                "tracing.queue_size",
            ),
            (
                "otlp_endpoint = \"http://c\"\n[headers]\n\"a b\" = \"x\"",
                "tracing.headers.a b",
            ),
        ] {
            let (_, problems) = run(toml, &[]);
            assert!(
                problems.iter().any(|p| p.starts_with(at)),
                "{toml}: {problems:?}"
            );
        }
        let (_, problems) = run(
            "",
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
                ("OTEL_TRACES_SAMPLER_ARG", "x"),
            ],
        );
        assert!(
            problems[0].starts_with("OTEL_TRACES_SAMPLER_ARG"),
            "{problems:?}"
        );
    }

    /// An https collector over either protocol, with extra roots from the file or the
    /// standard variables (the signal's first); a CA file that cannot be read is a problem
    /// naming where it came from.
    #[test]
    fn an_https_collector_takes_either_protocol_and_extra_roots() {
        let (s, problems) = run(
            "otlp_endpoint = \"https://c:4317\"\nprotocol = \"grpc\"",
            &[],
        );
        assert!(problems.is_empty(), "{problems:?}");
        let s = s.unwrap();
        assert_eq!((s.endpoint.as_str(), s.ca_pem), ("https://c:4317", None));
        // OTLP/HTTP over TLS: the traces path added as over http, the roots read now.
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).unwrap().pem();
        std::fs::write(&ca, &pem).unwrap();
        let ca = ca.display().to_string();
        let file = format!("otlp_endpoint = \"https://c:4318\"\nca_file = \"{ca}\"");
        let (s, problems) = run(&file, &[]);
        assert!(problems.is_empty(), "{problems:?}");
        let s = s.unwrap();
        assert_eq!(s.endpoint, "https://c:4318/v1/traces");
        assert_eq!(s.protocol, Protocol::HttpProtobuf);
        assert_eq!(s.ca_pem.as_deref(), Some(pem.as_bytes()));
        let env = [
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://c/v1/traces"),
            ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", ca.as_str()),
            ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem"),
        ];
        let (s, problems) = run("", &env);
        assert!(problems.is_empty(), "{problems:?}");
        let s = s.unwrap();
        assert_eq!(s.endpoint, "https://c/v1/traces");
        assert_eq!(s.ca_pem.as_deref(), Some(pem.as_bytes()));
        let missing = [("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem")];
        let (_, problems) = run("otlp_endpoint = \"https://c\"", &missing);
        assert!(
            problems[0].starts_with("OTEL_EXPORTER_OTLP_CERTIFICATE"),
            "{problems:?}"
        );
        let (_, problems) = run(
            "otlp_endpoint = \"http://c\"\nca_file = \"/nonexistent\"",
            &[],
        );
        assert!(problems[0].starts_with("tracing.ca_file"), "{problems:?}");
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let shipped = include_str!("../../../config/sluice.toml");
        let start = shipped.find("# [tracing]").unwrap();
        let example: String = shipped[start..]
            .lines()
            .take_while(|l| l.starts_with('#'))
            .map(|l| l.trim_start_matches('#').trim_start())
            .collect::<Vec<_>>()
            .join("\n");
        #[derive(serde::Deserialize)]
        struct File {
            tracing: TracingSection,
        }
        let file: File = toml::from_str(&example).unwrap();
        let env: HashMap<String, String> = [("OTEL_TOKEN".to_string(), "t".to_string())].into();
        let mut p = Problems(Vec::new());
        let s = tracing(&mut p, &file.tracing, &env);
        assert!(p.0.is_empty(), "{:?}", p.0);
        let s = s.unwrap();
        assert_eq!(s.endpoint, "http://127.0.0.1:4318/v1/traces");
        assert_eq!(s.headers, vec![("authorization".into(), "Bearer t".into())]);
        assert_eq!(s.resource.len(), 1);
    }
}
