//! A batch's input file read as lines (`batch::input::parse`) never panics and loses no line:
//! every non-blank line is one entry, in file order, at its own line number; the lines to run
//! have distinct non-empty `custom_id`s, a `body` that is one JSON object, and their `model`
//! is the body's `model` string; a line refused as a duplicate repeats the `custom_id` of an
//! earlier line that runs. Byte 0: the batch's endpoint.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sluice::batch::input::{count, parse, Parsed};

const ENDPOINTS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, file)) = data.split_first() else {
        return;
    };
    let endpoint = ENDPOINTS[usize::from(sel) % ENDPOINTS.len()];
    let parsed = parse(file, endpoint);
    assert_eq!(parsed.len(), count(file), "one entry per non-blank line");

    let lines: Vec<&[u8]> = file.split(|b| *b == b'\n').collect();
    let mut last = None;
    let mut run = HashSet::new();
    for p in &parsed {
        let i = p.index();
        assert!(last.is_none_or(|l| l < i), "in file order, each once");
        last = Some(i);
        let raw = lines[i as usize];
        assert!(
            !raw.iter().all(u8::is_ascii_whitespace),
            "line {i} is blank"
        );
        match p {
            Parsed::Run(l) => {
                assert!(!l.custom_id.is_empty());
                assert!(run.insert(l.custom_id.clone()), "{} runs twice", l.custom_id);
                let body: Value = serde_json::from_slice(&l.body).expect("the body is JSON");
                let obj = body.as_object().expect("the body is an object");
                let model = obj.get("model").and_then(Value::as_str);
                assert_eq!(l.model.as_deref(), model);
            }
            Parsed::Refused(r) => {
                assert!(!r.code.is_empty() && !r.message.is_empty());
                if r.code == "duplicate_custom_id" {
                    let id = r.custom_id.as_ref().expect("a duplicate names its id");
                    assert!(run.contains(id), "{id} refused as a duplicate of nothing");
                }
            }
        }
    }
});
