//! Who may use the operations endpoints: one extractor, [`AdminAuth`], that every admin handler
//! takes, and one constant-time token comparison, [`token_matches`].
//!
//! Invariants: when an admin token is configured, a request passes only by presenting it (as
//! `Authorization: Bearer`, or for the dashboard page as `?token=`). Without a token,
//! operations are open only where the listener serving them is loopback: an `[admin]` listener
//! off loopback needs a token (config validation), and operations sharing a non-loopback client
//! listener are refused (403). The configured token is read from the request's config
//! snapshot, so a reload applies to the next request.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::config::Config;
use crate::gateway::Gateway;
use crate::openai::ApiError;

/// Proof that the request may use the operations endpoints; a handler taking it runs only then.
#[derive(Debug)]
pub struct AdminAuth(());

/// Why a request may not use the operations endpoints.
#[derive(Debug)]
pub enum AdminRefusal {
    /// Operations share a non-loopback client listener and no admin token is configured: 403.
    NoToken,
    /// A token is configured and the request did not present it: 401. Holds the configured
    /// token, for [`AdminRefusal::or_query_token`].
    WrongToken(String),
}

/// Operations on a client listener reachable beyond this host with no admin token: refused.
pub fn ops_exposed_without_token(config: &Config) -> bool {
    config.admin.is_none() && !config.server.listen.ip().is_loopback()
}

/// Whether `presented` is the configured `token`, in time independent of where they differ.
pub fn token_matches(presented: &str, token: &str) -> bool {
    use subtle::ConstantTimeEq;
    presented.as_bytes().ct_eq(token.as_bytes()).into()
}

impl AdminAuth {
    /// The check itself, on the request's config snapshot and headers.
    pub fn check(config: &Config, headers: &HeaderMap) -> Result<AdminAuth, AdminRefusal> {
        let Some(token) = config.admin.as_ref().and_then(|a| a.token.as_deref()) else {
            if ops_exposed_without_token(config) {
                return Err(AdminRefusal::NoToken);
            }
            return Ok(AdminAuth(()));
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if token_matches(presented, token) {
            Ok(AdminAuth(()))
        } else {
            Err(AdminRefusal::WrongToken(token.to_string()))
        }
    }
}

impl AdminRefusal {
    /// A second chance for the dashboard page, which a browser opens without headers: the
    /// configured token given as `presented` (from `?token=`) passes too. Only a configured
    /// token may stand in for the header; a [`AdminRefusal::NoToken`] stays refused.
    pub fn or_query_token(self, presented: &str) -> Result<AdminAuth, AdminRefusal> {
        match &self {
            AdminRefusal::WrongToken(token) if token_matches(presented, token) => Ok(AdminAuth(())),
            _ => Err(self),
        }
    }
}

impl IntoResponse for AdminRefusal {
    fn into_response(self) -> Response {
        match self {
            AdminRefusal::NoToken => ApiError::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                "Operations endpoints are disabled on a non-loopback listener without an admin \
                 token; configure [admin] with a token (or a loopback admin listener).",
            )
            .with_code("admin_token_not_configured")
            .into_response(),
            AdminRefusal::WrongToken(_) => ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "admin token required",
            )
            .with_code("invalid_admin_token")
            .into_response(),
        }
    }
}

impl FromRequestParts<Arc<Gateway>> for AdminAuth {
    type Rejection = AdminRefusal;

    async fn from_request_parts(
        parts: &mut Parts,
        gw: &Arc<Gateway>,
    ) -> Result<Self, Self::Rejection> {
        AdminAuth::check(&gw.runtime().config, &parts.headers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdminConfig;
    use http_body_util::BodyExt;

    fn config(listen: &str, admin_token: Option<Option<&str>>) -> Config {
        let mut c = Config::empty();
        c.server.listen = listen.parse().unwrap();
        c.admin = admin_token.map(|token| AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: token.map(str::to_string),
            max_connections: 16,
        });
        c
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    async fn answer(r: AdminRefusal) -> (StatusCode, serde_json::Value) {
        let resp = r.into_response();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn a_configured_token_must_be_presented() {
        let c = config("0.0.0.0:8080", Some(Some("s3cret")));
        assert!(AdminAuth::check(&c, &bearer("s3cret")).is_ok());
        for headers in [bearer("s3cre"), bearer("s3cret2"), HeaderMap::new()] {
            let refused = AdminAuth::check(&c, &headers).unwrap_err();
            let (status, body) = answer(refused).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert_eq!(body["error"]["code"], "invalid_admin_token");
            assert_eq!(body["error"]["message"], "admin token required");
        }
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, "Basic s3cret".parse().unwrap());
        assert!(AdminAuth::check(&c, &basic).is_err());
    }

    #[tokio::test]
    async fn no_token_is_open_on_loopback_and_refused_beyond() {
        assert!(AdminAuth::check(&config("127.0.0.1:8080", None), &HeaderMap::new()).is_ok());
        let refused = AdminAuth::check(&config("0.0.0.0:8080", None), &HeaderMap::new());
        let (status, body) = answer(refused.unwrap_err()).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert_eq!(body["error"]["type"], "permission_error");
        assert_eq!(body["error"]["code"], "admin_token_not_configured");
        // an [admin] listener without a token (loopback, by validation) is open
        let c = config("0.0.0.0:8080", Some(None));
        assert!(AdminAuth::check(&c, &HeaderMap::new()).is_ok());
    }

    #[test]
    fn the_dashboard_may_present_the_token_in_its_query() {
        let c = config("0.0.0.0:8080", Some(Some("s3cret")));
        let refused = || AdminAuth::check(&c, &HeaderMap::new()).unwrap_err();
        assert!(refused().or_query_token("s3cret").is_ok());
        assert!(refused().or_query_token("wrong").is_err());
        assert!(refused().or_query_token("").is_err());
        // without a configured token a query token changes nothing
        let open = config("0.0.0.0:8080", None);
        let refused = AdminAuth::check(&open, &HeaderMap::new()).unwrap_err();
        assert!(matches!(
            refused.or_query_token(""),
            Err(AdminRefusal::NoToken)
        ));
    }
}
