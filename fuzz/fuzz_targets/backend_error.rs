//! Any backend error answer (any status, any body) normalises to a well-formed OpenAI error:
//! the backend's status, a non-empty `type`, and a body `{"error":{"message","type","param",
//! "code"}}` of the right JSON types. Never a panic.
#![no_main]

use http::StatusCode;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sluice::openai::error::from_backend;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let code = 100 + (u16::from(data[0]) << 8 | u16::from(data[1])) % 900;
    let Ok(status) = StatusCode::from_u16(code) else {
        return;
    };
    let body = &data[2..];
    let e = from_backend(status, body);
    assert_eq!(e.status, status);
    assert!(!e.kind.is_empty());
    let json: Value = serde_json::from_str(&e.body_json()).expect("error body is JSON");
    let obj = json.as_object().expect("object");
    assert_eq!(obj.len(), 1);
    let inner = obj["error"].as_object().expect("error object");
    assert_eq!(inner.len(), 4);
    assert_eq!(inner["message"].as_str(), Some(e.message.as_str()));
    assert_eq!(inner["type"].as_str(), Some(&*e.kind));
    assert!(inner["param"].is_null() || inner["param"].is_string());
    assert!(inner["code"].is_null() || inner["code"].is_string());
    let _ = e.label();
    let _ = axum_free_display(&e);
});

fn axum_free_display(e: &sluice::openai::ApiError) -> String {
    e.to_string()
}
