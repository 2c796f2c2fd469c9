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
