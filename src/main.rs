//! The `sluice` command: parses flags and wires signals; everything else lives in the library.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::net::TcpListener;

/// mimalloc instead of the system allocator: a request allocates a few hundred small blocks,
/// and glibc's malloc/free were over a quarter of the instructions per request (callgrind,
/// bench/README.md "Hot path"). Built with `no_thp`: otherwise mimalloc asks for transparent
/// huge pages on its arenas, and where the kernel grants them on request (THP "madvise" mode)
/// each touched arena region costs 2 MiB of resident memory — idle RSS was 21 MB instead of 11,
/// and an open stream 64 KB instead of 44 KB.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "An OpenAI-compatible gateway for a fleet of inference servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once at start; boxing the simulator's many flags would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Run the gateway.
    Serve {
        #[arg(long, env = "SLUICE_CONFIG", default_value = "config/sluice.toml")]
        config: PathBuf,
    },
    /// Run the gateway in front of an embedded simulated fleet, ready to curl.
    Demo(sluice::demo::DemoArgs),
    /// Run a simulated backend (vLLM, TGI or Ollama).
    Sim(sluice::sim::SimArgs),
    /// Validate a config file and print every problem with its location.
    Check {
        #[arg(long, env = "SLUICE_CONFIG", default_value = "config/sluice.toml")]
        config: PathBuf,
    },
    /// Manage API keys.
    Key {
        #[command(subcommand)]
        action: KeyAction,
    },
    /// Size a fleet: the smallest number of servers of each candidate kind meeting an SLO for a
    /// workload, with latencies, utilisation, cost and the N+1 answer (see
    /// docs/capacity-planning.md and examples/plan.toml).
    Plan {
        /// The plan file (TOML): workload, SLO, model, candidates, costs.
        plan: PathBuf,
        /// Also write a self-contained HTML report (charts) here.
        #[arg(long)]
        html: Option<PathBuf>,
        /// Also write the answer as JSON here (every evaluated fleet size of every candidate).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Scale the workload's traffic (a recorded trace: ×N copies; described: N × the rate).
        #[arg(long)]
        scale: Option<f64>,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
    /// GET a URL and exit 0 on a 2xx answer (a container HEALTHCHECK without curl).
    Probe {
        #[arg(long, default_value = "http://127.0.0.1:8080/healthz")]
        url: String,
        /// Give up after this long, e.g. "2s".
        #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

#[derive(Subcommand)]
enum KeyAction {
    /// Mint a new API key; prints the key once and the hash for the config.
    New {
        #[arg(long)]
        name: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Key {
            action: KeyAction::New { name },
        } => {
            let (key, hash) = sluice::auth::mint();
            println!("key: {key}");
            println!("hash: {hash}");
            let name = name.unwrap_or_else(|| "NAME".to_string());
            eprintln!("\nAdd to the config (the key itself is not stored anywhere):\n\n[[keys]]\nname = \"{name}\"\nhash = \"{hash}\"");
            Ok(())
        }
        Command::Plan {
            plan,
            html,
            json,
            scale,
            quiet,
        } => run_plan(&plan, html.as_deref(), json.as_deref(), scale, quiet),
        Command::Probe { url, timeout } => runtime()?.block_on(probe(url, timeout)),
        Command::Serve { config } => runtime()?.block_on(serve(config)),
        Command::Demo(args) => runtime()?.block_on(async move {
            sluice::telemetry::logs::init();
            sluice::demo::run(args, shutdown_signal())
                .await
                .context("demo failed")
        }),
        Command::Sim(args) => runtime()?.block_on(async move {
            sluice::telemetry::logs::init();
            let config = args.into_config()?;
            let addr = config.bind_addr();
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            sluice::sim::run(listener, config, shutdown_signal()).await?;
            Ok(())
        }),
    }
}

fn run_plan(
    path: &std::path::Path,
    html: Option<&std::path::Path>,
    json: Option<&std::path::Path>,
    scale: Option<f64>,
    quiet: bool,
) -> anyhow::Result<()> {
    let mut input = sluice::plan::input::load(path)?;
    if let Some(f) = scale {
        input.scale(f)?;
    }
    let started = std::time::Instant::now();
    let progress = |name: &str, n: usize, st: &sluice::plan::search::Stats| {
        if !quiet {
            eprintln!(
                "[{:>6.1}s] {name}: {n} servers -> p99 TTFT {}, p99 TPOT {}",
                started.elapsed().as_secs_f64(),
                sluice::plan::search::secs(st.ttft_p99),
                sluice::plan::search::secs(st.tpot_p99)
            );
        }
    };
    let report = sluice::plan::plan(&input, &progress)?;
    print!("{}", sluice::plan::report::text(&report));
    if let Some(out) = html {
        std::fs::write(out, sluice::plan::report::html(&report))
            .with_context(|| format!("cannot write {}", out.display()))?;
        if !quiet {
            eprintln!("report written to {}", out.display());
        }
    }
    if let Some(out) = json {
        std::fs::write(out, sluice::plan::report::json(&report))
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn check(path: &std::path::Path) -> anyhow::Result<()> {
    match sluice::config::load(path) {
        Ok(c) => {
            println!(
                "{}: ok ({} backends, {} models, {} keys)",
                path.display(),
                c.backends.len(),
                c.models.len(),
                c.keys.len()
            );
            // the check loaded every tokenizer folder; say which
            for m in &c.models {
                if let Some(t) = &m.tokenizer {
                    println!("model {}: tokenizer {}", m.name, t.dir().display());
                }
            }
            Ok(())
        }
        Err(e) => {
            for p in e.problems() {
                eprintln!("{p}");
            }
            std::process::exit(1);
        }
    }
}

async fn serve(path: PathBuf) -> anyhow::Result<()> {
    sluice::telemetry::logs::init();
    let config = match sluice::config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            for p in e.problems() {
                eprintln!("{p}");
            }
            anyhow::bail!("{} is not valid; nothing was started", path.display());
        }
    };
    let addr = config.server.listen;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let admin = match &config.admin {
        Some(a) => Some(
            TcpListener::bind(a.listen)
                .await
                .with_context(|| format!("cannot listen on {} (admin)", a.listen))?,
        ),
        None => None,
    };
    let (_gw, serving) = sluice::app::start(
        config,
        sluice::app::Listeners {
            client: listener,
            admin,
        },
        Some(path),
        shutdown_signal(),
    );
    serving.await;
    tracing::info!("stopped");
    Ok(())
}

/// `sluice probe`: plain-HTTP GET; exit 0 on 2xx, 1 otherwise (with the reason on stderr).
async fn probe(url: String, timeout: std::time::Duration) -> anyhow::Result<()> {
    use http_body_util::{BodyExt, Empty};
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("`{url}` is not a URL"))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let answer = tokio::time::timeout(timeout, async {
        let resp = client.get(uri).await?;
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        Ok::<_, hyper_util::client::legacy::Error>(status)
    })
    .await;
    match answer {
        Ok(Ok(status)) if status.is_success() => Ok(()),
        Ok(Ok(status)) => {
            eprintln!("{url}: {status}");
            std::process::exit(1)
        }
        Ok(Err(e)) => {
            eprintln!("{url}: {e}");
            std::process::exit(1)
        }
        Err(_) => {
            eprintln!("{url}: no answer within {timeout:?}");
            std::process::exit(1)
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutdown requested; draining");
}
