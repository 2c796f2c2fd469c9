//! The layering check: no module of `src/` names a module of a higher layer.
//!
//! The layer order is the table in docs/architecture.md (between `<!-- layers:begin -->` and
//! `<!-- layers:end -->`); this check reads it from there, so the document and the check cannot
//! disagree. Every `src/**/*.rs` file except the crate roots (`lib.rs`, the module map; `main.rs`,
//! a separate crate) is scanned with comments and literals blanked out for references to
//! top-level modules: `crate::x`, `crate::{x, y}`, `super::` chains that climb out of the
//! file's top-level module, and `sluice::` (never used inside the library).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a module sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rank {
    Layer(u32),
    /// Names only layer-1 modules; named only by the highest layer.
    Standalone,
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rank::Layer(n) => write!(f, "layer {n}"),
            Rank::Standalone => f.write_str("standalone"),
        }
    }
}

/// The layer table, and the names `lib.rs` re-exports at the crate root (name → module).
struct Layers {
    ranks: HashMap<String, Rank>,
    top: u32,
    reexports: HashMap<String, String>,
}

/// Parse the table between the layer markers of docs/architecture.md.
fn parse_table(md: &str) -> Result<HashMap<String, Rank>, String> {
    let start = md
        .find("<!-- layers:begin -->")
        .ok_or("no `<!-- layers:begin -->` marker")?;
    let end = md
        .find("<!-- layers:end -->")
        .ok_or("no `<!-- layers:end -->` marker")?;
    let mut ranks = HashMap::new();
    for line in md[start..end].lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let [layer, module, ..] = cells.as_slice() else {
            return Err(format!("layer table row without two cells: {line}"));
        };
        if *layer == "layer" || layer.starts_with('-') {
            continue;
        }
        let rank = match layer.parse::<u32>() {
            Ok(n) => Rank::Layer(n),
            Err(_) if *layer == "standalone" => Rank::Standalone,
            Err(_) => return Err(format!("`{layer}` is not a layer number: {line}")),
        };
        if ranks.insert(module.to_string(), rank).is_some() {
            return Err(format!("module `{module}` is in the layer table twice"));
        }
    }
    if ranks.is_empty() {
        return Err("the layer table is empty".into());
    }
    Ok(ranks)
}

/// `pub use module::{a, b};` and `pub use module::a;` lines of the crate root.
fn parse_reexports(lib_rs: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let clean = blank(lib_rs);
    for stmt in clean.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim().rsplit(" as ").next().unwrap_or("").trim();
            let name = name.rsplit("::").next().unwrap_or(name);
            if !name.is_empty() {
                out.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

/// `src` with comments, string, byte-string and char literals replaced by spaces (newlines
/// kept, so line numbers stay right).
fn blank(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let keep = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    while i < c.len() {
        let at = |i: usize, k: usize| c.get(i + k).copied().unwrap_or('\0');
        if c[i] == '/' && at(i, 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && at(i, 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i, 1) == '*' {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && at(i, 1) == '/' {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(keep(c[i]));
                    i += 1;
                }
            }
        } else if (c[i] == 'r' || (c[i] == 'b' && at(i, 1) == 'r'))
            && !prev_is_ident(&c, i)
            && raw_string_start(&c, i + usize::from(c[i] == 'b') + 1).is_some()
        {
            let open = i + usize::from(c[i] == 'b') + 1;
            let hashes = raw_string_start(&c, open).unwrap_or(0);
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let body_start = open + hashes + 1;
            let rest: String = c[body_start..].iter().collect();
            let len = rest.find(&close).map_or(c.len() - body_start, |p| {
                rest[..p].chars().count() + close.len()
            });
            for &ch in &c[i..(body_start + len).min(c.len())] {
                out.push(keep(ch));
            }
            i = body_start + len;
        } else if c[i] == '"' {
            out.push(' ');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < c.len() {
                    out.push(keep(c[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c[i] == '\'' && (at(i, 1) == '\\' || (at(i, 1) != '\0' && at(i, 2) == '\'')) {
            // A char literal ('x', '\n', '\u{1F600}'); a lifetime ('a) has no closing quote.
            out.push(' ');
            i += 1;
            if c[i] == '\\' {
                out.push(' ');
                i += 1;
            }
            while i < c.len() && c[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

fn prev_is_ident(c: &[char], i: usize) -> bool {
    i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_')
}

/// At `c[open..]`: `#…#"` opening a raw string? Returns the number of `#`.
fn raw_string_start(c: &[char], open: usize) -> Option<usize> {
    let hashes = c[open.min(c.len())..]
        .iter()
        .take_while(|&&ch| ch == '#')
        .count();
    (c.get(open + hashes) == Some(&'"')).then_some(hashes)
}

/// The module path of a file under `src/`: `fleet/backend.rs` → `[fleet, backend]`,
/// `fleet/mod.rs` → `[fleet]`, `gateway.rs` → `[gateway]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" {
            parts.push(stem.to_string());
        }
    }
    parts
}

/// A token of blanked source: an identifier, `::`, or one other character.
#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Char(char),
}

fn tokens(clean: &str) -> Vec<(usize, Tok)> {
    let mut out = Vec::new();
    for (n, line) in clean.lines().enumerate() {
        let c: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < c.len() {
            if c[i].is_alphabetic() || c[i] == '_' || c[i] == '$' {
                let s = i;
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                let word: String = c[s..i].iter().collect();
                out.push((n + 1, Tok::Ident(word.trim_start_matches('$').to_string())));
            } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
                out.push((n + 1, Tok::Path));
                i += 2;
            } else if c[i].is_whitespace() {
                i += 1;
            } else {
                out.push((n + 1, Tok::Char(c[i])));
                i += 1;
            }
        }
    }
    out
}

/// The top-level modules `src` names, with their lines. `path` is the file's module path.
fn references(path: &[String], src: &str) -> Vec<(usize, String)> {
    let toks = tokens(&blank(src));
    let ident = |k: usize| match toks.get(k) {
        Some((_, Tok::Ident(s))) => Some(s.as_str()),
        _ => None,
    };
    let is = |k: usize, t: &Tok| toks.get(k).map(|(_, x)| x) == Some(t);
    let mut out = Vec::new();
    // Inline `mod name {` blocks open at this brace depth.
    let mut inline: Vec<usize> = Vec::new();
    let mut depth = 0usize;
    let mut k = 0;
    while k < toks.len() {
        let line = toks[k].0;
        match &toks[k].1 {
            Tok::Char('{') => depth += 1,
            Tok::Char('}') => {
                depth = depth.saturating_sub(1);
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
            }
            Tok::Ident(w) if w == "mod" && ident(k + 1).is_some() && is(k + 2, &Tok::Char('{')) => {
                inline.push(depth);
            }
            Tok::Ident(w) if (w == "crate" || w == "sluice") && is(k + 1, &Tok::Path) => {
                let starts_path = k == 0 || !is(k - 1, &Tok::Path);
                if starts_path {
                    if w == "sluice" {
                        out.push((line, "sluice".to_string()));
                    } else {
                        out.extend(first_segments(&toks, k + 2).into_iter().map(|m| (line, m)));
                    }
                }
            }
            Tok::Ident(w) if w == "super" && is(k + 1, &Tok::Path) => {
                let starts_path = k == 0 || !is(k - 1, &Tok::Path);
                if starts_path {
                    let mut ups = 0;
                    let mut j = k;
                    while ident(j) == Some("super") && is(j + 1, &Tok::Path) {
                        ups += 1;
                        j += 2;
                    }
                    if ups >= path.len() + inline.len() {
                        out.extend(first_segments(&toks, j).into_iter().map(|m| (line, m)));
                    }
                    k = j;
                    continue;
                }
            }
            _ => {}
        }
        k += 1;
    }
    out
}

/// The first path segments at `toks[k..]`: `x` for `x::…`, `x` and `y` for `{x::a, y}`.
fn first_segments(toks: &[(usize, Tok)], k: usize) -> Vec<String> {
    match toks.get(k) {
        Some((_, Tok::Ident(s))) if s != "self" => vec![s.clone()],
        Some((_, Tok::Char('{'))) => {
            let mut out = Vec::new();
            let mut depth = 0;
            let mut expect = true;
            for (_, t) in &toks[k + 1..] {
                match t {
                    Tok::Char('{') => depth += 1,
                    Tok::Char('}') if depth == 0 => break,
                    Tok::Char('}') => depth -= 1,
                    Tok::Char(',') if depth == 0 => {
                        expect = true;
                        continue;
                    }
                    Tok::Ident(s) if expect && depth == 0 && s != "self" => out.push(s.clone()),
                    _ => {}
                }
                expect = false;
            }
            out
        }
        _ => Vec::new(),
    }
}

/// Every violation in one file (`rel` is its path under `src/`), as `file:line: message`.
fn check_file(layers: &Layers, rel: &Path, src: &str) -> Vec<String> {
    let path = module_path(rel);
    let Some(own) = path.first() else {
        return Vec::new();
    };
    let shown = format!("src/{}", rel.display());
    let Some(&own_rank) = layers.ranks.get(own) else {
        return vec![format!(
            "{shown}:1: module `{own}` is not in the layer table of docs/architecture.md"
        )];
    };
    let mut out = Vec::new();
    for (line, name) in references(&path, src) {
        if name == "sluice" {
            out.push(format!(
                "{shown}:{line}: `sluice::` inside the library; use `crate::`"
            ));
            continue;
        }
        let target = layers.reexports.get(&name).unwrap_or(&name);
        if target == own {
            continue;
        }
        let Some(&rank) = layers.ranks.get(target) else {
            out.push(format!(
                "{shown}:{line}: {own} names `{name}`, which is not a module of the layer table"
            ));
            continue;
        };
        let allowed = match (own_rank, rank) {
            (Rank::Layer(a), Rank::Layer(b)) => b <= a,
            (Rank::Standalone, Rank::Layer(b)) => b == 1,
            (Rank::Layer(a), Rank::Standalone) => a == layers.top,
            (Rank::Standalone, Rank::Standalone) => false,
        };
        if !allowed {
            out.push(format!(
                "{shown}:{line}: {own} ({own_rank}) names {target} ({rank})"
            ));
        }
    }
    out
}

fn load_layers(root: &Path) -> Layers {
    let md = std::fs::read_to_string(root.join("docs/architecture.md"))
        .unwrap_or_else(|e| panic!("docs/architecture.md: {e}"));
    let ranks = parse_table(&md).unwrap_or_else(|e| panic!("docs/architecture.md: {e}"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap_or_default();
    layers_from(ranks, &lib)
}

fn layers_from(ranks: HashMap<String, Rank>, lib_rs: &str) -> Layers {
    let top = ranks
        .values()
        .filter_map(|r| match r {
            Rank::Layer(n) => Some(*n),
            Rank::Standalone => None,
        })
        .max()
        .unwrap_or(0);
    Layers {
        ranks,
        top,
        reexports: parse_reexports(lib_rs),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_module_names_a_higher_layer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let layers = load_layers(root);
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap_or(f);
        if rel == Path::new("lib.rs") || rel == Path::new("main.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        violations.extend(check_file(&layers, rel, &text));
    }
    assert!(
        files.len() > 50,
        "only {} files found under src/",
        files.len()
    );
    assert!(
        violations.is_empty(),
        "imports against the layer order of docs/architecture.md:\n{}",
        violations.join("\n")
    );
}

#[cfg(test)]
mod check {
    use super::*;

    const TABLE: &str = "intro\n<!-- layers:begin -->\n| layer | module | owns |\n|---|---|---|\n\
        | 1 | telemetry | names |\n| 8 | fleet | backends |\n| 13 | gateway | state |\n\
        | 15 | server | accept |\n| 17 | demo | demo |\n| standalone | sim | simulator |\n\
        <!-- layers:end -->\n";

    fn layers() -> Layers {
        layers_from(
            parse_table(TABLE).unwrap(),
            "pub mod fleet;\npub use gateway::{Gateway, serve as run};\n",
        )
    }

    fn check(rel: &str, src: &str) -> Vec<String> {
        check_file(&layers(), Path::new(rel), src)
    }

    #[test]
    fn a_lower_layer_naming_a_higher_one_is_reported_with_file_line_and_layers() {
        let v = check(
            "fleet/backend.rs",
            "use std::sync::Arc;\n\nuse crate::server::shards;\n",
        );
        assert_eq!(
            v,
            ["src/fleet/backend.rs:3: fleet (layer 8) names server (layer 15)"]
        );
    }

    #[test]
    fn groups_paths_in_code_and_reexports_count() {
        let v = check(
            "fleet/mod.rs",
            "use crate::{telemetry, gateway::Gateway};\nfn f() { let _ = crate::server::x(); }\n\
             fn g() -> crate::Gateway { todo!() }\nfn h() { crate::run(); }\n",
        );
        assert_eq!(
            v,
            [
                "src/fleet/mod.rs:1: fleet (layer 8) names gateway (layer 13)",
                "src/fleet/mod.rs:2: fleet (layer 8) names server (layer 15)",
                "src/fleet/mod.rs:3: fleet (layer 8) names gateway (layer 13)",
                "src/fleet/mod.rs:4: fleet (layer 8) names gateway (layer 13)",
            ]
        );
    }

    #[test]
    fn super_that_climbs_out_of_the_module_counts() {
        let v = check("gateway.rs", "use super::server::routes;\n");
        assert_eq!(
            v,
            ["src/gateway.rs:1: gateway (layer 13) names server (layer 15)"]
        );
        let v = check(
            "fleet/backend.rs",
            "use super::load;\nuse super::super::gateway::Gateway;\n",
        );
        assert_eq!(
            v,
            ["src/fleet/backend.rs:2: fleet (layer 8) names gateway (layer 13)"]
        );
        // Inside an inline module one more `super` stays in the file's own module.
        let v = check(
            "fleet/mod.rs",
            "mod tests {\n    use super::*;\n    use super::super::server::x;\n}\nuse super::gateway::y;\n",
        );
        assert_eq!(
            v,
            [
                "src/fleet/mod.rs:3: fleet (layer 8) names server (layer 15)",
                "src/fleet/mod.rs:5: fleet (layer 8) names gateway (layer 13)",
            ]
        );
    }

    #[test]
    fn comments_and_literals_are_not_references() {
        let src = "//! See [`crate::server`].\n/* crate::gateway /* nested crate::server */ */\n\
                   fn f() -> &'static str { let _c = '\"'; \"crate::server::x\" }\n\
                   const R: &str = r#\"crate::gateway \"quoted\" \"#;\nuse crate::telemetry;\n";
        assert_eq!(check("fleet/x.rs", src), Vec::<String>::new());
    }

    #[test]
    fn the_same_or_a_lower_layer_is_fine() {
        let v = check(
            "server/mod.rs",
            "use crate::gateway::Gateway;\nuse crate::fleet;\nuse crate::server::tls;\n",
        );
        assert_eq!(v, Vec::<String>::new());
    }

    #[test]
    fn standalone_modules_and_unknown_ones() {
        assert_eq!(
            check("sim/mod.rs", "use crate::telemetry::logs;\n"),
            Vec::<String>::new()
        );
        assert_eq!(
            check("sim/mod.rs", "use crate::fleet::Backend;\n"),
            ["src/sim/mod.rs:1: sim (standalone) names fleet (layer 8)"]
        );
        assert_eq!(check("demo.rs", "use crate::sim;\n"), Vec::<String>::new());
        assert_eq!(
            check("gateway.rs", "use crate::sim;\n"),
            ["src/gateway.rs:1: gateway (layer 13) names sim (standalone)"]
        );
        assert_eq!(
            check("newthing/mod.rs", "\n"),
            ["src/newthing/mod.rs:1: module `newthing` is not in the layer table of docs/architecture.md"]
        );
        assert_eq!(
            check("fleet/mod.rs", "fn f() { sluice::run(); }\n"),
            ["src/fleet/mod.rs:1: `sluice::` inside the library; use `crate::`"]
        );
    }

    #[test]
    fn a_table_without_markers_or_with_a_bad_layer_is_an_error() {
        assert!(parse_table("| 1 | telemetry | x |").is_err());
        assert!(
            parse_table("<!-- layers:begin -->\n| one | telemetry | x |\n<!-- layers:end -->")
                .is_err()
        );
    }
}
