use super::*;
use crate::tokenizer::pyjson::Dumps;

fn json(v: &Value) -> String {
    Dumps::new().dumps(v).unwrap_or_else(|e| format!("<{e}>"))
}

fn request(body: &str) -> ChatRequest {
    ChatRequest::parse(body.as_bytes()).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn conversation(body: &str, format: ContentFormat) -> String {
    let messages = request(body)
        .conversation(format)
        .unwrap_or_else(|e| panic!("{e}"));
    json(&Value::from(messages))
}

#[test]
fn string_form_joins_text_parts_with_newlines() {
    let body = r#"{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text", "text": "c"}], "extra": 1},
        {"role": "assistant", "content": null},
        {"role": "user", "content": [{"type": "refusal", "refusal": "r"}, {"type": "text", "text": null}]}
    ]}"#;
    assert_eq!(
        conversation(body, ContentFormat::String),
        r#"[{"role": "user", "content": "a\nb\nc"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "r"}]"#
    );
}

#[test]
fn openai_form_wraps_strings_and_joins_tool_results() {
    let body = r#"{"messages": [
        {"role": "user", "content": "hi", "name": "ana"},
        {"role": "assistant"},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
    ]}"#;
    assert_eq!(
        conversation(body, ContentFormat::OpenAi),
        r#"[{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ana"}, {"role": "assistant", "content": []}, {"role": "tool", "content": "x\ny", "tool_call_id": "c1"}]"#
    );
}

#[test]
fn tool_calls_get_parsed_arguments_in_the_validated_key_order() {
    let body = r#"{"messages": [{"role": "assistant", "content": "ok", "reasoning": "why",
        "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": {\"z\": 0, \"y\": 1.5}}", "x": 1}, "id": "c1", "q": 2},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}},
            {"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{oops"}},
            {"id": "c4", "type": "function", "function": {"name": "g", "arguments": "[1]"}}
        ]}]}"#;
    assert_eq!(
        conversation(body, ContentFormat::String),
        concat!(
            r#"[{"role": "assistant", "content": "ok", "tool_calls": ["#,
            r#"{"id": "c1", "function": {"arguments": {"b": 1, "a": {"z": 0, "y": 1.5}}, "name": "f", "x": 1}, "type": "function", "q": 2}, "#,
            r#"{"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"}, "#,
            r#"{"id": "c3", "function": {"arguments": {}, "name": "g"}, "type": "function"}, "#,
            r#"{"id": "c4", "function": {"arguments": {}, "name": "g"}, "type": "function"}], "#,
            r#""reasoning": "why", "reasoning_content": "why"}]"#
        )
    );
}

#[test]
fn an_empty_tool_call_list_is_dropped_and_a_bad_one_refused() {
    let empty = r#"{"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}"#;
    assert_eq!(
        conversation(empty, ContentFormat::String),
        r#"[{"role": "assistant", "content": "x"}]"#
    );
    for bad in [
        r#"{"messages": [{"role": "assistant", "tool_calls": ["x"]}]}"#,
        r#"{"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", "function": {}}]}]}"#,
    ] {
        assert!(
            request(bad).conversation(ContentFormat::String).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn images_and_unknown_parts_are_refused() {
    for body in [
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#,
        r#"{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}"#,
        r#"{"messages": [{"content": "no role"}]}"#,
        r#"{"messages": []}"#,
    ] {
        assert!(
            request(body).conversation(ContentFormat::String).is_err(),
            "{body}"
        );
    }
}

#[test]
fn the_billing_header_line_is_dropped_from_system_text() {
    let body = r#"{"messages": [{"role": "system", "content": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1\nkeep this"},
        {"type": "text", "text": "x-anthropic-billing-header: only"}]}]}"#;
    assert_eq!(
        conversation(body, ContentFormat::String),
        r#"[{"role": "system", "content": "keep this"}]"#
    );
}

#[test]
fn tools_are_dumped_as_vllm_dumps_them() {
    let body = r#"{"messages": [], "tools": [
        {"function": {"parameters": {"z": 1, "a": 2}, "name": "f", "extra": 5, "strict": false}, "type": "function", "x": 1},
        {"type": "function", "function": {"name": "g"}, "defer_loading": true}]}"#;
    let tools = request(body).tools().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        tools.as_ref().map(json).as_deref(),
        Some(concat!(
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "a": 2}, "strict": false}}, "#,
            r#"{"type": "function", "function": {"name": "g", "description": null, "parameters": null, "defer_loading": true}, "defer_loading": true}]"#
        ))
    );
    assert!(request(r#"{"messages": []}"#)
        .tools()
        .is_ok_and(|t| t.is_none()));
    let bad = r#"{"messages": [], "tools": [{"type": "function", "function": {"description": "no name"}}]}"#;
    assert!(request(bad).tools().is_err());
}

#[test]
fn template_kwargs_drop_null_and_auto_and_follow_reasoning_effort() {
    let body = r#"{"messages": [], "reasoning_effort": "none",
        "chat_template_kwargs": {"z": 1, "none": null, "auto": "auto", "tokenize": true, "a": "x"}}"#;
    let kwargs = request(body)
        .template_kwargs()
        .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<&str> = kwargs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["z", "a", "reasoning_effort", "enable_thinking"]);
    assert_eq!(kwargs[3].1, Value::from(false));
    let own = r#"{"messages": [], "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": false}}"#;
    let kwargs = request(own).template_kwargs().unwrap_or_default();
    assert_eq!(
        kwargs[0],
        ("enable_thinking".to_string(), Value::from(false))
    );
    let messages = r#"{"messages": [], "chat_template_kwargs": {"messages": []}}"#;
    assert!(request(messages).template_kwargs().is_err());
}

#[test]
fn requests_vllm_refuses_are_refused() {
    for body in [
        r#"{"messages": [], "continue_final_message": true}"#,
        r#"{"messages": [], "chat_template": "{{ x }}"}"#,
        r#"{"messages": [], "chat_template_kwargs": {"chat_template": "x"}}"#,
        r#"{"prompt": "not a chat"}"#,
        r#"not json"#,
    ] {
        assert!(ChatRequest::parse(body.as_bytes()).is_err(), "{body}");
    }
    let ok = r#"{"messages": [], "continue_final_message": true, "add_generation_prompt": false}"#;
    assert!(ChatRequest::parse(ok.as_bytes()).is_ok());
}

#[test]
fn developer_messages_become_one_first_system_message() {
    let body = r#"{"messages": [
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "d", "tools": [1]},
        {"role": "system", "content": "s"}]}"#;
    let messages = request(body)
        .conversation(ContentFormat::String)
        .unwrap_or_default();
    assert_eq!(
        json(&Value::from(developer_as_system(messages))),
        r#"[{"role": "system", "content": "d\n\ns"}, {"role": "user", "content": "u"}]"#
    );
    let first = r#"{"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]}"#;
    let messages = request(first)
        .conversation(ContentFormat::String)
        .unwrap_or_default();
    assert_eq!(
        json(&Value::from(developer_as_system(messages))),
        r#"[{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]"#
    );
}
