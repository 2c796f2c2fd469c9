//! Just enough of `multipart/form-data` (RFC 7578) to find one text field in a body that is
//! otherwise forwarded byte for byte: the boundary from the content type, and the byte span of
//! a named field's value. Nothing is copied and no part is decoded.
//!
//! Invariants: never panics on any input; a body that is not well-formed up to the field (no
//! delimiter, a part without its blank line) is an error, not a guess.

use std::ops::Range;

use thiserror::Error;

/// Why a field could not be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FormError {
    #[error("the content type is not multipart/form-data with a boundary")]
    NoBoundary,
    #[error("the body is not multipart/form-data with the declared boundary")]
    Malformed,
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Result<&str, FormError> {
    let mut params = content_type.split(';');
    let essence = params.next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return Err(FormError::NoBoundary);
    }
    params
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"'))
        .filter(|b| !b.is_empty() && b.len() <= 70)
        .ok_or(FormError::NoBoundary)
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    memchr::memmem::find(hay.get(from..)?, needle).map(|i| i + from)
}

/// The byte span of the value of the first part named `name`; `Ok(None)` when no part has
/// that name.
pub fn field_span(
    body: &[u8],
    boundary: &str,
    name: &str,
) -> Result<Option<Range<usize>>, FormError> {
    Ok(part(body, boundary, name)?.map(|(_, value)| value))
}

/// The `filename` of the first part named `name` (`Ok(None)`: no such part, or it has none).
pub fn field_filename(
    body: &[u8],
    boundary: &str,
    name: &str,
) -> Result<Option<String>, FormError> {
    let Some((heads, _)) = part(body, boundary, name)? else {
        return Ok(None);
    };
    let heads = body.get(heads).unwrap_or_default();
    Ok(disposition_param(heads, b"filename").map(|v| String::from_utf8_lossy(v).into_owned()))
}

/// The byte spans of a part: its headers, then its value.
type Spans = (Range<usize>, Range<usize>);

/// The byte spans of the headers and of the value of the first part named `name`.
fn part(body: &[u8], boundary: &str, name: &str) -> Result<Option<Spans>, FormError> {
    let delim = format!("--{boundary}");
    let next_delim = format!("\r\n--{boundary}");
    let mut at = match body.starts_with(delim.as_bytes()) {
        true => 0,
        // A preamble is allowed before the first delimiter (which then follows a CRLF).
        false => find(body, next_delim.as_bytes(), 0).ok_or(FormError::Malformed)? + 2,
    };
    loop {
        let after = at + delim.len();
        let rest = body.get(after..).ok_or(FormError::Malformed)?;
        if rest.starts_with(b"--") {
            return Ok(None);
        }
        let line_end = find(body, b"\r\n", after).ok_or(FormError::Malformed)?;
        let heads_end = find(body, b"\r\n\r\n", line_end).ok_or(FormError::Malformed)?;
        // (a part without headers has its blank line right after the delimiter's line)
        let heads = (line_end + 2).min(heads_end)..heads_end;
        let start = heads_end + 4;
        let end = find(body, next_delim.as_bytes(), start).ok_or(FormError::Malformed)?;
        if part_name(body.get(heads.clone()).unwrap_or_default()) == Some(name.as_bytes()) {
            return Ok(Some((heads, start..end)));
        }
        at = end + 2;
    }
}

/// The `name` parameter of a part's `Content-Disposition: form-data` header.
fn part_name(heads: &[u8]) -> Option<&[u8]> {
    disposition_param(heads, b"name")
}

/// The parameter `param` of a part's `Content-Disposition: form-data` header.
fn disposition_param<'a>(heads: &'a [u8], param: &[u8]) -> Option<&'a [u8]> {
    heads.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        if !line[..colon].eq_ignore_ascii_case(b"content-disposition") {
            return None;
        }
        line[colon + 1..].split(|b| *b == b';').find_map(|p| {
            let eq = p.iter().position(|b| *b == b'=')?;
            let key = p[..eq].trim_ascii();
            let value = p[eq + 1..].trim_ascii();
            key.eq_ignore_ascii_case(param).then(|| {
                value
                    .strip_prefix(b"\"")
                    .and_then(|v| v.strip_suffix(b"\""))
                    .unwrap_or(value)
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\nContent-Type: audio/wav\r\n\r\nRIFF--XyZ\r\n--XyZ\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";

    #[test]
    fn finds_a_field_after_a_file_part() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ"), Ok("XyZ"));
        assert_eq!(
            boundary("Multipart/Form-Data; charset=x; boundary=\"XyZ\""),
            Ok("XyZ")
        );
        assert_eq!(boundary("application/json"), Err(FormError::NoBoundary));
        assert_eq!(boundary("multipart/form-data"), Err(FormError::NoBoundary));
        let span = field_span(BODY, "XyZ", "model").unwrap().unwrap();
        assert_eq!(&BODY[span], b"whisper-1");
        let span = field_span(BODY, "XyZ", "file").unwrap().unwrap();
        assert_eq!(&BODY[span], b"RIFF--XyZ");
        assert_eq!(field_span(BODY, "XyZ", "language"), Ok(None));
        assert_eq!(
            field_filename(BODY, "XyZ", "file"),
            Ok(Some("model".into()))
        );
        assert_eq!(field_filename(BODY, "XyZ", "model"), Ok(None));
    }

    #[test]
    fn malformed_bodies_are_errors_never_panics() {
        for body in [
            &b""[..],
            b"--XyZ",
            b"--XyZ\r\n",
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm",
            b"junk",
            b"\r\n--XyZ\r\n\r\n",
        ] {
            assert_eq!(
                field_span(body, "XyZ", "model"),
                Err(FormError::Malformed),
                "{body:?}"
            );
        }
        assert_eq!(field_span(b"--XyZ--", "XyZ", "model"), Ok(None));
    }
}
