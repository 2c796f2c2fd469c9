//! One request and its answer, for the tests that only need the status or the body.

use reqwest::{Client, IntoUrl, Response};
use serde::Serialize;

/// `GET url`, the answer as JSON.
pub async fn get_json(c: &Client, url: impl IntoUrl) -> serde_json::Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// `GET url`, the answer's status.
pub async fn get_status(c: &Client, url: impl IntoUrl) -> reqwest::StatusCode {
    c.get(url).send().await.unwrap().status()
}

/// `GET url`, the answer as text.
pub async fn get_text(c: &Client, url: impl IntoUrl) -> String {
    c.get(url).send().await.unwrap().text().await.unwrap()
}

/// `POST url` with a JSON body; the answer as it came.
pub async fn post_json<B: Serialize + ?Sized>(c: &Client, url: impl IntoUrl, body: &B) -> Response {
    c.post(url).json(body).send().await.unwrap()
}

/// `POST url` with a JSON body, the answer as JSON.
pub async fn post_for_json<B: Serialize + ?Sized>(
    c: &Client,
    url: impl IntoUrl,
    body: &B,
) -> serde_json::Value {
    post_json(c, url, body).await.json().await.unwrap()
}

/// The value of header `name` of an answer, which must have it, as text.
pub fn header<'a>(r: &'a Response, name: &str) -> &'a str {
    r.headers()[name].to_str().unwrap()
}
