//! Keys and prompts never reach the logs; wrong and unknown keys are answered alike and in
//! indistinguishable time.

use crate::support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice::sim::{SimConfig, SimKind};
use support::process::output_of;
use support::{backend, client, eventually, free_port, TestGateway};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_or_prompt_in_the_logs() {
    let sim = sluice::sim::spawn(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(0.0))
        .await
        .unwrap();
    let (key, hash) = sluice::auth::mint();
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n{}\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\nrequests_per_minute = 2\n",
            backend("b", "vllm", &sim.url(), &["m"])
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("SLUICE_LOG", "trace")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let c = client();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let prompt = "zebra-quartz-marmalade-7731";
    let body = serde_json::json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": prompt}]});
    eventually(Duration::from_secs(15), "gateway serving", || async {
        let r = c.post(&url).bearer_auth(&key).json(&body).send().await;
        r.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let wrong = format!("{}x", &key[..key.len() - 1]);
    for k in [key.as_str(), key.as_str(), wrong.as_str()] {
        let _ = c
            .post(&url)
            .bearer_auth(k)
            .json(&body)
            .send()
            .await
            .unwrap();
        let _ = c
            .post(&url)
            .header("x-api-key", k)
            .json(&body)
            .send()
            .await
            .unwrap();
    }
    let _ = child.kill();
    let _ = child.wait();
    let logs = output_of(&mut child);
    assert!(logs.contains("request"), "no access log captured: {logs}");
    let secret = &key["sk-sluice-".len()..];
    assert!(!logs.contains(secret), "a key reached the logs");
    assert!(
        !logs.contains(&wrong["sk-sluice-".len()..]),
        "a wrong key reached the logs"
    );
    assert!(!logs.contains(prompt), "a prompt reached the logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_and_unknown_keys_are_indistinguishable() {
    let sim = sluice::sim::spawn(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(0.0))
        .await
        .unwrap();
    let (key, hash) = sluice::auth::mint();
    let gw = TestGateway::start_healthy(&format!(
        "{}\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\n",
        backend("b", "vllm", &sim.url(), &["m"])
    ))
    .await;
    let c = client();
    let url = gw.url("/v1/chat/completions");
    let body = support::chat_body("m", false, 5);
    // Wrong: the real key with its last character changed. Unknown: nothing like it.
    let last = key.chars().last().unwrap();
    let wrong = format!(
        "{}{}",
        &key[..key.len() - 1],
        if last == '0' { '1' } else { '0' }
    );
    let unknown = "sk-other-unknown".to_string();
    let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut bodies = [String::new(), String::new()];
    for round in 0..150 {
        for (i, k) in [&wrong, &unknown].into_iter().enumerate() {
            let t = Instant::now();
            let r = c
                .post(&url)
                .bearer_auth(k)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 401);
            let text = r.text().await.unwrap();
            times[i].push(t.elapsed());
            if round == 0 {
                bodies[i] = text;
            }
        }
    }
    assert_eq!(
        bodies[0], bodies[1],
        "different answers for wrong and unknown keys"
    );
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (a, b) = (median(&mut times[0]), median(&mut times[1]));
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    // Loose on purpose (shared, noisy machine): the design guarantees the same code path.
    assert!(
        hi <= lo * 2 + Duration::from_millis(2),
        "medians differ: wrong {a:?} unknown {b:?}"
    );
}
