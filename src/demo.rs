//! `sluice demo`: a gateway in front of an embedded simulated fleet on loopback — two vLLM sims
//! of different speeds, a TGI sim and an Ollama sim, serving overlapping models — ready to curl.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::config;
use crate::sim::{self, SimConfig, SimKind};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Gateway port.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Simulated fleet speed: F times faster than the default timing model (0 = no delays).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("simulator: {0}")]
    Sim(#[from] sim::SimError),
    #[error("demo config: {0}")]
    Config(#[from] config::ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Run(#[from] crate::app::RunError),
}

/// Start the fleet and the gateway; serve until `shutdown` resolves.
pub async fn run(
    args: DemoArgs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DemoError> {
    let speed = args.speed;
    let fleet = [
        (
            "gpu-a",
            SimKind::Vllm,
            vec!["llama-3.1-8b", "qwen2.5-7b"],
            1.0,
        ),
        ("gpu-b", SimKind::Vllm, vec!["llama-3.1-8b"], 0.5),
        ("tgi-1", SimKind::Tgi, vec!["llama-3.1-8b"], 0.8),
        (
            "laptop",
            SimKind::Ollama,
            vec!["llama3.1:8b", "qwen2.5:7b"],
            0.3,
        ),
    ];
    let mut handles = Vec::new();
    let mut toml = String::new();
    toml.push_str(&format!(
        "[server]\nlisten = \"{}\"\n\n[routing]\npolicy = \"token-aware\"\nexpose_backend_header = true\n\n",
        SocketAddr::new(args.host, args.port)
    ));
    toml.push_str("[[models]]\nname = \"llama-3.1-8b\"\naliases = [\"llama3\"]\n\n[[models]]\nname = \"qwen2.5-7b\"\naliases = [\"qwen\"]\n\n");
    for (name, kind, models, relative_speed) in fleet {
        let cfg = SimConfig::new(kind, models.iter().map(|s| s.to_string()).collect()).speed(
            if speed == 0.0 {
                0.0
            } else {
                speed * relative_speed
            },
        );
        let h = sim::spawn(cfg).await?;
        let (client_models, names) = match kind {
            SimKind::Ollama => (
                "[\"llama-3.1-8b\", \"qwen2.5-7b\"]".to_string(),
                "model_names = { \"llama-3.1-8b\" = \"llama3.1:8b\", \"qwen2.5-7b\" = \"qwen2.5:7b\" }\n".to_string(),
            ),
            _ => (
                format!("[{}]", models.iter().map(|m| format!("\"{m}\"")).collect::<Vec<_>>().join(", ")),
                String::new(),
            ),
        };
        toml.push_str(&format!(
            "[[backends]]\nname = \"{name}\"\nkind = \"{}\"\nurl = \"{}\"\nmodels = {client_models}\n{names}\n",
            kind.as_str(),
            h.url()
        ));
        handles.push(h);
    }
    // The Files and Batches APIs, their files and job state in a folder of this run.
    let batch_dir = std::env::temp_dir().join(format!("sluice-demo-{}", std::process::id()));
    let dir = toml::Value::String(batch_dir.display().to_string());
    toml.push_str(&format!("[batch]\ndir = {dir}\n\n"));
    let config = config::from_str(&toml, "demo")?;
    let addr = config.server.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| DemoError::Bind { addr, source })?;
    let addr = listener.local_addr().unwrap_or(addr);
    println!("# sluice demo: the effective config\n\n{toml}");
    println!("{}", banner(addr));
    let result = crate::app::run(listener, config, shutdown).await;
    for h in handles {
        h.shutdown().await;
    }
    let _ = std::fs::remove_dir_all(&batch_dir);
    tokio::time::sleep(Duration::from_millis(10)).await;
    result.map_err(DemoError::from)
}

/// The chat completions example of the banner (a streamed answer).
pub const CHAT_EXAMPLE: &str =
    r#"{"model":"llama3","stream":true,"messages":[{"role":"user","content":"Hello!"}]}"#;
/// The Responses API example of the banner.
pub const RESPONSES_EXAMPLE: &str = r#"{"model":"llama3","input":"Hello!"}"#;
/// The Anthropic Messages example of the banner.
pub const MESSAGES_EXAMPLE: &str =
    r#"{"model":"llama3","max_tokens":64,"messages":[{"role":"user","content":"Hello!"}]}"#;

/// What `sluice demo` prints once it listens on `addr`: the status page, and a request for
/// each client API family — OpenAI chat completions, OpenAI Responses, Anthropic Messages.
pub fn banner(addr: SocketAddr) -> String {
    let post = |path: &str, extra: &str, body: &str| {
        format!(
            "curl -sN http://{addr}{path} \\\n  -H 'content-type: application/json' \\\n{extra}  -d '{body}'\n"
        )
    };
    let anthropic = "  -H 'anthropic-version: 2023-06-01' \\\n";
    format!(
        "# status page: http://{addr}/dashboard  (metrics: http://{addr}/metrics)\n\n\
         # try it:\n\ncurl -s http://{addr}/v1/models\n\n\
         # OpenAI chat completions, streamed:\n{}\n\
         # OpenAI Responses API:\n{}\n\
         # Anthropic Messages API:\n{}\n\
         # or with the OpenAI Python SDK:\n\
         #   from openai import OpenAI\n\
         #   client = OpenAI(base_url=\"http://{addr}/v1\", api_key=\"unused\")\n\
         #   for chunk in client.chat.completions.create(model=\"llama3\", stream=True,\n\
         #           messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}]):\n\
         #       print(chunk.choices[0].delta.content or \"\", end=\"\")\n",
        post("/v1/chat/completions", "", CHAT_EXAMPLE),
        post("/v1/responses", "", RESPONSES_EXAMPLE),
        post("/v1/messages", anthropic, MESSAGES_EXAMPLE),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_banner_shows_the_status_page_and_each_api() {
        let b = banner("127.0.0.1:8080".parse().unwrap());
        assert!(b.contains("http://127.0.0.1:8080/dashboard"), "{b}");
        for (path, body) in [
            ("/v1/chat/completions", CHAT_EXAMPLE),
            ("/v1/responses", RESPONSES_EXAMPLE),
            ("/v1/messages", MESSAGES_EXAMPLE),
        ] {
            assert!(
                b.contains(&format!("http://127.0.0.1:8080{path} ")),
                "{path}: {b}"
            );
            assert!(b.contains(&format!("-d '{body}'")), "{path}: {b}");
            serde_json::from_str::<serde_json::Value>(body).unwrap();
        }
        assert!(b.contains("anthropic-version"), "{b}");
    }
}
