//! The token counts a backend reports in an answer's `usage` object.

use serde::Deserialize;

/// Token counts a backend reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// Prompt tokens the engine served from its prefix cache, when it reports them
    /// (`prompt_tokens_details.cached_tokens`; vLLM with `--enable-prompt-tokens-details`).
    #[serde(default, rename = "prompt_tokens_details", deserialize_with = "cached")]
    pub cached_tokens: Option<u64>,
}

/// The `cached_tokens` of a `*_tokens_details` object (absent or null: not reported).
pub fn cached<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        #[serde(default)]
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(d)?.and_then(|x| x.cached_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_read_where_reported() {
        let u: Usage = serde_json::from_str(r#"{"prompt_tokens":370,"total_tokens":386,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":256,"created_cache_tokens":0,"multimodal_tokens":null}}"#).unwrap();
        assert_eq!(u.cached_tokens, Some(256));
        for absent in [
            r#"{"prompt_tokens":1,"completion_tokens":2}"#,
            r#"{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":{}}"#,
        ] {
            let u: Usage = serde_json::from_str(absent).unwrap();
            assert_eq!((u.prompt_tokens, u.cached_tokens), (1, None));
        }
    }
}
