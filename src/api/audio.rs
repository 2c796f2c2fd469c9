//! OpenAI's audio paths, `POST /v1/audio/transcriptions` and `POST /v1/audio/translations`:
//! `multipart/form-data` bodies (the audio file and text fields), routed by the `model` form
//! field and forwarded byte for byte with the client's content type (boundary included).
//! vLLM serves them for speech-to-text models (Whisper and the like); a generic
//! OpenAI-compatible server may too. TGI and Ollama have no audio path.
//!
//! Invariants: the body is read once, within the body cap, and only the `model` value is
//! located ([`super::multipart`]) — no part is decoded or copied; a backend with its own name
//! for the model gets it spliced into that value. Answers may be JSON, plain text, SRT or VTT
//! (`response_format`): usage is read when the answer is JSON and carries OpenAI's usage, and
//! anything else is passed on as it came. The form's `stream` is not read: a streamed
//! transcription reaches the client whole, once complete.

use super::engine::fields;
use super::multipart::{self, FormError};
use super::{wire, BodyForm, ClientApi, TokenizeForm, Whole};
use crate::config::BackendKind;
use crate::openai::edit::Splice;
use crate::openai::{ApiError, RequestFields};

/// Rough bytes of upload per token of transcript, for the reservation before the answer's
/// usage is known: 16 kHz 16-bit mono is 32 kB a second, speech ~3 tokens a second.
const UPLOAD_BYTES_PER_TOKEN: u64 = 10_000;

/// One audio path.
pub struct Audio {
    path: &'static str,
    label: &'static str,
}

/// `POST /v1/audio/transcriptions`.
pub static AUDIO_TRANSCRIPTIONS: &dyn ClientApi = &Audio {
    path: "/v1/audio/transcriptions",
    label: "audio_transcriptions",
};

/// `POST /v1/audio/translations`.
pub static AUDIO_TRANSLATIONS: &dyn ClientApi = &Audio {
    path: "/v1/audio/translations",
    label: "audio_translations",
};

fn form_error(e: FormError) -> ApiError {
    ApiError::bad_request(format!("Could not read the form: {e}."))
}

impl ClientApi for Audio {
    fn path(&self) -> &'static str {
        self.path
    }

    fn label(&self) -> &'static str {
        self.label
    }

    fn body_form(&self) -> BodyForm {
        BodyForm::Multipart
    }

    fn parse(&self, _body: &[u8]) -> Result<RequestFields, ApiError> {
        Err(ApiError::bad_request(
            "This endpoint takes a multipart/form-data body (the audio `file` and a `model` field).",
        ))
    }

    fn parse_form(&self, boundary: &str, body: &[u8]) -> Result<RequestFields, ApiError> {
        let span = multipart::field_span(body, boundary, "model")
            .map_err(form_error)?
            .ok_or_else(|| {
                ApiError::bad_request("you must provide a model parameter").with_param("model")
            })?;
        let model = std::str::from_utf8(&body[span.clone()])
            .ok()
            .filter(|m| !m.is_empty())
            .ok_or_else(|| {
                ApiError::bad_request("`model` must be a non-empty UTF-8 string.")
                    .with_param("model")
            })?;
        let mut f = fields(body, model.to_string(), span, 0);
        f.prompt_tokens_estimate = (body.len() as u64).div_ceil(UPLOAD_BYTES_PER_TOKEN);
        f.max_tokens = None;
        Ok(f)
    }

    fn streams(&self, _fields: &RequestFields) -> bool {
        false
    }

    fn expected_output(&self, _fields: &RequestFields, default: u64) -> u64 {
        default
    }

    fn rename_model(&self, fields: &RequestFields, to: &str) -> Splice {
        Splice {
            span: fields.model_span.clone(),
            with: to.as_bytes().to_vec(),
        }
    }

    fn force_stream_usage(&self, _body: &[u8], _fields: &RequestFields) -> Option<Splice> {
        None
    }

    fn whole(&self, json: &[u8]) -> Result<Whole, serde_json::Error> {
        // Text, SRT and VTT answers are answers too, not broken JSON.
        Ok(wire::whole(json).unwrap_or_default())
    }

    fn id_prefix(&self) -> &'static str {
        ""
    }

    fn native(&self, kind: BackendKind) -> bool {
        matches!(kind, BackendKind::Vllm | BackendKind::OpenAi)
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_a_form_field_renamed_in_place() {
        let body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b--\r\n";
        let f = AUDIO_TRANSCRIPTIONS.parse_form("b", body).unwrap();
        assert_eq!(f.model, "whisper");
        let s = AUDIO_TRANSCRIPTIONS.rename_model(&f, "openai/whisper-large-v3");
        let out = crate::openai::edit::apply(&bytes::Bytes::from_static(body), vec![s]);
        assert!(out.ends_with(b"name=\"model\"\r\n\r\nopenai/whisper-large-v3\r\n--b--\r\n"));
        let no_model = b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nx\r\n--b--";
        let err = AUDIO_TRANSLATIONS.parse_form("b", no_model).unwrap_err();
        assert_eq!(
            (err.status.as_u16(), err.param.as_deref()),
            (400, Some("model"))
        );
        assert_eq!(
            AUDIO_TRANSCRIPTIONS
                .parse_form("b", b"junk")
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(AUDIO_TRANSCRIPTIONS.parse(b"{}").unwrap_err().status, 400);
        assert_eq!(AUDIO_TRANSCRIPTIONS.body_form(), BodyForm::Multipart);
        assert!(!AUDIO_TRANSCRIPTIONS.native(BackendKind::Ollama));
    }

    #[test]
    fn text_answers_are_answers() {
        assert!(AUDIO_TRANSCRIPTIONS
            .whole_usage(b"hello there\n")
            .unwrap()
            .is_none());
        let json =
            br#"{"text":"hi","usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let u = AUDIO_TRANSCRIPTIONS.whole_usage(json).unwrap().unwrap();
        assert_eq!(u.completion_tokens, 2);
    }
}
