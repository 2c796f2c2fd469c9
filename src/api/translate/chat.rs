//! The chat-completions side of a translation, read once for every client API: a whole answer
//! ([`Whole`]) and a stream's chunks ([`ChunkReader`]) as neutral pieces — text, the start of a
//! tool call, its arguments — plus why the answer stopped and its usage.
//!
//! The engines differ here and the reader absorbs it: TGI says `finish_reason: "stop"` for an
//! answer that is a tool call (its grammar forces the call; it never says `tool_calls`) and
//! `"stop_sequence"` for a stop sequence, sends the tool call's id and index on every chunk and
//! its name only on the first, and gives whole arguments as a string; vLLM names the matched
//! stop string in `stop_reason`; Ollama sends each tool call whole in one chunk.

use serde::Deserialize;
use serde_json::Value;

/// Why an answer stopped, in the client APIs' terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The model ended its turn.
    End,
    /// A stop sequence ended it (the sequence when the backend or the request says which).
    Sequence(Option<String>),
    /// The output limit cut it.
    Length,
    /// The answer is a call of the client's tools.
    ToolCalls,
}

/// Token counts of an answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub input: u64,
    pub output: u64,
}

#[derive(Deserialize, Default)]
struct ChatUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

#[derive(Deserialize, Default)]
struct Function {
    #[serde(default)]
    name: Option<String>,
    /// A string (the wire's type); an object from servers that send it parsed.
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize, Default)]
struct ToolCall {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<Function>,
}

#[derive(Deserialize, Default)]
struct Message {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    delta: Option<Message>,
    #[serde(default)]
    finish_reason: Option<String>,
    /// vLLM: the stop string that ended the answer (a number for a stop token).
    #[serde(default)]
    stop_reason: Option<Value>,
}

#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<ChatUsage>,
    #[serde(default)]
    error: Option<Value>,
}

/// The arguments as the JSON text the client APIs carry.
fn arguments_text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The stop of a `finish_reason` (with vLLM's `stop_reason`).
fn stop_of(finish: &str, stop_reason: Option<&Value>) -> Stop {
    match finish {
        "length" => Stop::Length,
        "tool_calls" | "function_call" => Stop::ToolCalls,
        "stop_sequence" => Stop::Sequence(None),
        _ => match stop_reason {
            Some(Value::String(s)) => Stop::Sequence(Some(s.clone())),
            _ => Stop::End,
        },
    }
}

/// A whole tool call of an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// JSON text, as the backend gave it.
    pub arguments: String,
}

/// A whole chat completion, read.
#[derive(Debug)]
pub struct Whole {
    pub text: String,
    pub calls: Vec<Call>,
    pub stop: Stop,
    pub counts: Option<Counts>,
}

impl Whole {
    /// Read a whole chat completion (its first choice).
    pub fn read(json: &[u8]) -> Result<Whole, String> {
        let answer: Answer =
            serde_json::from_slice(json).map_err(|e| format!("not a chat completion ({e})"))?;
        let choice = answer
            .choices
            .into_iter()
            .next()
            .ok_or("a chat completion without choices")?;
        let message = choice.message.unwrap_or_default();
        let calls: Vec<Call> = message
            .tool_calls
            .unwrap_or_default()
            .into_iter()
            .map(|c| {
                let f = c.function.unwrap_or_default();
                Call {
                    id: c.id.unwrap_or_default(),
                    name: f.name.unwrap_or_default(),
                    arguments: arguments_text(f.arguments.as_ref()),
                }
            })
            .collect();
        let mut stop = stop_of(
            choice.finish_reason.as_deref().unwrap_or("stop"),
            choice.stop_reason.as_ref(),
        );
        if !calls.is_empty() && stop != Stop::Length {
            stop = Stop::ToolCalls;
        }
        Ok(Whole {
            text: message.content.unwrap_or_default(),
            calls,
            stop,
            counts: answer.usage.map(|u| Counts {
                input: u.prompt_tokens,
                output: u.completion_tokens,
            }),
        })
    }
}

/// One piece of a streamed answer, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    /// A tool call starts (its arguments follow as [`Piece::Args`]).
    CallStart {
        id: String,
        name: String,
    },
    Args(String),
}

/// What one chunk said.
#[derive(Debug, Default)]
pub struct Read {
    pub pieces: Vec<Piece>,
    /// The backend's in-stream error (its message).
    pub error: Option<String>,
}

/// Reads a chat stream chunk by chunk, keeping what spans chunks: which tool call is open, why
/// the answer stopped, its usage.
#[derive(Debug, Default)]
pub struct ChunkReader {
    open_call: Option<u64>,
    calls: u64,
    pub stop: Option<Stop>,
    pub counts: Option<Counts>,
    /// Output pieces seen (the output count when the backend reports no usage).
    pub pieces: u64,
}

impl ChunkReader {
    /// Read one chunk's data; `Err` when it is not a chat chunk at all.
    pub fn read(&mut self, data: &[u8]) -> Result<Read, String> {
        let answer: Answer = serde_json::from_slice(data).map_err(|e| e.to_string())?;
        let mut read = Read::default();
        if let Some(err) = answer.error {
            read.error = Some(error_message(&err));
            return Ok(read);
        }
        if let Some(u) = answer.usage {
            self.counts = Some(Counts {
                input: u.prompt_tokens,
                output: u.completion_tokens,
            });
        }
        for choice in answer.choices.into_iter().take(1) {
            if let Some(delta) = choice.delta {
                self.delta(delta, &mut read.pieces);
            }
            if let Some(f) = choice.finish_reason.as_deref() {
                self.stop = Some(stop_of(f, choice.stop_reason.as_ref()));
            }
        }
        self.pieces += read.pieces.len() as u64;
        Ok(read)
    }

    fn delta(&mut self, delta: Message, pieces: &mut Vec<Piece>) {
        if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
            self.open_call = None;
            pieces.push(Piece::Text(text));
        }
        for call in delta.tool_calls.unwrap_or_default() {
            let f = call.function.unwrap_or_default();
            let index = call.index.unwrap_or(self.calls);
            let name = f.name.filter(|n| !n.is_empty());
            // A call starts with its name (every engine sends it first, once), or when the
            // index moves on.
            if name.is_some() || self.open_call != Some(index) {
                self.open_call = Some(index);
                self.calls += 1;
                pieces.push(Piece::CallStart {
                    id: call.id.filter(|i| !i.is_empty()).unwrap_or_default(),
                    name: name.unwrap_or_default(),
                });
            }
            let args = arguments_text(f.arguments.as_ref());
            if !args.is_empty() {
                pieces.push(Piece::Args(args));
            }
        }
    }

    /// Why the answer stopped (a tool call's answer says so whatever the backend called it);
    /// `None` while the backend has not said.
    pub fn final_stop(&self) -> Option<Stop> {
        let stop = self.stop.clone()?;
        Some(match stop {
            Stop::Length => Stop::Length,
            _ if self.calls > 0 => Stop::ToolCalls,
            other => other,
        })
    }

    /// The usage, or what was seen when the backend reported none.
    pub fn final_counts(&self) -> Counts {
        self.counts.unwrap_or(Counts {
            input: 0,
            output: self.pieces,
        })
    }
}

/// The message of a backend's in-stream error (OpenAI's object, TGI's string).
fn error_message(err: &Value) -> String {
    match err {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| err.to_string()),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_answers_of_each_engine() {
        let tgi_call = br#"{"object":"chat.completion","id":"","created":1,"model":"m","system_fingerprint":"3.3.6-native","choices":[{"index":0,"message":{"role":"assistant","tool_calls":[{"id":"0","type":"function","function":{"description":null,"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":30,"completion_tokens":9,"total_tokens":39}}"#;
        let w = Whole::read(tgi_call).unwrap();
        assert_eq!(w.stop, Stop::ToolCalls);
        assert_eq!(w.calls[0].name, "get_weather");
        assert_eq!(w.calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(
            w.counts,
            Some(Counts {
                input: 30,
                output: 9
            })
        );
        let vllm_stop = br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop","stop_reason":"END"}]}"#;
        let w = Whole::read(vllm_stop).unwrap();
        assert_eq!(w.stop, Stop::Sequence(Some("END".into())));
        assert_eq!(w.counts, None);
        let object_args = br#"{"choices":[{"message":{"tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},"finish_reason":"length"}]}"#;
        let w = Whole::read(object_args).unwrap();
        assert_eq!(
            (w.stop, w.calls[0].arguments.as_str()),
            (Stop::Length, r#"{"a":1}"#)
        );
        assert!(Whole::read(b"{\"choices\":[]}").is_err());
        assert!(Whole::read(b"not json").is_err());
        let tgi_seq =
            br#"{"choices":[{"message":{"content":"x"},"finish_reason":"stop_sequence"}]}"#;
        assert_eq!(Whole::read(tgi_seq).unwrap().stop, Stop::Sequence(None));
    }

    #[test]
    fn tgi_streamed_tool_call_is_one_call() {
        let mut r = ChunkReader::default();
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"0","type":"function","function":{"name":"get_weather","arguments":"{"}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"0","type":"function","function":{"name":null,"arguments":"\"city\": \"Paris\""}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"0","type":"function","function":{"name":null,"arguments":"}"}}]},"finish_reason":"stop"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#,
        ];
        let mut pieces = Vec::new();
        for c in chunks {
            pieces.extend(r.read(c.as_bytes()).unwrap().pieces);
        }
        assert_eq!(
            pieces[0],
            Piece::CallStart {
                id: "0".into(),
                name: "get_weather".into()
            }
        );
        let args: String = pieces[1..]
            .iter()
            .map(|p| match p {
                Piece::Args(a) => a.as_str(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(args, r#"{"city": "Paris"}"#);
        assert_eq!(r.final_stop(), Some(Stop::ToolCalls));
        assert_eq!(
            r.final_counts(),
            Counts {
                input: 12,
                output: 3
            }
        );
    }

    #[test]
    fn ollama_calls_arrive_whole_and_errors_are_read() {
        let mut r = ChunkReader::default();
        let read = r.read(br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"","tool_calls":[{"id":"call_a","index":0,"type":"function","function":{"name":"f","arguments":"{}"}},{"id":"call_b","index":1,"type":"function","function":{"name":"g","arguments":"{\"x\":1}"}}]},"finish_reason":null}]}"#).unwrap();
        assert_eq!(read.pieces.len(), 4);
        assert!(r.final_stop().is_none());
        let read = r
            .read(br#"{"error":{"message":"worker died","http_status_code":500}}"#)
            .unwrap();
        assert_eq!(read.error.as_deref(), Some("worker died"));
        let read = r
            .read(br#"{"error":"Model is overloaded","error_type":"overloaded"}"#)
            .unwrap();
        assert_eq!(read.error.as_deref(), Some("Model is overloaded"));
        assert!(r.read(b"{oops").is_err());
        assert_eq!(ChunkReader::default().final_counts(), Counts::default());
    }
}
