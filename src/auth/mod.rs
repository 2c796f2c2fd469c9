//! API keys and the tenants they belong to.
//!
//! Keys are never stored: the config holds `sha256:<hex>` of each key, and a presented key is
//! hashed and looked up by its hash, then compared in constant time. With no keys configured the
//! gateway is open (the localhost sidecar case) and every caller is the `anonymous` tenant.
//! Accepted as `Authorization: Bearer <key>` (what the OpenAI SDKs send) or `x-api-key: <key>`.
//!
//! Timing: a presented key is hashed whole and looked up by its digest, so how long the lookup
//! takes does not depend on how much of a real key the guess shares; a wrong key and an unknown
//! one (any length, any prefix) take the same path and get the same answer. The key itself is
//! never logged: only the key's configured name and tenant travel further ([`Identity`]), and
//! the limits of [`crate::limits`] and the backend wait queue use those names.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, StatusCode};
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{Config, KeyConfig};
use crate::fleet::Fleet;
use crate::openai::ApiError;

/// The prefix of keys minted by `sluice key new`.
pub const KEY_PREFIX: &str = "sk-sluice-";

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The key's name, or `anonymous` on an open gateway.
    pub key: String,
    pub tenant: String,
    /// `None` on an open gateway.
    pub config: Option<Arc<KeyConfig>>,
}

impl Identity {
    pub fn anonymous() -> Identity {
        Identity {
            key: "anonymous".into(),
            tenant: "anonymous".into(),
            config: None,
        }
    }

    /// Whether this identity may use `model` (client name, alias or LoRA adapter): its
    /// allow-list names it, or names `base:*` for its base model (the base and all its
    /// adapters).
    pub fn allows(&self, fleet: &Fleet, model: &str) -> bool {
        match &self.config {
            None => true,
            Some(k) if k.models.is_empty() => true,
            Some(k) => k.models.iter().any(|m| fleet.allowed_by(model, m)),
        }
    }
}

/// A request the gateway makes itself on behalf of a key it authenticated before (a batch's
/// line runs as the key that created the batch). It travels only in a request's
/// `http::Extensions`, which only the gateway's own code can fill: no header, nothing a client
/// sends, can carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActingAs {
    key: String,
}

impl ActingAs {
    /// On behalf of the key named `key` (its `[[keys]] name`; `anonymous` on an open gateway).
    pub fn key(key: &str) -> ActingAs {
        ActingAs {
            key: key.to_string(),
        }
    }
}

/// The keys of one config snapshot.
#[derive(Debug, Default)]
pub struct KeyStore {
    by_hash: HashMap<[u8; 32], Arc<KeyConfig>>,
}

impl KeyStore {
    pub fn new(config: &Config) -> KeyStore {
        KeyStore {
            by_hash: config
                .keys
                .iter()
                .map(|k| (k.hash, Arc::new(k.clone())))
                .collect(),
        }
    }

    /// No keys configured: anyone may call.
    pub fn is_open(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The identity of a request: the key named by its [`ActingAs`] extension when the gateway
    /// made it, else the key its headers present ([`KeyStore::authenticate`]).
    pub fn authenticate_request(
        &self,
        headers: &HeaderMap,
        extensions: &http::Extensions,
    ) -> Result<Identity, ApiError> {
        match extensions.get::<ActingAs>() {
            Some(acting) => self.acting_as(acting),
            None => self.authenticate(headers),
        }
    }

    /// The identity of the key `acting` names, as it is configured now: a key since removed,
    /// disabled or expired is refused as a presented one would be.
    fn acting_as(&self, acting: &ActingAs) -> Result<Identity, ApiError> {
        if self.is_open() {
            return Ok(Identity::anonymous());
        }
        let k = self
            .by_hash
            .values()
            .find(|k| k.name == acting.key)
            .ok_or_else(|| unauthorized("The API key that created this batch no longer exists."))?;
        if k.disabled {
            return Err(unauthorized("This API key has been disabled."));
        }
        if k.expires_at.is_some_and(|t| t <= SystemTime::now()) {
            return Err(unauthorized("This API key has expired."));
        }
        Ok(Identity {
            key: k.name.clone(),
            tenant: k.tenant.clone(),
            config: Some(k.clone()),
        })
    }

    /// The identity behind the request's key.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Identity, ApiError> {
        if self.is_open() {
            return Ok(Identity::anonymous());
        }
        let presented = presented_key(headers).ok_or_else(|| {
            unauthorized("You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
        })?;
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        // Look up by hash (the hash of a secret leaks nothing), then compare in constant time,
        // and do the same amount of work for unknown keys.
        let found = self.by_hash.get(&digest);
        let reference = found.map(|k| k.hash).unwrap_or([0u8; 32]);
        let equal: bool = reference.ct_eq(&digest).into();
        match found {
            Some(k) if equal => {
                if k.disabled {
                    return Err(unauthorized("This API key has been disabled."));
                }
                if k.expires_at.is_some_and(|t| t <= SystemTime::now()) {
                    return Err(unauthorized("This API key has expired."));
                }
                Ok(Identity {
                    key: k.name.clone(),
                    tenant: k.tenant.clone(),
                    config: Some(k.clone()),
                })
            }
            _ => Err(unauthorized("Incorrect API key provided.")),
        }
    }
}

/// The answer for a model outside the key's allow-list: 403 `model_not_allowed`, or with
/// `[auth] hide_disallowed_models` the same 404 `model_not_found` as for a model that does not
/// exist, so a key cannot learn which names exist.
pub fn model_refused(model: &str, hide: bool) -> ApiError {
    if hide {
        return ApiError::model_not_found(model);
    }
    ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        format!("This API key is not allowed to use the model `{model}`."),
    )
    .with_param("model")
    .with_code("model_not_allowed")
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        .with_code("invalid_api_key")
}

fn presented_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let v = v.trim();
        let (scheme, rest) = v.split_once(' ')?;
        if scheme.eq_ignore_ascii_case("bearer") && !rest.trim().is_empty() {
            return Some(rest.trim());
        }
        return None;
    }
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// A new random key and the hash line for the config.
pub fn mint() -> (String, String) {
    let mut bytes = [0u8; 24];
    rand::rng().fill_bytes(&mut bytes);
    let key = format!("{KEY_PREFIX}{}", hex::encode(bytes));
    let hash = hash_line(&key);
    (key, hash)
}

/// `sha256:<hex>` of a key string.
pub fn hash_line(key: &str) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(key.as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_str;

    fn store(extra: &str) -> (KeyStore, String) {
        let (key, hash) = mint();
        let cfg = from_str(
            &format!("[[keys]]\nname = \"alice\"\nhash = \"{hash}\"\nmodels = [\"m1\"]\n{extra}"),
            "t",
        )
        .unwrap();
        (KeyStore::new(&cfg), key)
    }

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn acting_as_comes_from_extensions_only_and_follows_the_key() {
        let (s, key) = store("");
        let mut ext = http::Extensions::new();
        // no header: refused as any keyless request
        assert!(s.authenticate_request(&HeaderMap::new(), &ext).is_err());
        ext.insert(ActingAs::key("alice"));
        let id = s.authenticate_request(&HeaderMap::new(), &ext).unwrap();
        assert_eq!((id.key.as_str(), id.tenant.as_str()), ("alice", "alice"));
        // a header cannot name a key to act as
        let h = headers(&[("authorization", "Bearer alice".into())]);
        assert!(s
            .authenticate_request(&h, &http::Extensions::new())
            .is_err());
        let ok = headers(&[("authorization", format!("Bearer {key}"))]);
        assert!(s
            .authenticate_request(&ok, &http::Extensions::new())
            .is_ok());
        let mut gone = http::Extensions::new();
        gone.insert(ActingAs::key("bob"));
        let e = s
            .authenticate_request(&HeaderMap::new(), &gone)
            .unwrap_err();
        assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        let (disabled, _) = store("disabled = true");
        assert!(disabled
            .authenticate_request(&HeaderMap::new(), &ext)
            .is_err());
        let open = KeyStore::default();
        assert_eq!(
            open.authenticate_request(&HeaderMap::new(), &gone)
                .unwrap()
                .key,
            "anonymous"
        );
    }

    #[test]
    fn minted_keys_are_prefixed_and_hash_matches() {
        let (key, hash) = mint();
        assert!(key.starts_with(KEY_PREFIX));
        assert_eq!(key.len(), KEY_PREFIX.len() + 48);
        assert_eq!(hash, hash_line(&key));
        assert_ne!(mint().0, key);
    }

    #[test]
    fn bearer_and_x_api_key() {
        let (s, key) = store("");
        let id = s
            .authenticate(&headers(&[("authorization", format!("Bearer {key}"))]))
            .unwrap();
        assert_eq!(id.tenant, "alice");
        assert!(s
            .authenticate(&headers(&[("x-api-key", key.clone())]))
            .is_ok());
        for bad in [
            headers(&[]),
            headers(&[("authorization", "Bearer sk-sluice-nope".into())]),
            headers(&[("authorization", format!("Basic {key}"))]),
            headers(&[("authorization", "Bearer ".into())]),
        ] {
            let e = s.authenticate(&bad).unwrap_err();
            assert_eq!(e.status, StatusCode::UNAUTHORIZED);
        }
    }

    #[test]
    fn disabled_and_expired() {
        let (s, key) = store("disabled = true\n");
        let e = s.authenticate(&headers(&[("x-api-key", key)])).unwrap_err();
        assert!(e.message.contains("disabled"));
        let (s, key) = store("expires_at = \"2001-01-01T00:00:00Z\"\n");
        let e = s.authenticate(&headers(&[("x-api-key", key)])).unwrap_err();
        assert!(e.message.contains("expired"));
    }

    #[test]
    fn refused_model_can_be_hidden() {
        assert_eq!(model_refused("m", false).status, StatusCode::FORBIDDEN);
        assert_eq!(model_refused("m", true), ApiError::model_not_found("m"));
    }

    #[test]
    fn wrong_and_unknown_keys_get_the_same_answer() {
        let (s, key) = store("");
        let mut wrong = key.clone();
        wrong.pop();
        wrong.push(if key.ends_with('0') { '1' } else { '0' });
        let a = s
            .authenticate(&headers(&[("x-api-key", wrong)]))
            .unwrap_err();
        let b = s
            .authenticate(&headers(&[("x-api-key", "whatever".into())]))
            .unwrap_err();
        assert_eq!(a, b);
    }

    #[test]
    fn open_when_no_keys() {
        let s = KeyStore::new(&Config::empty());
        assert!(s.is_open());
        assert_eq!(
            s.authenticate(&HeaderMap::new()).unwrap().tenant,
            "anonymous"
        );
    }
}
