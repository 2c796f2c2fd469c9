//! Python's `json.dumps` for template values: what the `tojson` filter of a Hugging Face chat
//! template prints.
//!
//! transformers replaces Jinja's own `tojson` (which escapes HTML characters) with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, so a
//! template's JSON has Python's spacing (`{"a": 1, "b": [1, 2]}`), keeps the order of keys
//! as the request gave them, leaves non-ASCII characters as they are, and prints floats as
//! Python's `repr` does (`1e-05`, `1e+16`, `0.5`). Every byte of that text becomes prompt
//! tokens, so this module reproduces it exactly for values that come from JSON.
//!
//! Invariant: a value JSON cannot carry (an undefined value, a function) is an error, as it is
//! in Python, never silently printed.

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The options of Python's `json.dumps` a template may pass to `tojson`.
pub(crate) struct Dumps {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl Dumps {
    /// Python's defaults: one line, `", "` and `": "`.
    pub(crate) fn new() -> Dumps {
        Dumps {
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            ensure_ascii: false,
            sort_keys: false,
        }
    }

    /// The options from the filter's keyword arguments (`indent`, `separators`,
    /// `ensure_ascii`, `sort_keys`).
    pub(crate) fn from_kwargs(kwargs: &Kwargs) -> Result<Dumps, Error> {
        let mut d = Dumps::new();
        let indent: Option<Value> = kwargs.get("indent")?;
        if let Some(v) = indent.filter(|v| !v.is_none()) {
            d.indent = Some(match v.as_i64() {
                Some(n) => " ".repeat(usize::try_from(n).unwrap_or(0)),
                None => v
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: bad indent"))?,
            });
            // Python: with an indent, the item separator loses its trailing space.
            d.item_sep = ",".into();
        }
        let separators: Option<Value> = kwargs.get("separators")?;
        if let Some(v) = separators.filter(|v| !v.is_none()) {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => {
                    d.item_sep = item.to_string();
                    d.key_sep = key.to_string();
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators",
                    ))
                }
            }
        }
        d.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
        d.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
        kwargs.assert_all_used()?;
        Ok(d)
    }

    /// `json.dumps(value)` with these options.
    pub(crate) fn dumps(&self, value: &Value) -> Result<String, Error> {
        let mut out = String::new();
        self.write(&mut out, value, 0)?;
        Ok(out)
    }

    fn write(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
        if depth > 256 {
            return Err(Error::new(ErrorKind::InvalidOperation, "tojson: too deep"));
        }
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => write_number(out, value),
            ValueKind::String => write_str(out, value.as_str().unwrap_or(""), self.ensure_ascii),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_seq(out, &items, depth)?;
            }
            ValueKind::Map => self.write_map(out, value, depth)?,
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {kind} is not JSON serializable"),
                ))
            }
        }
        Ok(())
    }

    fn write_seq(&self, out: &mut String, items: &[Value], depth: usize) -> Result<(), Error> {
        if items.is_empty() {
            out.push_str("[]");
            return Ok(());
        }
        out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            self.write(out, item, depth + 1)?;
        }
        self.newline(out, depth);
        out.push(']');
        Ok(())
    }

    fn write_map(&self, out: &mut String, map: &Value, depth: usize) -> Result<(), Error> {
        let mut pairs: Vec<(String, Value)> = Vec::new();
        for key in map.try_iter()? {
            let item = map.get_item(&key)?;
            pairs.push((key_text(&key)?, item));
        }
        if self.sort_keys {
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
        }
        if pairs.is_empty() {
            out.push_str("{}");
            return Ok(());
        }
        out.push('{');
        for (i, (key, item)) in pairs.iter().enumerate() {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            write_str(out, key, self.ensure_ascii);
            out.push_str(&self.key_sep);
            self.write(out, item, depth + 1)?;
        }
        self.newline(out, depth);
        out.push('}');
        Ok(())
    }

    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }
}

/// A map key as Python's `json.dumps` writes it: strings as they are, numbers, booleans and
/// None converted to their JSON text.
fn key_text(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_owned()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => {
            let mut s = String::new();
            write_number(&mut s, key);
            Ok(s)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        // integers print as they are (Display of an integer value is its decimal digits)
        let _ = write!(out, "{value}");
    } else {
        let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        out.push_str(&float_json(f));
    }
}

/// A float as `json.dumps` prints it: `float.__repr__`, with `NaN` and `Infinity` spelled as
/// JavaScript does.
fn float_json(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f < 0.0 { "-Infinity" } else { "Infinity" }.into()
    } else {
        float_repr(f)
    }
}

/// Python's `repr(float)`: the shortest digits that read back as the same float, in fixed
/// notation when the decimal exponent is in -5 < e < 16 (with at least one decimal), else
/// in scientific notation with a signed exponent of at least two digits.
pub(crate) fn float_repr(f: f64) -> String {
    // Rust's `{:e}` gives the same shortest round-trip digits: "d.ddde-7"
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if !(-5 < exp && exp < 16) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{dot}{rest}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    };
    format!("{sign}{body}")
}

/// A JSON string literal as Python writes it: `"` and `\` escaped, `\n \r \t \b \f` by name,
/// other control characters as `\u00XX`; with `ensure_ascii`, every non-ASCII character as
/// `\uXXXX` (UTF-16 surrogate pairs beyond the basic plane).
fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Value {
        serde_json::from_str(json).unwrap_or(Value::UNDEFINED)
    }

    #[test]
    fn dumps_like_python() {
        let v = parse(r#"{"b": [1, 2.5, true, null], "a": {"x": "é\n\"q\"", "e": {}}, "l": []}"#);
        let s = Dumps::new().dumps(&v).unwrap_or_default();
        assert_eq!(
            s,
            r#"{"b": [1, 2.5, true, null], "a": {"x": "é\n\"q\"", "e": {}}, "l": []}"#
        );
    }

    #[test]
    fn indent_and_sorting() {
        let v = parse(r#"{"b": [1], "a": 2}"#);
        let d = Dumps {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            key_sep: ": ".into(),
            ensure_ascii: true,
            sort_keys: true,
        };
        assert_eq!(
            d.dumps(&v).unwrap_or_default(),
            "{\n  \"a\": 2,\n  \"b\": [\n    1\n  ]\n}"
        );
        assert_eq!(
            d.dumps(&parse(r#""é😀""#)).unwrap_or_default(),
            r#""\u00e9\ud83d\ude00""#
        );
    }

    #[test]
    fn floats_as_python_repr() {
        for (f, s) in [
            (0.5, "0.5"),
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (123.456, "123.456"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e300, "1e+300"),
        ] {
            assert_eq!(float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn undefined_is_an_error() {
        assert!(Dumps::new().dumps(&Value::UNDEFINED).is_err());
    }
}
