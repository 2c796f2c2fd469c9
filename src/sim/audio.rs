//! vLLM's speech-to-text paths for speech models: `POST /v1/audio/transcriptions` and
//! `/v1/audio/translations`, `multipart/form-data` with a `file` part and form fields.
//!
//! Invariants:
//! - The form is read as vLLM's FastAPI does: the boundary from the content type, each part by
//!   its `Content-Disposition` name; a body that is not such a form, or a form without `file`,
//!   is a 400 in vLLM's error shape; an unknown `model` the 404.
//! - The "speech" is the file's bytes: its duration is their length at 16 kHz, 16-bit mono
//!   (at least 1 s) and its text a deterministic run of the generator's words seeded by them,
//!   two words a second, so the same upload always gives the same answer.
//! - Answers per `response_format`: `json` (default) `{"text", "usage": {"type": "duration",
//!   "seconds"}}` for transcriptions and `{"text"}` for translations, `text` as plain text.
//!   Other formats (`srt`, `vtt`, `verbose_json`) and `stream` are not simulated (400).
//! - Like rerank and score, served for whatever model the simulator has.

use std::sync::Arc;

use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;

use super::openai_surface::js;
use super::server::{json, read_body, Sim, SimBody};
use super::text;
use super::vllm::{self, JSON};

/// Bytes of audio a second (16 kHz, 16-bit, mono).
const BYTES_PER_SECOND: usize = 32_000;

/// The named parts of a `multipart/form-data` body.
fn parts<'b>(body: &'b [u8], boundary: &str) -> Option<Vec<(String, &'b [u8])>> {
    let delim = format!("--{boundary}");
    let d = delim.as_bytes();
    let mut out = Vec::new();
    let mut rest = body;
    // skip to the first delimiter
    let start = find(rest, d)?;
    rest = &rest[start + d.len()..];
    loop {
        if rest.starts_with(b"--") {
            return Some(out);
        }
        rest = rest.strip_prefix(b"\r\n")?;
        let head_end = find(rest, b"\r\n\r\n")?;
        let head = std::str::from_utf8(&rest[..head_end]).ok()?;
        let name = head
            .split(';')
            .find_map(|p| p.trim().strip_prefix("name=\""))
            .and_then(|n| n.split('"').next())?
            .to_string();
        let content = &rest[head_end + 4..];
        let end = delimiter(content, format!("\r\n{delim}").as_bytes())?;
        out.push((name, &content[..end]));
        rest = &content[end + 2 + d.len()..];
    }
}

/// Where the next delimiter line starts: `needle` followed by a line end or the closing `--`
/// (the same bytes inside a part's content are content).
fn delimiter(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = find(&hay[from..], needle) {
        let at = from + i;
        let after = &hay[at + needle.len()..];
        if after.starts_with(b"\r\n") || after.starts_with(b"--") {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(hay, needle)
}

fn bad(message: &str) -> Response<SimBody> {
    vllm::error(StatusCode::BAD_REQUEST, message, "BadRequestError", None)
}

/// `POST /v1/audio/transcriptions` (`translate` false) and `/v1/audio/translations`.
pub(super) async fn speech_to_text(
    sim: &Arc<Sim>,
    req: Request<Incoming>,
    translate: bool,
) -> Response<SimBody> {
    let boundary = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .filter(|ct| ct.starts_with("multipart/form-data"))
        .and_then(|ct| {
            ct.split(';')
                .find_map(|p| p.trim().strip_prefix("boundary="))
        })
        .map(|b| b.trim_matches('"').to_string());
    let Ok(body) = read_body(req).await else {
        return vllm::too_large();
    };
    let Some(fields) = boundary.and_then(|b| parts(&body, &b)) else {
        return bad("The request body is not a multipart/form-data form.");
    };
    let field = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    let Some(file) = fields.iter().find(|(n, _)| n == "file").map(|(_, v)| *v) else {
        return bad("Field required: file");
    };
    if let Some(resp) = vllm::check_model(sim, field("model").as_deref()) {
        return resp;
    }
    if let Some(resp) = vllm::inference_fault(sim) {
        return resp;
    }
    let format = field("response_format").unwrap_or_else(|| "json".into());
    if !matches!(format.as_str(), "json" | "text") || field("stream").as_deref() == Some("true") {
        return bad(&format!(
            "response_format `{format}` (or stream) is not simulated"
        ));
    }
    let seconds = file.len().div_ceil(BYTES_PER_SECOND).max(1);
    let mut rng = text::SplitMix::new(text::fnv1a(file));
    let words: Vec<&str> = (0..seconds * 2)
        .map(|_| text::WORDS[rng.below(text::WORDS.len() as u64) as usize])
        .collect();
    let said = words.join(" ");
    if format == "text" {
        return json(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            format!("{said}\n"),
        );
    }
    let body = if translate {
        format!("{{\"text\":{}}}", js(&said))
    } else {
        format!(
            "{{\"text\":{},\"usage\":{{\"type\":\"duration\",\"seconds\":{seconds}}}}}",
            js(&said)
        )
    };
    json(StatusCode::OK, JSON, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_form_is_read_part_by_part() {
        let body = b"--XB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--XBnot\r\n--XB\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nw\r\n--XB--\r\n";
        let p = parts(body, "XB").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].0.as_str(), p[0].1), ("file", &b"RIFF\r\n--XBnot"[..]));
        assert_eq!((p[1].0.as_str(), p[1].1), ("model", &b"w"[..]));
        assert!(parts(b"no form", "XB").is_none());
    }
}
