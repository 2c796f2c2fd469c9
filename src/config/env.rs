//! `${VAR}` interpolation for secrets and addresses in the config file.
//!
//! Only the `${NAME}` form is recognised (NAME = letters, digits, `_`); `$$` is a literal `$`.
//! A variable that is not set is an error naming the field, never an empty string silently.

/// Where variables come from (the process environment, or a map in tests).
pub trait Env {
    fn get(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl Env for std::collections::HashMap<String, String> {
    fn get(&self, name: &str) -> Option<String> {
        std::collections::HashMap::get(self, name).cloned()
    }
}

/// Expand `${NAME}` references in `value`.
pub fn expand(value: &str, env: &dyn Env) -> Result<String, String> {
    if !value.contains('$') {
        return Ok(value.to_string());
    }
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body
                .find('}')
                .ok_or_else(|| "unterminated `${` reference".to_string())?;
            let name = &body[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(format!("invalid variable name `{name}` in `${{…}}`"));
            }
            let v = env
                .get(name)
                .ok_or_else(|| format!("environment variable `{name}` is not set"))?;
            out.push_str(&v);
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn expands_and_reports() {
        let env: HashMap<String, String> = [("TOKEN".to_string(), "s3cr3t".to_string())].into();
        assert_eq!(expand("Bearer ${TOKEN}", &env).unwrap(), "Bearer s3cr3t");
        assert_eq!(expand("a$$b", &env).unwrap(), "a$b");
        assert_eq!(expand("cost $5", &env).unwrap(), "cost $5");
        assert!(expand("${MISSING}", &env).unwrap_err().contains("MISSING"));
        assert!(expand("${TOKEN", &env).is_err());
        assert!(expand("${BAD-NAME}", &env).is_err());
    }
}
