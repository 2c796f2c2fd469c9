//! The token counts a backend reports in an answer's `usage` object.

use serde::Deserialize;

/// Token counts a backend reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
}
