//! What can be checked of deploy/ and the Dockerfile without a container engine: every YAML
//! document parses with the expected kinds, the configs inside ConfigMaps and beside the compose
//! file pass Sluice's own validation, probes and grace periods agree with the config's shutdown
//! timings, the Grafana dashboard parses and uses only metric names Sluice exports, and the
//! Dockerfile builds with a plain `cargo build --release --locked`, runs as non-root and has a
//! HEALTHCHECK that `sluice probe` understands.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::free_port;
use crate::support::process::isolated;
use serde::Deserialize;
use serde_norway::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_norway::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn kinds(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .map(|d| d["kind"].as_str().expect("a kind").to_string())
        .collect()
}

/// The env the shipped configs expect from their Secrets and Deployments. Set only in a
/// process of the test's own ([`isolated`]): the environment is process-wide.
fn set_env() {
    std::env::set_var("SLUICE_ADMIN_TOKEN", "t0ken-for-validation");
    std::env::set_var("SLUICE_REDIS_URL", "redis://127.0.0.1:6379");
    std::env::set_var("SLUICE_BACKEND_URL", "http://127.0.0.1:8000");
}

fn config_maps(docs: &[Value]) -> Vec<(String, sluice::Config)> {
    set_env();
    docs.iter()
        .filter(|d| d["kind"] == "ConfigMap")
        .map(|d| {
            let name = d["metadata"]["name"].as_str().unwrap().to_string();
            let text = d["data"]["sluice.toml"].as_str().expect("data.sluice.toml");
            let c = sluice::config::from_str(text, &name)
                .unwrap_or_else(|e| panic!("ConfigMap {name}: {e}"));
            (name, c)
        })
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

fn check_probes(container: &Value, grace_s: u64, c: &sluice::Config) {
    let port = container["readinessProbe"]["httpGet"]["port"].clone();
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    // The probes reach a listener the kubelet can connect to (the admin one on all interfaces).
    let admin = c.admin.as_ref().expect("[admin] for the probes");
    assert!(
        admin.listen.ip().is_unspecified(),
        "admin must listen beyond loopback for probes"
    );
    let ports: Vec<u64> = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|p| Some(&p["name"]) == Some(&port) || p["containerPort"] == port)
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, vec![u64::from(admin.listen.port())], "probe port");
    // Kubernetes' grace covers the unready delay plus the drain.
    let needed = c.server.shutdown_delay + c.server.shutdown_grace;
    assert!(
        Duration::from_secs(grace_s) > needed,
        "terminationGracePeriodSeconds {grace_s}s <= shutdown_delay + shutdown_grace {needed:?}"
    );
    assert!(
        !c.server.shutdown_delay.is_zero(),
        "a shutdown_delay lets endpoints drop the pod first"
    );
}

#[test]
fn kubernetes_sidecar_pod() {
    if !isolated("deploy_manifests::kubernetes_sidecar_pod") {
        return;
    }
    let d = docs("deploy/kubernetes/sidecar.yaml");
    assert_eq!(kinds(&d), ["ConfigMap", "Secret", "Pod"]);
    let maps = config_maps(&d);
    let (_, c) = &maps[0];
    assert!(
        c.server.listen.ip().is_loopback(),
        "a sidecar API stays on loopback"
    );
    let pod = find(&d, "Pod");
    let spec = &pod["spec"];
    let sidecar = &spec["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always", "native sidecar");
    assert_eq!(
        spec["containers"].as_sequence().unwrap().len(),
        1,
        "the app"
    );
    check_probes(
        sidecar,
        spec["terminationGracePeriodSeconds"].as_u64().unwrap(),
        c,
    );
    assert_eq!(spec["volumes"][0]["configMap"]["name"], maps[0].0.as_str());
    assert_eq!(sidecar["volumeMounts"][0]["mountPath"], "/etc/sluice");
}

#[test]
fn kubernetes_replicas_with_redis() {
    if !isolated("deploy_manifests::kubernetes_replicas_with_redis") {
        return;
    }
    let d = docs("deploy/kubernetes/replicas.yaml");
    let k = kinds(&d);
    for want in [
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    ] {
        assert!(k.iter().any(|x| x == want), "{want} missing: {k:?}");
    }
    let maps = config_maps(&d);
    let (_, c) = &maps[0];
    assert!(c.redis_url.is_some(), "replicas share limits through Redis");
    let deployments: Vec<&Value> = d.iter().filter(|x| x["kind"] == "Deployment").collect();
    let sluice = deployments
        .iter()
        .find(|x| x["metadata"]["name"] == "sluice")
        .unwrap();
    assert!(sluice["spec"]["replicas"].as_u64().unwrap() >= 2);
    let spec = &sluice["spec"]["template"]["spec"];
    check_probes(
        &spec["containers"][0],
        spec["terminationGracePeriodSeconds"].as_u64().unwrap(),
        c,
    );
    let env = spec["containers"][0]["env"].as_sequence().unwrap();
    let redis_env = env
        .iter()
        .find(|e| e["name"] == "SLUICE_REDIS_URL")
        .unwrap();
    let redis_host = redis_env["value"].as_str().unwrap();
    let services: Vec<&str> = d
        .iter()
        .filter(|x| x["kind"] == "Service")
        .map(|x| x["metadata"]["name"].as_str().unwrap())
        .collect();
    assert!(
        services
            .iter()
            .any(|s| redis_host.contains(&format!("//{s}:"))),
        "{redis_host} is not one of the Services {services:?}"
    );
    assert!(deployments
        .iter()
        .any(|x| x["metadata"]["name"] == "sluice-redis"));
}

#[test]
fn compose_fleet_of_simulators() {
    if !isolated("deploy_manifests::compose_fleet_of_simulators") {
        return;
    }
    let d = docs("deploy/compose.yaml");
    assert_eq!(d.len(), 1);
    let services = d[0]["services"].as_mapping().unwrap();
    set_env();
    let c = sluice::config::load(&root().join("deploy/compose/sluice.toml")).unwrap();
    let mut sims = BTreeSet::new();
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        let cmd: Vec<&str> = svc["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        if cmd[0] == "sim" {
            let kind = cmd[cmd.iter().position(|a| *a == "--kind").unwrap() + 1];
            let port = cmd[cmd.iter().position(|a| *a == "--port").unwrap() + 1];
            assert!(["vllm", "tgi", "ollama"].contains(&kind), "{name}: {kind}");
            let b = c
                .backends
                .iter()
                .find(|b| b.name == name)
                .unwrap_or_else(|| panic!("no backend for {name}"));
            assert_eq!(b.kind.as_str(), kind, "{name}");
            assert_eq!(
                b.url.authority().unwrap().as_str(),
                format!("{name}:{port}"),
                "{name}"
            );
            sims.insert(name.to_string());
        }
    }
    assert_eq!(sims.len(), 3, "three simulated engines");
    let gw = &services[&Value::from("sluice")];
    assert_eq!(gw["command"][0], "serve");
    let mount = gw["volumes"][0].as_str().unwrap();
    assert!(mount.starts_with("./compose/sluice.toml:/etc/sluice/sluice.toml"));
}

/// Every `sluice_*` name in `src/telemetry/metrics.rs`.
fn exported_metrics() -> BTreeSet<String> {
    let src = read("src/telemetry/metrics.rs");
    src.split('"')
        .filter(|s| {
            s.starts_with("sluice_")
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        })
        .map(str::to_string)
        .collect()
}

fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| exprs(x, out)),
        _ => {}
    }
}

#[test]
fn grafana_dashboard_uses_only_exported_metrics() {
    let d: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/sluice-dashboard.json")).unwrap();
    assert_eq!(d["title"], "Sluice");
    let mut all = Vec::new();
    exprs(&d, &mut all);
    assert!(all.len() >= 15, "{} queries", all.len());
    let known = exported_metrics();
    let mut used = BTreeSet::new();
    for e in &all {
        for (i, _) in e.match_indices("sluice_") {
            let name: String = e[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| known.contains(*b))
                .map_or(name.clone(), str::to_string);
            assert!(
                known.contains(&base),
                "{name} (in `{e}`) is not exported by Sluice"
            );
            used.insert(base);
        }
    }
    for core in [
        "sluice_requests_total",
        "sluice_time_to_first_token_seconds",
        "sluice_backend_inflight_requests",
        "sluice_backend_state",
        "sluice_ratelimit_rejections_total",
        "sluice_queue_depth",
        "sluice_config_reloads_total",
    ] {
        assert!(used.contains(core), "the dashboard does not chart {core}");
    }
}

/// Instructions of one stage of a Dockerfile, continuation lines joined.
fn stages(text: &str) -> Vec<Vec<(String, String)>> {
    let mut joined = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && cur.is_empty()) {
            continue;
        }
        if let Some(s) = t.strip_suffix('\\') {
            cur.push_str(s);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        joined.push(std::mem::take(&mut cur));
    }
    let mut out: Vec<Vec<(String, String)>> = Vec::new();
    for l in joined {
        let (ins, rest) = l.split_once(' ').unwrap_or((&l, ""));
        let ins = ins.to_ascii_uppercase();
        if ins == "FROM" {
            out.push(Vec::new());
        }
        out.last_mut()
            .expect("FROM first")
            .push((ins, rest.trim().to_string()));
    }
    out
}

#[test]
fn dockerfile_build_run_and_healthcheck() {
    if !isolated("deploy_manifests::dockerfile_build_run_and_healthcheck") {
        return;
    }
    let text = read("Dockerfile");
    let st = stages(&text);
    assert_eq!(st.len(), 2, "multi-stage: build and runtime");
    let build = &st[0];
    let runs: Vec<&str> = build
        .iter()
        .filter(|(i, _)| i == "RUN")
        .map(|(_, r)| r.as_str())
        .collect();
    assert_eq!(
        runs,
        ["cargo build --release --locked"],
        "the image builds exactly like `cargo build --release --locked`"
    );
    // What the build stage copies is enough: the manifest, the lock file, the sources.
    let copied: Vec<&str> = build
        .iter()
        .filter(|(i, _)| i == "COPY")
        .flat_map(|(_, r)| {
            let parts: Vec<&str> = r.split_whitespace().collect();
            parts[..parts.len() - 1].to_vec()
        })
        .collect();
    for need in ["Cargo.toml", "Cargo.lock", "src"] {
        assert!(
            copied.contains(&need),
            "{need} not copied into the build stage"
        );
    }
    for c in &copied {
        assert!(root().join(c).exists(), "{c} does not exist");
    }
    // Nothing in src/ includes a file from outside what is copied (outside test code).
    check_includes(&root().join("src"));

    let run = &st[1];
    let get = |ins: &str| -> Vec<&str> {
        run.iter()
            .filter(|(i, _)| i == ins)
            .map(|(_, r)| r.as_str())
            .collect()
    };
    let user = get("USER");
    assert_eq!(user.len(), 1);
    assert_ne!(user[0], "0");
    assert_ne!(user[0], "root");
    let config_copy = get("COPY")
        .into_iter()
        .find(|c| c.ends_with("/etc/sluice/sluice.toml"))
        .expect("config at /etc/sluice");
    let src = config_copy.split_whitespace().next().unwrap();
    set_env();
    sluice::config::load(&root().join(src)).unwrap_or_else(|e| panic!("{src}: {e}"));
    let hc = get("HEALTHCHECK");
    assert_eq!(hc.len(), 1, "a HEALTHCHECK");
    let cmd = hc[0].split_once("CMD").unwrap().1.trim();
    let argv: Vec<String> = serde_json::from_str(cmd).unwrap();
    assert_eq!(argv[0], "/usr/local/bin/sluice");
    assert_eq!(argv[1], "probe");
    let url = &argv[argv.iter().position(|a| a == "--url").unwrap() + 1];
    let port: u16 = url
        .trim_start_matches("http://127.0.0.1:")
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let c = sluice::config::load(&root().join(src)).unwrap();
    assert_eq!(
        Some(port),
        c.admin.as_ref().map(|a| a.listen.port()),
        "the HEALTHCHECK probes the admin listener of the image's config"
    );
}

fn check_includes(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            check_includes(&p);
            continue;
        }
        if p.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, _) in code.match_indices("include_str!(\"") {
            let rel = &code[i + 14..];
            let rel = &rel[..rel.find('"').unwrap()];
            let target = p.parent().unwrap().join(rel);
            let target = target.canonicalize().unwrap();
            assert!(
                target.starts_with(root().join("src")),
                "{} includes {rel}, which the image build does not copy",
                p.display()
            );
        }
    }
}

#[test]
fn probe_subcommand_answers_like_a_healthcheck() {
    let bin = env!("CARGO_BIN_EXE_sluice");
    let port = free_port();
    let out = std::process::Command::new(bin)
        .args([
            "probe",
            "--url",
            &format!("http://127.0.0.1:{port}/healthz"),
            "--timeout",
            "2s",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "nothing listens there");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(sluice::run(listener, sluice::Config::empty(), async move {
            let _ = rx.await;
        }));
        let ok = tokio::process::Command::new(bin)
            .args(["probe", "--url", &format!("http://{addr}/healthz")])
            .status()
            .await
            .unwrap();
        assert!(ok.success());
        // No backend: /readyz is 503, so probing it fails.
        let not_ready = tokio::process::Command::new(bin)
            .args(["probe", "--url", &format!("http://{addr}/readyz")])
            .output()
            .await
            .unwrap();
        assert!(!not_ready.status.success());
        assert!(String::from_utf8_lossy(&not_ready.stderr).contains("503"));
        let _ = tx.send(());
        let _ = task.await;
    });
}
