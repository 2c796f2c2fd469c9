//! Validation: defaults, every problem listed with its location, ranges reported (never
//! clamped), the URL and key-hash forms.

use super::super::from_str;
use super::*;

#[test]
fn defaults() {
    let c = from_str("", "t").unwrap();
    assert_eq!(c.server.listen.port(), 8080);
    assert_eq!(c.server.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    assert_eq!(c.routing.policy, PolicyKind::TokenAware);
    assert_eq!(c.routing.max_attempts, 3);
    assert!(c.backends.is_empty() && c.keys.is_empty());
}

#[test]
fn all_problems_listed_with_locations() {
    let text = r#"
[routing]
policy = "random"
[[backends]]
name = "a"
kind = "llamafile"
url = "ftp://x"
[[backends]]
name = "a"
kind = "vllm"
url = "http://127.0.0.1:1"
timeouts = { connect = "soon" }
[[keys]]
name = "k"
hash = "md5:abc"
"#;
    let err = from_str(text, "f.toml").unwrap_err().problems();
    let joined = err.join("\n");
    for needle in [
        "routing.policy",
        "backends[0].kind",
        "backends[0].url",
        "backends[1].name",
        "backends[1].timeouts.connect",
        "keys[0].hash",
    ] {
        assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
    }
    assert_eq!(err.len(), 6, "{joined}");
}

#[test]
fn connection_limits_defaults_and_bounds() {
    let c = from_str("", "t").unwrap();
    assert_eq!(c.server.connections, ConnectionLimits::default());
    let text = "[server]\nmax_connections = 0\nmax_header_bytes = 100\nidle_timeout = \"0s\"\nhttp2_initial_stream_window_size = 1\n[admin]\nmax_connections = 0\n";
    let joined = from_str(text, "t").unwrap_err().problems().join("\n");
    for needle in [
        "server.max_connections: must be between 1",
        "server.max_header_bytes: must be between 8192",
        "server.idle_timeout: must be greater than zero",
        "server.http2_initial_stream_window_size: must be between 65535",
        "admin.max_connections: must be between 1",
    ] {
        assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
    }
    let ok = from_str(
        "[server]\nmax_connections_per_ip = 0\nbody_read_timeout = \"2s\"\n",
        "t",
    )
    .unwrap();
    assert_eq!(ok.server.connections.max_connections_per_ip, 0);
    assert_eq!(
        ok.server.connections.body_read_timeout,
        Duration::from_secs(2)
    );
}

#[test]
fn trusted_proxies_and_the_loopback_exemption() {
    let c = from_str("", "t").unwrap();
    assert!(c.server.trusted_proxies.is_empty());
    assert!(c.server.connections.per_ip_exempt_loopback);
    let ok = from_str(
        "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"fd00::/8\", \"192.0.2.7\"]\nper_ip_exempt_loopback = false\n",
        "t",
    )
    .unwrap();
    let nets: Vec<String> = ok
        .server
        .trusted_proxies
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["10.0.0.0/8", "fd00::/8", "192.0.2.7/32"]);
    assert!(!ok.server.connections.per_ip_exempt_loopback);
    let text = "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/33\", \"lb.internal\", \"fd00::/129\"]\n";
    let err = from_str(text, "t").unwrap_err().problems();
    let joined = err.join("\n");
    for needle in [
        "server.trusted_proxies[1]: `10.0.0.0/33` is not an address range",
        "server.trusted_proxies[2]: `lb.internal` is not",
        "server.trusted_proxies[3]: `fd00::/129` is not",
    ] {
        assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
    }
    assert_eq!(err.len(), 3, "{joined}");
}

#[test]
fn admin_off_loopback_needs_token() {
    let err = from_str("[admin]\nlisten = \"0.0.0.0:9090\"\n", "t").unwrap_err();
    assert!(err.to_string().contains("admin.token"));
    assert!(from_str("[admin]\nlisten = \"127.0.0.1:9090\"\n", "t").is_ok());
}

#[test]
fn backend_url_forms() {
    assert_eq!(
        parse_backend_url("http://h:1/").unwrap().to_string(),
        "http://h:1/"
    );
    assert_eq!(parse_backend_url("https://h/v1/").unwrap().path(), "/v1");
    assert!(parse_backend_url("h:1").is_err());
    assert!(parse_backend_url("http://h?x=1").is_err());
}

#[test]
fn key_hash() {
    let h = format!("sha256:{}", "ab".repeat(32));
    assert_eq!(parse_key_hash(&h).unwrap(), [0xab; 32]);
    assert!(parse_key_hash("sha256:abcd").is_err());
}

/// Each value validation used to clamp or replace without a word is now a problem, named with
/// its key path and line.
#[test]
fn former_silent_clamps_are_problems_with_locations() {
    let text = r#"[routing]
max_attempts = 17
p2c_above = 1
[health]
healthy_threshold = 0
unhealthy_threshold = 0
eject_after_failures = 0
base_ejection = "2m"
max_ejection = "1m"
[limits]
window = "500us"
[registration]
ttl = "2h"
max_ttl = "1h"
[reload]
interval = "5ms"
[[discovery]]
name = "d"
kind = "vllm"
host = "h"
port = 1
weight = 0
"#;
    let err = from_str(text, "t.toml").unwrap_err().problems();
    let joined = err.join("\n");
    for needle in [
        "t.toml: routing.max_attempts: must be between 1 and 16 (line 2)",
        "t.toml: routing.p2c_above: must be at least 2 (line 3)",
        "t.toml: health.healthy_threshold: must be at least 1 (line 5)",
        "t.toml: health.unhealthy_threshold: must be at least 1 (line 6)",
        "t.toml: health.eject_after_failures: must be at least 1 (line 7)",
        "t.toml: health.base_ejection: must not exceed health.max_ejection (1m) (line 8)",
        "t.toml: limits.window: must be at least 1ms (line 11)",
        "t.toml: registration.ttl: must not exceed registration.max_ttl (1h) (line 13)",
        "t.toml: reload.interval: must be at least 10ms (line 16)",
        "t.toml: discovery[0].weight: must be at least 1 (line 22)",
    ] {
        assert!(
            err.iter().any(|e| e == needle),
            "missing {needle} in:\n{joined}"
        );
    }
    assert_eq!(err.len(), 10, "{joined}");
}

/// The edges of those ranges are accepted as written.
#[test]
fn range_edges_are_accepted() {
    let text = "[routing]\nmax_attempts = 16\np2c_above = 2\n[health]\nhealthy_threshold = 1\n\
                base_ejection = \"1m\"\nmax_ejection = \"1m\"\n[limits]\nwindow = \"1ms\"\n\
                [registration]\nttl = \"1h\"\n[reload]\ninterval = \"10ms\"\n";
    let c = from_str(text, "t").unwrap();
    assert_eq!(c.routing.max_attempts, 16);
    assert_eq!(c.routing.p2c_above, 2);
    assert_eq!(c.health.healthy_threshold, 1);
    assert_eq!(c.health.base_ejection, Duration::from_secs(60));
    assert_eq!(c.limits.window, Duration::from_millis(1));
    assert_eq!(c.membership.default_ttl, Duration::from_secs(3600));
    assert_eq!(c.reload.interval, Duration::from_millis(10));
}

/// Keys, tenants and `[limits]` go through one limit check.
#[test]
fn zero_limits_reported_for_keys_tenants_and_defaults() {
    let hash = format!("sha256:{}", "ab".repeat(32));
    let text = format!(
        "[limits]\ndaily_tokens = 0\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\nmax_concurrent = 0\n\
         [[tenants]]\nname = \"t\"\nrequests_per_minute = 0\n"
    );
    let err = from_str(&text, "t").unwrap_err().problems();
    let joined = err.join("\n");
    for needle in [
        "limits.daily_tokens: must be at least 1 (or absent) (line 2)",
        "keys[0].max_concurrent: must be at least 1 (or absent) (line 6)",
        "tenants[0].requests_per_minute: must be at least 1 (or absent) (line 9)",
    ] {
        assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
    }
    let ok = from_str(&text.replace(" = 0", " = 5"), "t").unwrap();
    assert_eq!(ok.keys[0].limits.max_concurrent, Some(5));
    assert_eq!(ok.keys[0].limit_set(), ok.keys[0].limits);
    assert_eq!(ok.tenants[0].limits.requests_per_minute, Some(5));
    assert_eq!(ok.limits.defaults.daily_tokens, Some(5));
}

#[test]
fn a_model_tokenizer_is_loaded_or_named_as_a_problem() {
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer");
    let text = format!(
        "[[models]]\nname = \"m\"\ntokenizer = \"{fixtures}/tiny-tools\"\n[[models]]\nname = \"n\"\n"
    );
    let c = from_str(&text, "t").unwrap();
    let t = c.models[0].tokenizer.as_ref().expect("loaded");
    assert!(t.dir().ends_with("tiny-tools"));
    assert!(c.models[1].tokenizer.is_none());

    let text = format!(
        "[[models]]\nname = \"m\"\ntokenizer = \"{fixtures}/missing\"\n[[models]]\nname = \"n\"\ntokenizer = \"\"\n"
    );
    let err = from_str(&text, "t").unwrap_err().problems();
    assert_eq!(err.len(), 2, "{err:?}");
    assert!(
        err[0].contains("models[0].tokenizer") && err[0].contains("missing: not a folder"),
        "{err:?}"
    );
    assert!(
        err[1].contains("models[1].tokenizer: must name a folder"),
        "{err:?}"
    );
}

#[test]
fn adapters_resolve_their_base_and_report_every_mistake() {
    let ok = from_str(
        r#"
[[models]]
name = "llama-3.1-8b"
aliases = ["llama3"]
[[adapters]]
name = "support-tone"
base = "llama3"
path = "/adapters/support-tone"
[[backends]]
name = "t"
kind = "tgi"
url = "http://127.0.0.1:1"
models = ["llama-3.1-8b"]
lora_adapters = ["legal"]
max_adapters = 2
"#,
        "t",
    )
    .unwrap();
    assert_eq!(
        ok.adapters,
        vec![AdapterConfig {
            name: "support-tone".into(),
            base: "llama-3.1-8b".into(),
            path: "/adapters/support-tone".into(),
        }]
    );
    assert_eq!(ok.backends[0].lora_adapters, vec!["legal".to_string()]);
    assert_eq!(ok.backends[0].max_adapters, Some(2));

    let text = r#"
[[models]]
name = "m"
aliases = ["m-alias"]
[[adapters]]
name = "a"
base = ""
path = ""
[[adapters]]
name = "a"
base = "m"
path = "/x"
[[adapters]]
name = "m-alias"
base = "m"
path = "/x"
[[backends]]
name = "v"
kind = "vllm"
url = "http://127.0.0.1:1"
lora_adapters = ["x"]
[[backends]]
name = "t"
kind = "tgi"
url = "http://127.0.0.1:2"
lora_adapters = ["x"]
"#;
    let err = from_str(text, "f.toml").unwrap_err().problems();
    let joined = err.join("\n");
    for needle in [
        "adapters[0].base",
        "adapters[0].path",
        "adapters[1].name",
        "adapters[2].name",
        "backends[0].lora_adapters: only for tgi",
        "backends[1].lora_adapters: needs `models`",
    ] {
        assert!(joined.contains(needle), "missing {needle} in:\n{joined}");
    }
    assert_eq!(err.len(), 6, "{joined}");
}
