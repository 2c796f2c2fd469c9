//! Configuration: the TOML file's serde types ([`file`]), `${ENV}` interpolation ([`env`]),
//! validation ([`validate`], one file per section) into the runtime types ([`runtime`]).
//! Watching the file and applying a changed one is the application's (`app::reload`).
//!
//! Invariants: a file is either accepted whole or rejected with every problem listed with its
//! location (key path, and the line when it is written in the file, see [`locate`]); the
//! runtime `Config` is immutable and shared as `Arc<Config>`; a reload swaps the whole
//! snapshot atomically, so a request finishes on the snapshot it started with.

pub mod env;
pub mod file;
pub mod locate;
pub mod runtime;
pub mod validate;

pub use runtime::{
    AdapterConfig, AdminConfig, BackendConfig, BackendKind, BackendTlsConfig, BatchConfig, Config,
    HealthConfig, KeyConfig, KvEvents, ModelConfig, PassTarget, PassthroughRule, PolicyKind,
    ReloadConfig, RoutingConfig, ServerConfig, Timeouts, TlsConfig,
};

use std::path::Path;

/// Everything wrong with a config file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{}", .0.join("\n"))]
    Invalid(Vec<String>),
}

impl ConfigError {
    /// Each problem on its own line, prefixed with the file name.
    pub fn problems(&self) -> Vec<String> {
        match self {
            ConfigError::Read { .. } => vec![self.to_string()],
            ConfigError::Invalid(v) => v.clone(),
        }
    }
}

/// Read, interpolate and validate a config file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let mut config = from_str(&text, &path.display().to_string())?;
    config.source = Some(path.to_path_buf());
    Ok(config)
}

/// Validate config text; `origin` names it in error messages.
pub fn from_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let file: file::FileConfig = toml::from_str(text).map_err(|e| {
        ConfigError::Invalid(vec![format!("{origin}: {}", describe_toml_error(text, &e))])
    })?;
    validate::validate(file, &env::ProcessEnv).map_err(|errs| {
        ConfigError::Invalid(errs.iter().map(|e| located(text, origin, e)).collect())
    })
}

/// `origin: problem`, with the line where the problem's key path is written, when it is.
fn located(text: &str, origin: &str, problem: &str) -> String {
    let at = problem.split(": ").next().unwrap_or_default();
    match locate::line_of(text, at) {
        Some(line) => format!("{origin}: {problem} (line {line})"),
        None => format!("{origin}: {problem}"),
    }
}

fn describe_toml_error(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim().to_string();
    match e.span() {
        Some(span) => {
            let (line, col) = line_col(text, span.start);
            format!("line {line}, column {col}: {msg}")
        }
        None => msg,
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before
        .rfind('\n')
        .map_or(before.len(), |i| before.len() - i - 1)
        + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_field_reported_with_location() {
        let err =
            from_str("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n", "t.toml").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("t.toml: line 3"), "{text}");
        assert!(text.contains("lisen"), "{text}");
    }

    #[test]
    fn line_col_counts_from_one() {
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("ab", 0), (1, 1));
    }
}
