use std::path::{Path, PathBuf};

use super::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

/// A folder with the fixture's tokenizer.json and the given other files.
fn folder(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let tokenizer = fixture("tiny-tools").join("tokenizer.json");
    std::fs::copy(tokenizer, dir.path().join("tokenizer.json")).unwrap_or_else(|e| panic!("{e}"));
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap_or_else(|e| panic!("{e}"));
    }
    dir
}

fn load(dir: &Path) -> Tokenizer {
    Tokenizer::load(dir).unwrap_or_else(|e| panic!("{e}"))
}

fn render(t: &Tokenizer, body: &str) -> Result<String, TokenizerError> {
    t.chat_text(body.as_bytes()).map(|(text, _)| text)
}

#[test]
fn a_missing_folder_is_named() {
    let e = Tokenizer::load(Path::new("/nonexistent/tokenizer-folder")).map(|_| ());
    let e = e.err().map(|e| e.to_string()).unwrap_or_default();
    assert_eq!(e, "/nonexistent/tokenizer-folder: not a folder");
}

#[test]
fn a_missing_tokenizer_json_is_named() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let e = Tokenizer::load(dir.path()).err().map(|e| e.to_string());
    let want = format!(
        "{}: cannot read:",
        dir.path().join("tokenizer.json").display()
    );
    assert!(e.as_deref().is_some_and(|e| e.starts_with(&want)), "{e:?}");
}

#[test]
fn malformed_files_are_named_with_what_is_wrong() {
    let dir = folder(&[("tokenizer_config.json", "{\"bos_token\": ")]);
    let e = Tokenizer::load(dir.path()).err().map(|e| e.to_string());
    let want = format!(
        "{}: not JSON",
        dir.path().join("tokenizer_config.json").display()
    );
    assert!(e.as_deref().is_some_and(|e| e.starts_with(&want)), "{e:?}");

    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap_or_default();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 1}").unwrap_or_default();
    let e = Tokenizer::load(dir.path()).err().map(|e| e.to_string());
    let want = format!(
        "{}: not a tokenizer",
        dir.path().join("tokenizer.json").display()
    );
    assert!(e.as_deref().is_some_and(|e| e.starts_with(&want)), "{e:?}");
}

#[test]
fn a_template_syntax_error_names_the_file_and_line() {
    let dir = folder(&[(
        "chat_template.jinja",
        "{% for m in messages %}\n{{ m.content }",
    )]);
    let e = Tokenizer::load(dir.path()).err().map(|e| e.to_string());
    let want = format!(
        "{}: chat template \"default\": ",
        dir.path().join("chat_template.jinja").display()
    );
    assert!(
        e.as_deref()
            .is_some_and(|e| e.starts_with(&want) && e.contains("(line 2)")),
        "{e:?}"
    );

    let list = r#"{"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "rag", "template": "y"}]}"#;
    let dir = folder(&[("tokenizer_config.json", list)]);
    let e = Tokenizer::load(dir.path()).err().map(|e| e.to_string());
    assert!(e.is_some_and(|e| e.contains("none named \"default\"")));
}

#[test]
fn a_raising_template_is_a_template_error() {
    let template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message.') }}{% endif %}ok";
    let dir = folder(&[("chat_template.jinja", template)]);
    let t = load(dir.path());
    let e = render(
        &t,
        r#"{"messages": [{"role": "assistant", "content": "x"}]}"#,
    );
    assert_eq!(
        e.err().map(|e| e.to_string()).as_deref(),
        Some("chat template: Conversations must start with a user message. (line 1)")
    );
    assert_eq!(
        render(&t, r#"{"messages": [{"role": "user", "content": "x"}]}"#)
            .ok()
            .as_deref(),
        Some("ok")
    );
}

#[test]
fn a_folder_without_template_tokenizes_prompts_only() {
    let dir = folder(&[]);
    let t = load(dir.path());
    let e = t.chat_ids(br#"{"messages": [{"role": "user", "content": "x"}]}"#);
    assert!(matches!(e, Err(TokenizerError::NoTemplate)));
    let with = t.prompt_ids("Hello world", true).unwrap_or_default();
    let without = t.prompt_ids("Hello world", false).unwrap_or_default();
    assert_eq!(with[0], 1, "the tokenizer's post-processor adds <s>");
    assert_eq!(with[1..], without[..]);
    let strs = t.token_strs(&[with[0], 999_999]);
    assert_eq!(strs, [Some("<s>".to_string()), None]);
}

#[test]
fn special_tokens_reach_the_template_and_missing_ones_are_added() {
    let config = r#"{"bos_token": {"content": "<s>"}, "eos_token": "<|eot|>", "pad_token": null}"#;
    let template =
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ unk_token is defined }}";
    let dir = folder(&[
        ("tokenizer_config.json", config),
        ("chat_template.jinja", template),
    ]);
    let t = load(dir.path());
    let body = r#"{"messages": [{"role": "user", "content": "x"}]}"#;
    assert_eq!(
        render(&t, body).ok().as_deref(),
        Some("<s>|<|eot|>|False|False")
    );
    let ids = t.prompt_ids("a<|eot|>", false).unwrap_or_default();
    assert_eq!(
        ids.len(),
        2,
        "<|eot|> was added to the vocabulary as one special token"
    );
    assert_eq!(t.token_strs(&ids[1..]), [Some("<|eot|>".to_string())]);
}

#[test]
fn template_variables_are_what_transformers_passes() {
    let template = "{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ flag }}|{{ continue_final_message is defined }}";
    let config = r#"{"bos_token": "<s>"}"#;
    let dir = folder(&[
        ("tokenizer_config.json", config),
        ("chat_template.jinja", template),
    ]);
    let t = load(dir.path());
    let body = r#"{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false,
        "chat_template_kwargs": {"flag": 1, "bos_token": "B"}}"#;
    assert_eq!(
        render(&t, body).ok().as_deref(),
        Some("None|None|False|B|1|False")
    );
}

#[test]
fn continue_final_message_cuts_where_the_message_ends() {
    // this template trims the content, so the text is cut before the trimmed whitespace
    let template =
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}";
    let dir = folder(&[("chat_template.jinja", template)]);
    let t = load(dir.path());
    let body = r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is  "}],
        "add_generation_prompt": false, "continue_final_message": true}"#;
    assert_eq!(
        render(&t, body).ok().as_deref(),
        Some("<user>q</user>\n<assistant>The answer is")
    );
    // no content is an empty text (vLLM), continued as such
    let no_content = r#"{"messages": [{"role": "assistant", "content": null}], "add_generation_prompt": false, "continue_final_message": true}"#;
    assert_eq!(render(&t, no_content).ok().as_deref(), Some("<assistant>"));
    let hidden = "{% for m in messages %}<{{ m.role }}>{% endfor %}";
    std::fs::write(dir.path().join("chat_template.jinja"), hidden).unwrap_or_default();
    let t = load(dir.path());
    assert!(render(&t, body).is_err_and(|e| e.to_string().contains("does not use `content`")));
}

#[test]
fn a_template_knowing_developer_keeps_the_role() {
    let template = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{{ m.role }};{% endfor %}";
    let dir = folder(&[("chat_template.jinja", template)]);
    let t = load(dir.path());
    let body = r#"{"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]}"#;
    assert_eq!(render(&t, body).ok().as_deref(), Some("Ddeveloper;user;"));
    let plain = "{% for m in messages %}{{ m.role }};{% endfor %}";
    std::fs::write(dir.path().join("chat_template.jinja"), plain).unwrap_or_default();
    let t = load(dir.path());
    assert_eq!(render(&t, body).ok().as_deref(), Some("system;user;"));
}

#[test]
fn the_fixtures_load_with_their_content_forms() {
    let tools = load(&fixture("tiny-tools"));
    let parts = load(&fixture("tiny-parts"));
    assert_eq!(
        tools.templates.choose(false).map(|c| c.format),
        Some(content_format::ContentFormat::String)
    );
    assert_eq!(
        parts.templates.choose(false).map(|c| c.format),
        Some(content_format::ContentFormat::OpenAi)
    );
    let body = br#"{"messages": [{"role": "user", "content": "Hello there, how are you?"}]}"#;
    for t in [&tools, &parts] {
        let ids = t.chat_ids(body).unwrap_or_default();
        assert_eq!(
            ids.first(),
            Some(&1),
            "the template writes <s>; no second one is added"
        );
        assert_ne!(ids.get(1), Some(&1));
    }
}

#[test]
fn shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
