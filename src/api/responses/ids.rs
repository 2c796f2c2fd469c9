//! Stored-response ids as clients see them: which backend holds the response, which tenant
//! created it, and the backend's own id, in one string every replica decodes the same way.
//!
//! ```text
//! resp_<backend tag><tenant tag>_<backend's id>      e.g. resp_1a2b3c4d5e6f7a8b_resp_be152c5febac0a84
//! ```
//!
//! A tag is the first 4 bytes of SHA-256 of the configured backend name (or the tenant name),
//! as 8 lowercase hex digits: stable across restarts and replicas with the same config, no
//! shared state. Invariants: [`decode`] of [`encode`] gives back the three parts; anything
//! else (an id Sluice did not issue) decodes to `None`, never to a guess.

use sha2::{Digest, Sha256};

/// What every id starts with (the Responses API's own prefix).
pub const PREFIX: &str = "resp_";
/// Hex digits of one tag.
const TAG_LEN: usize = 8;

/// The tag of a backend name or a tenant name.
pub fn tag(name: &str) -> String {
    let digest = Sha256::digest(name.as_bytes());
    hex::encode(&digest[..TAG_LEN / 2])
}

/// The prefix of every id a backend's response gets for a tenant: the client id is this
/// prefix followed by the backend's own id.
pub fn issued_prefix(backend: &str, tenant: &str) -> String {
    format!("{PREFIX}{}{}_", tag(backend), tag(tenant))
}

/// The id the client sees for `backend_id`, held by `backend` for `tenant`.
pub fn encode(backend: &str, tenant: &str, backend_id: &str) -> String {
    format!("{}{backend_id}", issued_prefix(backend, tenant))
}

/// The parts of an id Sluice issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded<'a> {
    pub backend_tag: &'a str,
    pub tenant_tag: &'a str,
    /// The id on the backend that holds the response.
    pub backend_id: &'a str,
}

impl Decoded<'_> {
    /// Whether the response is held by the backend named `name`.
    pub fn held_by(&self, name: &str) -> bool {
        self.backend_tag == tag(name)
    }

    /// Whether the response was created by `tenant`.
    pub fn created_by(&self, tenant: &str) -> bool {
        self.tenant_tag == tag(tenant)
    }
}

/// The parts of `id`, or `None` when Sluice did not issue it.
pub fn decode(id: &str) -> Option<Decoded<'_>> {
    let rest = id.strip_prefix(PREFIX)?;
    let tags = rest.get(..2 * TAG_LEN)?;
    let backend_id = rest.get(2 * TAG_LEN..)?.strip_prefix('_')?;
    let lower_hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    if !tags.bytes().all(lower_hex) || backend_id.is_empty() {
        return None;
    }
    Some(Decoded {
        backend_tag: &tags[..TAG_LEN],
        tenant_tag: &tags[TAG_LEN..],
        backend_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_foreign_ids() {
        let id = encode("vllm-a", "team", "resp_be152c5febac0a84");
        assert!(id.starts_with("resp_") && id.ends_with("_resp_be152c5febac0a84"));
        let d = decode(&id).unwrap();
        assert!(d.held_by("vllm-a") && !d.held_by("vllm-b"));
        assert!(d.created_by("team") && !d.created_by("other"));
        assert_eq!(d.backend_id, "resp_be152c5febac0a84");
        assert_eq!(tag("vllm-a"), tag("vllm-a"), "stable");
        assert_eq!(tag("vllm-a").len(), 8);
        for foreign in [
            "resp_be152c5febac0a84",
            "resp_doesnotexist",
            "resp_",
            "",
            "msg_1234",
            "resp_1a2b3c4d5e6f7a8b",
            "resp_1a2b3c4d5e6f7a8b_",
            "resp_1A2B3C4D5E6F7A8B_x",
            "resp_1a2b3c4d5e6f7a8bx_y",
            "resp_é1a2b3c4d5e6f7a8_x",
        ] {
            assert_eq!(decode(foreign), None, "{foreign}");
        }
    }
}
