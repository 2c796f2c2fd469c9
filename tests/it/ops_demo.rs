//! `sluice demo` (issue 32 item 5): what its banner shows works — the status page and the
//! chat completions, Responses and Anthropic Messages examples, sent as printed to the demo's
//! own fleet.

use std::time::Duration;

use sluice::demo::{self, DemoArgs};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_banners_status_page_and_examples_answer() {
    let port = free_port();
    let args = DemoArgs {
        port,
        host: "127.0.0.1".parse().unwrap(),
        speed: 0.0,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let demo = tokio::spawn(demo::run(args, async move {
        let _ = stopped.await;
    }));
    let base = format!("http://127.0.0.1:{port}");
    let c = client();
    eventually(Duration::from_secs(15), "the demo ready", || {
        let (c, url) = (c.clone(), format!("{base}/readyz"));
        async move { c.get(url).send().await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    let banner = demo::banner(format!("127.0.0.1:{port}").parse().unwrap());
    let dashboard = format!("{base}/dashboard");
    assert!(banner.contains(&dashboard), "{banner}");
    assert_eq!(c.get(&dashboard).send().await.unwrap().status(), 200);
    for (path, body) in [
        ("/v1/chat/completions", demo::CHAT_EXAMPLE),
        ("/v1/responses", demo::RESPONSES_EXAMPLE),
        ("/v1/messages", demo::MESSAGES_EXAMPLE),
    ] {
        let resp = c
            .post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}");
        assert!(!text.is_empty(), "{path}: an empty answer");
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(40), demo).await;
}
