//! A batch's input file read as OpenAI defines it: one JSON object per line,
//! `{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {…}}`.
//!
//! Invariants: never panics on any input; every non-blank line is either a [`Line`] to run or
//! a [`Refused`] line with OpenAI's error code, so no line is lost; a `custom_id` is run once
//! (its later repeats are refused as `duplicate_custom_id`); the body is kept as its bytes and
//! sent as it is.

use std::collections::HashSet;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

/// A line to run.
#[derive(Debug, Clone)]
pub struct Line {
    /// Where it is in the file (0-based, blank lines counted): its key for its result.
    pub index: u64,
    pub custom_id: String,
    pub body: Bytes,
    /// The body's `model`, when it names one as a string.
    pub model: Option<String>,
}

/// A line refused before it runs: it goes to the error file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub index: u64,
    pub custom_id: Option<String>,
    pub code: &'static str,
    pub message: String,
}

/// What one line is.
#[derive(Debug, Clone)]
pub enum Parsed {
    Run(Line),
    Refused(Refused),
}

impl Parsed {
    pub fn index(&self) -> u64 {
        match self {
            Parsed::Run(l) => l.index,
            Parsed::Refused(r) => r.index,
        }
    }
}

#[derive(Deserialize)]
struct Wire<'a> {
    custom_id: Option<serde_json::Value>,
    method: Option<String>,
    url: Option<String>,
    #[serde(borrow)]
    body: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Peek {
    model: Option<serde_json::Value>,
    stream: Option<serde_json::Value>,
}

/// Every non-blank line of `file`, for a batch of `endpoint`.
pub fn parse(file: &[u8], endpoint: &str) -> Vec<Parsed> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, raw) in file.split(|b| *b == b'\n').enumerate() {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        out.push(line(i as u64, raw, endpoint, &mut seen));
    }
    out
}

/// The number of non-blank lines of `file`.
pub fn count(file: &[u8]) -> usize {
    file.split(|b| *b == b'\n')
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .count()
}

fn line(index: u64, raw: &[u8], endpoint: &str, seen: &mut HashSet<String>) -> Parsed {
    let refuse = |custom_id: Option<String>, code, message: String| {
        Parsed::Refused(Refused {
            index,
            custom_id,
            code,
            message,
        })
    };
    let wire: Wire = match serde_json::from_slice(raw) {
        Ok(w) => w,
        Err(e) => {
            return refuse(
                None,
                "invalid_json_line",
                format!("This line is not a valid JSON object: {e}."),
            )
        }
    };
    let custom_id = match wire.custom_id {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s,
        _ => {
            return refuse(
                None,
                "missing_required_parameter",
                "Each line needs a `custom_id` string.".into(),
            )
        }
    };
    let id = Some(custom_id.clone());
    if !wire
        .method
        .as_deref()
        .is_some_and(|m| m.eq_ignore_ascii_case("POST"))
    {
        return refuse(
            id,
            "invalid_method",
            "The `method` of a line must be `POST`.".into(),
        );
    }
    if wire.url.as_deref() != Some(endpoint) {
        return refuse(
            id,
            "mismatched_endpoint",
            format!("The `url` of a line must be the batch's endpoint `{endpoint}`."),
        );
    }
    let Some(body) = wire.body.filter(|b| b.get().trim_start().starts_with('{')) else {
        return refuse(
            id,
            "missing_required_parameter",
            "Each line needs a `body` object.".into(),
        );
    };
    // The body is one JSON object, so the only way to fail here is a repeated `model` or
    // `stream`: which one counts would be a guess (the request path refuses it too).
    let Ok(peek) = serde_json::from_str::<Peek>(body.get()) else {
        return refuse(
            id,
            "invalid_value",
            "The `body` of a line names `model` or `stream` more than once.".into(),
        );
    };
    if peek.stream == Some(serde_json::Value::Bool(true)) {
        return refuse(
            id,
            "invalid_value",
            "`stream: true` is not supported in a batch.".into(),
        );
    }
    if !seen.insert(custom_id.clone()) {
        return refuse(
            id,
            "duplicate_custom_id",
            format!("The custom_id `{custom_id}` is used by an earlier line of this file."),
        );
    }
    let model = match peek.model {
        Some(serde_json::Value::String(m)) => Some(m),
        _ => None,
    };
    Parsed::Run(Line {
        index,
        custom_id,
        body: Bytes::copy_from_slice(body.get().as_bytes()),
        model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EP: &str = "/v1/chat/completions";

    fn codes(file: &str) -> Vec<Result<String, &'static str>> {
        parse(file.as_bytes(), EP)
            .into_iter()
            .map(|p| match p {
                Parsed::Run(l) => Ok(l.custom_id),
                Parsed::Refused(r) => Err(r.code),
            })
            .collect()
    }

    #[test]
    fn each_line_runs_or_is_refused_with_openais_code() {
        let file = concat!(
            r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":"m","messages":[]}}"#,
            "\n",
            "\n",
            "not json\n",
            r#"{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{}}"#,
            "\r\n",
            r#"{"method":"POST","url":"/v1/chat/completions","body":{}}"#,
            "\n",
            r#"{"custom_id":"b","method":"GET","url":"/v1/chat/completions","body":{}}"#,
            "\n",
            r#"{"custom_id":"c","method":"POST","url":"/v1/embeddings","body":{}}"#,
            "\n",
            r#"{"custom_id":"d","method":"POST","url":"/v1/chat/completions","body":[1]}"#,
            "\n",
            r#"{"custom_id":"e","method":"POST","url":"/v1/chat/completions","body":{"stream":true}}"#,
            "\n",
            r#"{"custom_id":"f","method":"post","url":"/v1/chat/completions","body":{"model":7}}"#,
            "\n",
            r#"{"custom_id":"g","method":"POST","url":"/v1/chat/completions","body":{"stream":true,"stream":false}}"#,
        );
        assert_eq!(
            codes(file),
            [
                Ok("a".to_string()),
                Err("invalid_json_line"),
                Err("duplicate_custom_id"),
                Err("missing_required_parameter"),
                Err("invalid_method"),
                Err("mismatched_endpoint"),
                Err("missing_required_parameter"),
                Err("invalid_value"),
                Ok("f".to_string()),
                Err("invalid_value"),
            ]
        );
        let parsed = parse(file.as_bytes(), EP);
        assert_eq!(parsed[1].index(), 2, "blank lines keep their place");
        let Parsed::Run(a) = &parsed[0] else { panic!() };
        assert_eq!(a.model.as_deref(), Some("m"));
        assert_eq!(&a.body[..], br#"{"model":"m","messages":[]}"#);
        assert_eq!(count(file.as_bytes()), 10);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        for raw in [
            &b"\xff\xfe"[..],
            b"{",
            b"[]",
            b"{\"custom_id\":1}",
            b"\n\n\r\n",
            b"{\"body\":",
        ] {
            let _ = parse(raw, EP);
        }
    }
}
