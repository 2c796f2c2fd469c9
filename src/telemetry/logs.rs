//! Log setup: pretty on a terminal, JSON with `SLUICE_LOG_FORMAT=json`, filter with `SLUICE_LOG`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Install the global subscriber (once; later calls are ignored).
pub fn init() {
    let filter = EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info,hyper=warn,h2=warn,rustls=warn"));
    let format = std::env::var("SLUICE_LOG_FORMAT").unwrap_or_default();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = if format.eq_ignore_ascii_case("json") {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .try_init()
    };
    let _ = result;
}
