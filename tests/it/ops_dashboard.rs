//! The status page in a real headless Chromium: it renders, its numbers change as traffic
//! flows (the DOM dumped before and after some requests), no script or console errors, and a
//! screenshot is saved under target/. Skips (passes) when Chromium is missing, unless `CI` is
//! set.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sha2::Digest;
use sluice::sim::{SimConfig, SimKind};
use support::chromium::{chromium, run_chromium, target_dir};
use support::*;

/// The text of the element with `id` in a DOM dump.
fn text_of(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page:\n{dom}"));
    let rest = &dom[at..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest[start..].find('<').unwrap() + start;
    rest[start..end].trim().to_string()
}

fn attr_of(dom: &str, id: &str, attr: &str) -> String {
    let at = dom.find(&format!("id=\"{id}\"")).unwrap();
    let tag_start = dom[..at].rfind('<').unwrap();
    let tag_end = at + dom[at..].find('>').unwrap();
    let tag = &dom[tag_start..tag_end];
    let key = format!("{attr}=\"");
    let v = tag
        .find(&key)
        .unwrap_or_else(|| panic!("no {attr} in {tag}"))
        + key.len();
    tag[v..v + tag[v..].find('"').unwrap()].to_string()
}

fn number(s: &str) -> f64 {
    s.parse().unwrap_or_else(|_| panic!("not a number: {s:?}"))
}

fn console_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains(":CONSOLE")).collect()
}

fn check_clean(dom: &str, stderr: &str) {
    assert_eq!(
        attr_of(dom, "errors", "data-errors"),
        "0",
        "the page reported errors: {}",
        text_of(dom, "errors")
    );
    let console = console_lines(stderr);
    assert!(console.is_empty(), "console messages: {console:#?}");
    let updates = number(&attr_of(dom, "status", "data-updates"));
    assert!(updates >= 1.0, "the page never loaded its data:\n{dom}");
}

async fn chat(url: &str, key: &str) {
    let r = client()
        .post(url)
        .bearer_auth(key)
        .json(&chat_body("m", true, 16))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await.unwrap();
}

#[tokio::test]
async fn dashboard_renders_and_follows_traffic_in_chromium() {
    let Some(bin) = chromium() else {
        support::process::skip("chromium not installed (apt-get install chromium)");
        return;
    };
    let key = "sk-dashboard-test-key";
    let hash = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    let a = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(50.0)).await;
    let b = sim(SimKind::Tgi, &["m"]).await;
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"dash-token\"\n\
         [[keys]]\nname = \"alice-key\"\ntenant = \"alice\"\nhash = \"sha256:{hash}\"\n\
         requests_per_minute = 6000\ntokens_per_minute = 1000000\n{FAST_HEALTH}{}{}",
        backend("vllm-a", "vllm", &a.url(), &["m"]),
        backend("tgi-b", "tgi", &b.url(), &["m"]),
    );
    let g = TestGateway::start_healthy(&toml).await;
    let chat_url = g.url("/v1/chat/completions");

    // Guarded like the other operations routes, and only on the admin listener.
    let c = client();
    assert_eq!(get_status(&c, g.admin_url("/dashboard")).await, 401);
    assert_eq!(get_status(&c, g.admin_url("/admin/summary")).await, 401);
    assert_eq!(
        get_status(&c, g.url("/dashboard?token=dash-token")).await,
        404
    );
    let page = c
        .get(g.admin_url("/dashboard"))
        .bearer_auth("dash-token")
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let csp = header(&page, "content-security-policy").to_string();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = page.text().await.unwrap();
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "the page must not load anything external"
    );

    let page_url = g.admin_url("/dashboard?token=dash-token&interval=250");
    let dump = vec![
        "--dump-dom".to_string(),
        "--virtual-time-budget=1500".to_string(),
    ];
    let (dom1, err1) = run_chromium(&bin, &page_url, &dump).await;
    check_clean(&dom1, &err1);
    assert!(
        dom1.contains("data-backend=\"vllm-a\"") && dom1.contains("data-backend=\"tgi-b\""),
        "{dom1}"
    );
    let before = number(&text_of(&dom1, "total-requests"));
    // The batch runner's lines have their row (zeros here: no `[batch]`).
    for id in [
        "batch-queued",
        "batch-running",
        "batch-completed",
        "batch-busy",
    ] {
        assert!(number(&text_of(&dom1, id)) >= 0.0, "{id}: {dom1}");
    }
    assert!(text_of(&dom1, "up").ends_with("/2"), "two backends counted");

    for _ in 0..6 {
        chat(&chat_url, key).await;
    }
    let (dom2, err2) = run_chromium(&bin, &page_url, &dump).await;
    check_clean(&dom2, &err2);
    let after = number(&text_of(&dom2, "total-requests"));
    assert!(after >= before + 6.0, "requests {before} -> {after}");
    assert!(
        dom2.contains("data-tenant=\"alice\""),
        "tenant row missing:\n{dom2}"
    );
    assert_ne!(
        text_of(&dom2, "ttft-p50"),
        "–",
        "TTFT shown once streams ran"
    );

    // A screenshot while traffic flows, for people to look at.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, url) = (stop.clone(), chat_url.clone());
        tokio::spawn(async move {
            for _ in 0..2000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                chat(&url, key).await;
            }
        })
    };
    let shot = target_dir().join("ops-dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let (_, err3) = run_chromium(
        &bin,
        &page_url,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1280,900".to_string(),
            "--virtual-time-budget=4000".to_string(),
            "--hide-scrollbars".to_string(),
        ],
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let _ = traffic.await;
    assert!(console_lines(&err3).is_empty(), "{err3}");
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "screenshot missing or empty at {}",
        shot.display()
    );
    println!("screenshot: {}", shot.display());
    g.stop().await;
}

#[tokio::test]
async fn summary_json_describes_the_fleet() {
    let a = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::one_backend("a", "vllm", &a.url()).await;
    let c = client();
    let r = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", true, 8)).await;
    let _ = r.text().await.unwrap();
    let s: serde_json::Value = get_json(&c, g.url("/admin/summary")).await;
    let b = &s["backends"][0];
    assert_eq!(b["name"], "a");
    assert_eq!(b["kind"], "vllm");
    assert_eq!(b["state"], "healthy");
    assert_eq!(b["models"], serde_json::json!(["m"]));
    assert!(b["requests_total"].as_u64().unwrap() >= 1, "{s}");
    for field in [
        "queue_depth",
        "inflight_requests",
        "errors_total",
        "completion_tokens_total",
        "ttft_p50_seconds",
        "ttft_p99_seconds",
    ] {
        assert!(b.get(field).is_some(), "{field} missing: {s}");
    }
    assert!(s["requests_total"].as_f64().unwrap() >= 1.0);
    assert_eq!(s["ready"], true);
    for field in [
        "lines_queued",
        "lines_running",
        "lines_completed",
        "line_seconds",
    ] {
        assert!(s["batch"][field].is_f64(), "batch.{field} missing: {s}");
    }
    assert!(
        !s.to_string().contains("sha256:"),
        "no key hashes in the summary"
    );
    g.stop().await;
}
