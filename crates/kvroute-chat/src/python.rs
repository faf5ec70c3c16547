//! Python's text forms of template values: `str()`, `repr()` and `json.dumps`.
//!
//! A chat template runs in Python under `transformers`, so whatever it prints is Python's
//! `str()` of the value (`None`, `True`, `1.0`, `['a', 'b']`), and its `tojson` is
//! `json.dumps`. minijinja's own forms differ (`none`, `true`, `["a", "b"]`, and a `tojson`
//! that escapes HTML), so the renderer writes values through these functions instead.

use std::fmt::{self, Write};

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// Write `str(value)`: strings as they are, undefined as nothing (jinja2's `Undefined`), the
/// rest as [`write_repr`].
pub fn write_str(out: &mut impl Write, value: &Value) -> fmt::Result {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::String => out.write_str(value.as_str().unwrap_or_default()),
        _ => write_repr(out, value),
    }
}

/// Write `repr(value)`: `None`, `True`/`False`, ints, floats as Python writes them, quoted
/// strings, `[...]` lists, `(...)` tuples and `{k: v}` dicts (in insertion order).
///
/// Strings are quoted and escaped as Python's `repr` does it (see `python_escapes` for the
/// one gap: unassigned code points).
pub fn write_repr(out: &mut impl Write, value: &Value) -> fmt::Result {
    match value.kind() {
        ValueKind::Undefined => Ok(()),
        ValueKind::None => out.write_str("None"),
        ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() {
                ("(", ")")
            } else {
                ("[", "]")
            };
            out.write_str(open)?;
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.write_str(", ")?;
                    }
                    write_repr(out, &item)?;
                    count += 1;
                }
            }
            if value.is_tuple() && count == 1 {
                out.write_str(",")?;
            }
            out.write_str(close)
        }
        ValueKind::Map => {
            out.write_str("{")?;
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.write_str(", ")?;
                    }
                    write_repr(out, &key)?;
                    out.write_str(": ")?;
                    write_repr(out, &value.get_item(&key).unwrap_or_default())?;
                }
            }
            out.write_str("}")
        }
        _ => write!(out, "{value}"),
    }
}

fn write_number(out: &mut impl Write, value: &Value) -> fmt::Result {
    if value.is_integer() {
        return write!(out, "{value}");
    }
    match f64::try_from(value.clone()) {
        Ok(x) => write_float(out, x),
        Err(_) => write!(out, "{value}"),
    }
}

/// Write `repr(x)` of a Python float: the shortest digits that round-trip, in positional
/// notation when the decimal exponent is in [-4, 16) (with at least one fractional digit),
/// else as `d.ddde±XX`; `inf`, `-inf`, `nan`.
pub fn write_float(out: &mut impl Write, x: f64) -> fmt::Result {
    if x.is_nan() {
        return out.write_str("nan");
    }
    if x.is_infinite() {
        return out.write_str(if x > 0.0 { "inf" } else { "-inf" });
    }
    // Rust's `{:e}` writes the shortest round-trip digits ("-1.2345e-7", "1e16"), but where two
    // such strings are equally close to `x` it may take the upper one (8796093022208.3125:
    // "…313"), and Python the even one ("…312"). Formatting to that many digits rounds the
    // exact value half to even, which is Python's choice, and still round-trips (the closest
    // string of that length lies within `x`'s rounding interval if any does).
    let shortest = format!("{x:e}");
    let digit_count = shortest
        .split_once('e')
        .map_or(0, |(m, _)| m.bytes().filter(u8::is_ascii_digit).count());
    let scientific = format!("{x:.*e}", digit_count.saturating_sub(1));
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("`{:e}` always writes an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes a decimal exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    out.write_str(sign)?;
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let int_len = usize::try_from(exponent).unwrap_or(0) + 1;
            if digits.len() <= int_len {
                out.write_str(&digits)?;
                for _ in digits.len()..int_len {
                    out.write_char('0')?;
                }
                out.write_str(".0")
            } else {
                write!(out, "{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            out.write_str("0.")?;
            for _ in 0..(-exponent - 1) {
                out.write_char('0')?;
            }
            out.write_str(&digits)
        }
    } else {
        out.write_str(&digits[..1])?;
        if digits.len() > 1 {
            write!(out, ".{}", &digits[1..])?;
        }
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        write!(out, "e{exp_sign}{:02}", exponent.unsigned_abs())
    }
}

/// Whether Python's `repr` writes `c` as an escape: what `str.isprintable` rejects, i.e. the
/// control (Cc), format (Cf), private-use (Co), separator (Zl, Zp, Zs but the space) and
/// unassigned (Cn) characters. Cn is not listed (it changes with each Unicode version), so an
/// unassigned code point is written as it is where Python escapes it.
fn python_escapes(c: char) -> bool {
    matches!(c,
        '\0'..='\x1f' | '\x7f'..='\u{a0}' | '\u{ad}'
        | '\u{600}'..='\u{605}' | '\u{61c}' | '\u{6dd}' | '\u{70f}' | '\u{890}'..='\u{891}'
        | '\u{8e2}' | '\u{1680}' | '\u{180e}'
        | '\u{2000}'..='\u{200f}' | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{2064}'
        | '\u{2066}'..='\u{206f}' | '\u{3000}' | '\u{e000}'..='\u{f8ff}' | '\u{feff}'
        | '\u{fff9}'..='\u{fffb}' | '\u{110bd}' | '\u{110cd}' | '\u{13430}'..='\u{1343f}'
        | '\u{1bca0}'..='\u{1bca3}' | '\u{1d173}'..='\u{1d17a}' | '\u{e0001}'
        | '\u{e0020}'..='\u{e007f}' | '\u{f0000}'..='\u{10ffff}')
}

fn write_string_repr(out: &mut impl Write, s: &str) -> fmt::Result {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.write_char(quote)?;
    for c in s.chars() {
        match c {
            '\\' => out.write_str("\\\\")?,
            '\n' => out.write_str("\\n")?,
            '\r' => out.write_str("\\r")?,
            '\t' => out.write_str("\\t")?,
            c if c == quote => {
                out.write_char('\\')?;
                out.write_char(c)?;
            }
            c if python_escapes(c) => {
                let n = u32::from(c);
                if n < 0x100 {
                    write!(out, "\\x{n:02x}")?;
                } else if n < 0x10000 {
                    write!(out, "\\u{n:04x}")?;
                } else {
                    write!(out, "\\U{n:08x}")?;
                }
            }
            c => out.write_char(c)?,
        }
    }
    out.write_char(quote)
}

/// `json.dumps`' keyword arguments that `transformers`' `tojson` passes on.
#[derive(Debug, Clone, Default)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX` (`transformers` defaults it to false).
    pub ensure_ascii: bool,
    /// Pretty-print with this string per level (an int indent is that many spaces).
    pub indent: Option<String>,
    /// (item separator, key separator); by default `(", ", ": ")`, or `(",", ": ")` with an
    /// indent, as `json.dumps` picks them.
    pub separators: Option<(String, String)>,
    /// Write map keys in sorted order.
    pub sort_keys: bool,
}

/// Write `json.dumps(value, **options)`. `level` is the nesting depth (0 at the top).
///
/// # Errors
/// For undefined values and others JSON cannot hold (Python's "is not JSON serializable").
pub fn json_dumps(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    let (item_sep, key_sep) = match &options.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if options.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                write_number(out, value).map_err(write_error)?;
            } else {
                let x = f64::try_from(value.clone())?;
                if x.is_nan() {
                    out.push_str("NaN");
                } else if x.is_infinite() {
                    out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    write_float(out, x).map_err(write_error)?;
                }
            }
        }
        ValueKind::String => json_string(out, value.as_str().unwrap_or_default(), options),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                json_dumps(out, item, options, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if options.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                json_key(out, key, options)?;
                out.push_str(key_sep);
                json_dumps(out, &value.get_item(key)?, options, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {kind} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn write_error(_: fmt::Error) -> Error {
    Error::from(ErrorKind::WriteFailure)
}

/// A map key as `json.dumps` writes it: strings as strings, and ints, floats, booleans and
/// None as the string of their JSON form.
fn json_key(out: &mut String, key: &Value, options: &JsonOptions) -> Result<(), Error> {
    match key.kind() {
        ValueKind::String => json_string(out, key.as_str().unwrap_or_default(), options),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut text = String::new();
            json_dumps(&mut text, key, options, 0)?;
            json_string(out, &text, options);
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    }
    Ok(())
}

/// A JSON string as Python's encoder writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`,
/// other control characters as `\u00XX`, and (with `ensure_ascii`) non-ASCII as `\uXXXX`
/// (surrogate pairs above the BMP).
fn json_string(out: &mut String, s: &str, options: &JsonOptions) {
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
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if options.ensure_ascii && !c.is_ascii() => {
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
