//! Where a validation problem's key path (`server.threads`, `backends[2].timeouts.connect`,
//! `server.cors_allow_origins[1]`) is written in the config text, so `sluice check` can name
//! the line as it does for syntax errors.
//!
//! A light reading of the text, not a second TOML parser: table headers (`[a.b]`,
//! `[[backends]]`, counted per name) and `key =` lines (dotted keys too). A path that is not
//! written (a default) gets the line of the closest enclosing entry that is, or none. The
//! answer is a hint for people; validation never depends on it.

/// The line (from 1) where `at` is written in `text`, or where the closest enclosing key or
/// table is.
pub fn line_of(text: &str, at: &str) -> Option<usize> {
    let mut table: Vec<String> = Vec::new();
    let mut counts: Vec<(String, usize)> = Vec::new();
    let mut best: Option<(usize, usize)> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let written = if let Some(h) = line.strip_prefix("[[") {
            let name = key_path(h.split("]]").next().unwrap_or(""));
            let n = match counts.iter_mut().find(|(k, _)| *k == name) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    counts.push((name.clone(), 0));
                    0
                }
            };
            table = vec![format!("{name}[{n}]")];
            table.join(".")
        } else if let Some(h) = line.strip_prefix('[') {
            table = vec![key_path(h.split(']').next().unwrap_or(""))];
            table.join(".")
        } else if let Some((key, _)) = line.split_once('=').filter(|(k, _)| is_key(k)) {
            let mut path = table.clone();
            path.push(key_path(key));
            path.join(".")
        } else {
            continue;
        };
        if encloses(&written, at) && best.is_none_or(|(len, _)| written.len() > len) {
            best = Some((written.len(), i + 1));
        }
    }
    best.map(|(_, line)| line)
}

/// `a . "b"` → `a.b`.
fn key_path(k: &str) -> String {
    k.split('.')
        .map(|s| s.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

/// A bare or quoted (dotted) key, as left of `=`; not a comment or a value line.
fn is_key(k: &str) -> bool {
    let k = k.trim();
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '"' | '\'' | ' '))
}

/// `outer` is `at` or a key or table that contains it.
fn encloses(outer: &str, at: &str) -> bool {
    !outer.is_empty()
        && at
            .strip_prefix(outer)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# comment = no
top = 1
[server]
threads = 0
cors_allow_origins = ["a", "b"]
[[backends]]
name = "a"
[[backends]]
name = "b"
timeouts = { connect = "soon" }
[health]
healthy_threshold = 0
"#;

    #[test]
    fn finds_keys_tables_and_entries() {
        assert_eq!(line_of(TEXT, "top"), Some(2));
        assert_eq!(line_of(TEXT, "server.threads"), Some(4));
        assert_eq!(line_of(TEXT, "server.cors_allow_origins[1]"), Some(5));
        assert_eq!(line_of(TEXT, "backends[1].name"), Some(9));
        assert_eq!(line_of(TEXT, "backends[1].timeouts.connect"), Some(10));
        assert_eq!(line_of(TEXT, "health.healthy_threshold"), Some(12));
    }

    #[test]
    fn unwritten_paths_fall_back_to_their_table_or_nothing() {
        assert_eq!(line_of(TEXT, "backends[0].url"), Some(6));
        assert_eq!(line_of(TEXT, "server.listen"), Some(3));
        assert_eq!(line_of(TEXT, "tls"), None);
        assert_eq!(line_of(TEXT, "topx"), None);
        assert_eq!(line_of("server.threads = 0\n", "server.threads"), Some(1));
    }
}
