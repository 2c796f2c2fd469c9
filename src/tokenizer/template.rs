//! Chat templates compiled once and rendered as transformers renders them: Jinja with
//! `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception(message)`,
//! `strftime_now(format)`, `tojson` as Python's `json.dumps` (see [`super::pyjson`]) and Python
//! string, dict and list methods (`.strip()`, `.startswith()`, `.items()`, …).
//!
//! Invariants:
//! - Every template is parsed when the folder is loaded; a syntax error is a load error, never
//!   a request error.
//! - A render is bounded: it runs on a fuel budget, so a template that loops without end or
//!   builds huge strings fails instead of holding the request's thread.
//! - The facts vLLM reads from a template's text (its content form, whether it knows the
//!   `developer` role, whether it mentions `content`) are computed once, at load.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};

use super::content_format::{self, ContentFormat};
use super::pyjson::Dumps;
use super::strftime::strftime_now;

/// Work one render may do: about one fuel per instruction and per 64 bytes produced (a
/// 100,000-token conversation with a tool list uses well under a tenth of it).
const FUEL: u64 = 20_000_000;

/// One named template and what vLLM reads from its text.
struct Entry {
    name: String,
    format: ContentFormat,
    knows_developer: bool,
    mentions_content: bool,
}

/// A model's chat templates (usually one, `default`; sometimes also `tool_use`).
pub(crate) struct Templates {
    env: Environment<'static>,
    entries: Vec<Entry>,
}

/// Which template a request is rendered with and its facts.
#[derive(Clone, Copy)]
pub(crate) struct Chosen<'a> {
    name: &'a str,
    pub(crate) format: ContentFormat,
    pub(crate) knows_developer: bool,
    pub(crate) mentions_content: bool,
}

impl Templates {
    /// No templates yet.
    pub(crate) fn new() -> Result<Templates, String> {
        Ok(Templates {
            env: environment()?,
            entries: Vec::new(),
        })
    }

    /// Compiles template `name`; the error names it and says what is wrong with its syntax.
    pub(crate) fn add(&mut self, name: &str, source: String) -> Result<(), String> {
        let entry = Entry {
            format: content_format::detect(&source),
            knows_developer: source.contains("\"developer\"") || source.contains("'developer'"),
            mentions_content: source.contains("content"),
            name: name.to_owned(),
        };
        self.env
            .add_template_owned(name.to_owned(), source)
            .map_err(|e| format!("chat template {name:?}: {}", describe(&e)))?;
        self.entries.push(entry);
        Ok(())
    }

    /// Whether a request without tools has a template (transformers refuses several
    /// templates none of which is `default`).
    pub(crate) fn has_default(&self) -> bool {
        self.choose(false).is_some()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The template transformers picks: the only one; else `tool_use` when the request has
    /// tools and there is one, else `default`.
    pub(crate) fn choose(&self, has_tools: bool) -> Option<Chosen<'_>> {
        let entry = match self.entries.as_slice() {
            [only] => Some(only),
            many => many
                .iter()
                .find(|e| has_tools && e.name == "tool_use")
                .or_else(|| many.iter().find(|e| e.name == "default")),
        }?;
        Some(Chosen {
            name: &entry.name,
            format: entry.format,
            knows_developer: entry.knows_developer,
            mentions_content: entry.mentions_content,
        })
    }

    /// Renders `chosen` with `context` (a map of the template's variables).
    pub(crate) fn render(&self, chosen: Chosen<'_>, context: Value) -> Result<String, String> {
        let template = self
            .env
            .get_template(chosen.name)
            .map_err(|e| describe(&e))?;
        template.render(context).map_err(|e| describe(&e))
    }
}

/// The environment every template of a model is compiled in (see the module doc).
fn environment() -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| e.to_string())?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env.add_filter("tojson", tojson);
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
    Ok(env)
}

/// Jinja's `iterable` test as Python answers it: `none is iterable` is false (templates write
/// `tools is iterable and tools | length > 0`), an undefined value is (Jinja's `Undefined`
/// iterates as empty), and so are strings.
fn is_iterable(v: &Value) -> bool {
    match v.kind() {
        ValueKind::Undefined => true,
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Invalid => false,
        ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map => true,
        _ => v.try_iter().is_ok(),
    }
}

/// Jinja's `sequence` test as Python answers it (has a length and items): strings, lists,
/// maps and undefined values.
fn is_sequence(v: &Value) -> bool {
    matches!(
        v.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

/// The template's own refusal (a role it does not accept, a missing system message, …).
fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    Dumps::from_kwargs(&kwargs)?.dumps(&value)
}

/// An error's own words and where in the template it happened.
fn describe(e: &Error) -> String {
    let what = e
        .detail()
        .map(str::to_owned)
        .unwrap_or_else(|| e.kind().to_string());
    match e.line() {
        Some(line) => format!("{what} (line {line})"),
        None => what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(sources: &[(&str, &str)]) -> Result<Templates, String> {
        let mut t = Templates::new()?;
        for (name, source) in sources {
            t.add(name, source.to_string())?;
        }
        Ok(t)
    }

    fn render(source: &str, ctx: Value) -> Result<String, String> {
        let t = compile(&[("default", source)])?;
        let chosen = t.choose(false).ok_or("no template")?;
        t.render(chosen, ctx)
    }

    #[test]
    fn renders_like_transformers() {
        let ctx = minijinja::context! {
            messages => vec![minijinja::context! { role => "user", content => "  hi  " }],
            tools => Value::from(()),
            add_generation_prompt => true,
            args => serde_json::from_str::<Value>(r#"{"b": 1, "a": [0.5, "é<>"]}"#).unwrap_or_default(),
        };
        let source = "{% for m in messages %}\n<{{ m.role }}>{{ m.content.strip() }}\n{% endfor %}\n\
            {%- if tools is none %}no tools{% endif %} {{ args | tojson }} {{ 'x'.startswith('x') }}\n";
        assert_eq!(
            render(source, ctx).as_deref(),
            Ok("<user>hi\nno tools {\"b\": 1, \"a\": [0.5, \"é<>\"]} True")
        );
    }

    #[test]
    fn iterable_and_sequence_answer_as_python() {
        let source = "{% for v in [none, 1, true, 'ab', [1], {'a': 1}, nothing] %}\
            {{ v is iterable }}/{{ v is sequence }} {% endfor %}";
        assert_eq!(
            render(source, Value::from(())).as_deref(),
            Ok("False/False False/False False/False True/True True/True True/True True/True ")
        );
        let tools = "{% if tools is iterable and tools | length > 0 %}tools{% endif %}ok";
        let none = minijinja::context! { tools => Value::from(()) };
        assert_eq!(render(tools, none).as_deref(), Ok("ok"));
    }

    #[test]
    fn raise_exception_is_a_render_error() {
        let e = render(
            "{{ raise_exception('Only user and assistant roles') }}",
            Value::from(()),
        );
        assert_eq!(e, Err("Only user and assistant roles (line 1)".into()));
    }

    #[test]
    fn a_syntax_error_names_the_template() {
        let e = compile(&[("default", "{% if x %}")]);
        assert!(e.is_err_and(|e| e.starts_with("chat template \"default\": ")));
    }

    #[test]
    fn tool_use_is_chosen_only_with_tools() {
        let t = compile(&[("default", "d"), ("tool_use", "t")]);
        let t = t.unwrap_or_else(|e| panic!("{e}"));
        assert!(t.has_default());
        let render = |tools| t.choose(tools).map(|c| t.render(c, Value::from(())));
        assert_eq!(render(false), Some(Ok("d".into())));
        assert_eq!(render(true), Some(Ok("t".into())));
    }

    #[test]
    fn an_endless_template_runs_out_of_fuel() {
        let e = render(
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
            Value::from(()),
        );
        assert!(e.is_err());
    }
}
