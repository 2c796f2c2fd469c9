//! `[[passthrough]]` and `[[groups]]`: paths under `/v1/` that Sluice does not serve itself,
//! forwarded as they are, routed by a model field of the body or to a named group of backends.
//!
//! Invariants of a checked rule: its prefix is a clean path under `/v1/` (no trailing slash,
//! query, `..` or empty segment) that neither is nor lies below a path Sluice serves (those
//! always win), prefixes are unique, exactly one target is named, a group names only configured
//! backends, and a rule routed by a model field takes only methods that carry a body. The rules
//! come out longest prefix first, so the first match is the most specific.

use std::collections::HashSet;

use http::Method;

use super::Problems;
use crate::config::file::{FileConfig, GroupSection};
use crate::config::runtime::{PassTarget, PassthroughRule};

/// Paths under `/v1/` Sluice serves itself (a rule may not take them or what is below them).
/// `proxy::passthrough`'s tests check this list against every client API.
pub const SERVED: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

const METHODS: &[&str] = &["GET", "POST", "PUT", "PATCH", "DELETE"];
const WITH_BODY: &[&str] = &["POST", "PUT", "PATCH"];

pub(super) fn rules(p: &mut Problems, f: &FileConfig) -> Vec<PassthroughRule> {
    let groups = groups(p, f);
    let mut prefixes = HashSet::new();
    let mut out = Vec::new();
    for (i, r) in f.passthrough.iter().enumerate() {
        let at = format!("passthrough[{i}]");
        let prefix_ok = prefix(p, &at, &r.prefix);
        if prefix_ok && !prefixes.insert(r.prefix.clone()) {
            p.push(
                format!("{at}.prefix"),
                format!("`{}` is used by another rule", r.prefix),
            );
        }
        let target = match (&r.model_field, &r.group) {
            (Some(field), None) if field.trim().is_empty() => {
                p.push(format!("{at}.model_field"), "is empty");
                None
            }
            (Some(field), None) => Some(PassTarget::ModelField(field.clone())),
            (None, Some(name)) => match groups.iter().find(|g| g.name == *name) {
                Some(g) => Some(PassTarget::Group {
                    name: g.name.clone(),
                    backends: g.backends.clone(),
                }),
                None => {
                    p.push(
                        format!("{at}.group"),
                        format!("no [[groups]] entry is named `{name}`"),
                    );
                    None
                }
            },
            _ => {
                p.push(
                    &at,
                    "name exactly one of `model_field` (route by the body's model) and `group` \
                     (send to a named group of backends)",
                );
                None
            }
        };
        let methods = methods(p, &at, r.methods.as_deref(), &target);
        if let (true, Some(target)) = (prefix_ok, target) {
            out.push(PassthroughRule {
                prefix: r.prefix.clone(),
                target,
                methods,
            });
        }
    }
    out.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
    out
}

/// Whether `prefix` is a clean path under `/v1/` that Sluice does not serve.
fn prefix(p: &mut Problems, at: &str, prefix: &str) -> bool {
    let at = format!("{at}.prefix");
    let Some(rest) = prefix.strip_prefix("/v1/") else {
        p.push(
            at,
            format!("`{prefix}` is not under /v1/ (only /v1/ paths can be passed through)"),
        );
        return false;
    };
    let clean = !rest.is_empty()
        && rest
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..")
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~/:@!$&'()+,;=".contains(&b));
    if !clean {
        p.push(
            at,
            format!(
                "`{prefix}` is not a clean path (segments of letters, digits and -._~, no \
                 trailing slash, query or `..`)"
            ),
        );
        return false;
    }
    if let Some(served) = SERVED
        .iter()
        .find(|s| prefix == **s || prefix.starts_with(&format!("{s}/")))
    {
        p.push(
            at,
            format!("`{prefix}` is served by Sluice itself ({served}); a rule cannot take it"),
        );
        return false;
    }
    true
}

fn methods(
    p: &mut Problems,
    at: &str,
    given: Option<&[String]>,
    target: &Option<PassTarget>,
) -> Vec<Method> {
    let given: Vec<String> = match given {
        None => vec!["POST".into()],
        Some([]) => {
            p.push(format!("{at}.methods"), "is empty");
            return Vec::new();
        }
        Some(m) => m.to_vec(),
    };
    let by_model = matches!(target, Some(PassTarget::ModelField(_)));
    let mut out = Vec::new();
    for (j, m) in given.iter().enumerate() {
        let up = m.to_ascii_uppercase();
        if !METHODS.contains(&up.as_str()) {
            p.push(
                format!("{at}.methods[{j}]"),
                format!("`{m}` is not one of {}", METHODS.join(", ")),
            );
        } else if by_model && !WITH_BODY.contains(&up.as_str()) {
            p.push(
                format!("{at}.methods[{j}]"),
                format!("`{m}` carries no body, so it cannot be routed by `model_field`"),
            );
        } else if let Ok(method) = Method::from_bytes(up.as_bytes()) {
            out.push(method);
        }
    }
    out
}

/// `[[groups]]`: unique names, each naming configured backends.
fn groups<'f>(p: &mut Problems, f: &'f FileConfig) -> Vec<&'f GroupSection> {
    let backends: HashSet<&str> = f.backends.iter().map(|b| b.name.as_str()).collect();
    let mut names = HashSet::new();
    let mut out = Vec::new();
    for (i, g) in f.groups.iter().enumerate() {
        let at = format!("groups[{i}]");
        super::unique_name(p, &mut names, &at, &g.name, "group");
        if g.backends.is_empty() {
            p.push(format!("{at}.backends"), "is empty");
        }
        for (j, b) in g.backends.iter().enumerate() {
            if !backends.contains(b.as_str()) {
                p.push(
                    format!("{at}.backends[{j}]"),
                    format!("no [[backends]] entry is named `{b}`"),
                );
            }
        }
        out.push(g);
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::from_str;
    use crate::config::runtime::PassTarget;

    const BACKENDS: &str = "[[backends]]\nname = \"a\"\nkind = \"openai\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n";

    #[test]
    fn good_rules_longest_prefix_first() {
        let text = format!(
            "{BACKENDS}[[groups]]\nname = \"g\"\nbackends = [\"a\"]\n\
             [[passthrough]]\nprefix = \"/v1/classify\"\nmodel_field = \"model\"\n\
             [[passthrough]]\nprefix = \"/v1/classify/fast\"\ngroup = \"g\"\nmethods = [\"get\", \"POST\"]\n"
        );
        let c = from_str(&text, "t").unwrap();
        assert_eq!(c.passthrough.len(), 2);
        assert_eq!(c.passthrough[0].prefix, "/v1/classify/fast");
        assert_eq!(
            c.passthrough[0].target,
            PassTarget::Group {
                name: "g".into(),
                backends: vec!["a".into()]
            }
        );
        assert_eq!(
            c.passthrough[0].methods,
            [http::Method::GET, http::Method::POST]
        );
        assert_eq!(c.passthrough[1].methods, [http::Method::POST]);
        let r = &c.passthrough[1];
        assert!(r.matches("/v1/classify") && r.matches("/v1/classify/x"));
        assert!(!r.matches("/v1/classifyx") && !r.matches("/v1/other"));
    }

    /// Every bad input is a problem with its key path and line.
    #[test]
    fn each_bad_rule_is_a_problem_with_its_line() {
        let cases: &[(&str, &str)] = &[
            ("prefix = \"/api/x\"\nmodel_field = \"model\"", "passthrough[0].prefix: `/api/x` is not under /v1/"),
            ("prefix = \"/v1/\"\nmodel_field = \"model\"", "passthrough[0].prefix: `/v1/` is not a clean path"),
            ("prefix = \"/v1/x/\"\nmodel_field = \"model\"", "is not a clean path"),
            ("prefix = \"/v1/x/../y\"\nmodel_field = \"model\"", "is not a clean path"),
            ("prefix = \"/v1/x?y=1\"\nmodel_field = \"model\"", "is not a clean path"),
            ("prefix = \"/v1/chat/completions\"\nmodel_field = \"model\"", "is served by Sluice itself"),
            ("prefix = \"/v1/responses/x\"\nmodel_field = \"model\"", "is served by Sluice itself (/v1/responses)"),
            ("prefix = \"/v1/x\"", "passthrough[0]: name exactly one of"),
            ("prefix = \"/v1/x\"\nmodel_field = \"model\"\ngroup = \"g\"", "name exactly one of"),
            ("prefix = \"/v1/x\"\nmodel_field = \" \"", "passthrough[0].model_field: is empty"),
            ("prefix = \"/v1/x\"\ngroup = \"nope\"", "passthrough[0].group: no [[groups]] entry is named `nope`"),
            ("prefix = \"/v1/x\"\nmodel_field = \"model\"\nmethods = [\"GET\"]", "passthrough[0].methods[0]: `GET` carries no body"),
            ("prefix = \"/v1/x\"\ngroup = \"g\"\nmethods = [\"TRACE\"]", "passthrough[0].methods[0]: `TRACE` is not one of"),
            ("prefix = \"/v1/x\"\ngroup = \"g\"\nmethods = []", "passthrough[0].methods: is empty"),
            ("prefix = \"/v1/x\"\ngroup = \"g\"\n[[passthrough]]\nprefix = \"/v1/x\"\ngroup = \"g\"", "passthrough[1].prefix: `/v1/x` is used by another rule"),
            ("prefix = \"/v1/x\"\ngroup = \"g\"\nbackend = \"a\"", "unknown field `backend`"),
        ];
        let groups = "[[groups]]\nname = \"g\"\nbackends = [\"a\"]\n";
        for (rule, want) in cases {
            let text = format!("{BACKENDS}{groups}[[passthrough]]\n{rule}\n");
            let problems = from_str(&text, "t.toml").unwrap_err().problems().join("\n");
            assert!(problems.contains(want), "{rule}:\n{problems}\nwant {want}");
            assert!(problems.contains("line "), "{problems}");
        }
    }

    #[test]
    fn each_bad_group_is_a_problem() {
        for (group, want) in [
            (
                "name = \"g\"\nbackends = [\"zz\"]",
                "groups[0].backends[0]: no [[backends]] entry is named `zz`",
            ),
            (
                "name = \"g\"\nbackends = []",
                "groups[0].backends: is empty",
            ),
            (
                "name = \"\"\nbackends = [\"a\"]",
                "groups[0].name: is empty",
            ),
        ] {
            let text = format!("{BACKENDS}[[groups]]\n{group}\n");
            let problems = from_str(&text, "t.toml").unwrap_err().problems().join("\n");
            assert!(problems.contains(want), "{group}:\n{problems}");
        }
        let dup = format!("{BACKENDS}[[groups]]\nname = \"g\"\nbackends = [\"a\"]\n[[groups]]\nname = \"g\"\nbackends = [\"a\"]\n");
        let problems = from_str(&dup, "t.toml").unwrap_err().problems().join("\n");
        assert!(
            problems.contains("groups[1].name: `g` is used by another group"),
            "{problems}"
        );
    }
}
