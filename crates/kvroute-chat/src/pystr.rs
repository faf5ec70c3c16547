//! Python's string methods where `minijinja_contrib::pycompat` (or a minijinja filter) differs
//! from Python: whitespace, splitting and casing.
//!
//! Python's whitespace (`str.isspace`, what `strip()`, `split()` and jinja2's `trim` use) is
//! Unicode's `White_Space` plus the four separators `\x1c`-`\x1f`; line boundaries
//! (`splitlines`) include `\v`, `\f`, `\x1c`-`\x1e`, `\x85`, `\u2028` and `\u2029`;
//! `str.title()` starts a word after any uncased character (a digit, `<`, `/`), and jinja2's
//! `title` filter after `-`, whitespace and opening brackets. Templates strip and split
//! message content, which is the client's text, so these must be Python's exactly.

use minijinja::value::from_args;
use minijinja::{Error, ErrorKind, Value};

/// Python's `str.isspace` for one character.
pub fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Python's line boundaries (`str.splitlines`); `\r\n` is one boundary.
fn is_line_boundary(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\x0b'
            | '\x0c'
            | '\x1c'
            | '\x1d'
            | '\x1e'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

/// Whether Python counts `c` as cased (it has a lowercase or uppercase form).
fn is_cased(c: char) -> bool {
    c.is_lowercase() || c.is_uppercase()
}

/// A string method Python defines differently from pycompat, or None to let pycompat answer.
pub fn method(s: &str, name: &str, args: &[Value]) -> Option<Result<Value, Error>> {
    Some(match name {
        "strip" | "lstrip" | "rstrip" => from_args::<(Option<&str>,)>(args)
            .map(|(chars,)| Value::from(strip(s, chars, name != "rstrip", name != "lstrip"))),
        "split" => from_args::<(Option<&str>, Option<i64>)>(args)
            .and_then(|(sep, maxsplit)| split(s, sep, maxsplit.unwrap_or(-1))),
        "splitlines" => from_args::<(Option<bool>,)>(args)
            .map(|(keepends,)| splitlines(s, keepends.unwrap_or(false))),
        "title" => from_args::<()>(args).map(|()| Value::from(title(s))),
        "capitalize" => from_args::<()>(args).map(|()| Value::from(capitalize(s))),
        _ => return None,
    })
}

/// `s.strip(chars)` (or `lstrip`/`rstrip`): Python whitespace when `chars` is None.
pub fn strip<'a>(s: &'a str, chars: Option<&str>, start: bool, end: bool) -> &'a str {
    let strip_char = |c: char| match chars {
        Some(chars) => chars.contains(c),
        None => is_python_space(c),
    };
    let s = if start {
        s.trim_start_matches(strip_char)
    } else {
        s
    };
    if end {
        s.trim_end_matches(strip_char)
    } else {
        s
    }
}

/// `s.split(sep, maxsplit)`.
fn split(s: &str, sep: Option<&str>, maxsplit: i64) -> Result<Value, Error> {
    let limit = usize::try_from(maxsplit).ok();
    let parts: Vec<Value> = match sep {
        Some("") => {
            return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
        }
        Some(sep) => match limit {
            Some(n) => s
                .splitn(n.saturating_add(1), sep)
                .map(Value::from)
                .collect(),
            None => s.split(sep).map(Value::from).collect(),
        },
        None => {
            let mut out = Vec::new();
            let mut rest = s.trim_start_matches(is_python_space);
            while !rest.is_empty() {
                if limit == Some(out.len()) {
                    out.push(Value::from(rest));
                    break;
                }
                match rest.find(is_python_space) {
                    Some(i) => {
                        out.push(Value::from(&rest[..i]));
                        rest = rest[i..].trim_start_matches(is_python_space);
                    }
                    None => {
                        out.push(Value::from(rest));
                        break;
                    }
                }
            }
            out
        }
    };
    Ok(Value::from(parts))
}

/// `s.splitlines(keepends)`.
fn splitlines(s: &str, keepends: bool) -> Value {
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if !is_line_boundary(c) {
            continue;
        }
        let mut end = i + c.len_utf8();
        if c == '\r' && chars.peek().is_some_and(|&(_, next)| next == '\n') {
            chars.next();
            end += 1;
        }
        out.push(Value::from(&s[start..if keepends { end } else { i }]));
        start = end;
    }
    if start < s.len() {
        out.push(Value::from(&s[start..]));
    }
    Value::from(out)
}

/// Push Python's title case of `c` (`str.title` and `str.capitalize` use it, not upper case).
///
/// Rust has no title-case mapping. It differs from upper case for the Latin digraphs
/// (`ǆ` → `ǅ`), and where upper case is several characters (`ß` → `SS`, `ﬁ` → `FI`) title case
/// upper-cases only the first (`Ss`, `Fi`). The exceptions to that rule (`ŉ`, Greek letters
/// with ypogegrammeni, `ǰ`-like letters with combining marks) are upper-cased.
fn push_titlecase(out: &mut String, c: char) {
    match c {
        'Ǆ' | 'ǅ' | 'ǆ' => out.push('ǅ'),
        'Ǉ' | 'ǈ' | 'ǉ' => out.push('ǈ'),
        'Ǌ' | 'ǋ' | 'ǌ' => out.push('ǋ'),
        'Ǳ' | 'ǲ' | 'ǳ' => out.push('ǲ'),
        'ß' | '\u{fb00}'..='\u{fb06}' | '\u{fb13}'..='\u{fb17}' | 'և' => {
            let mut upper = c.to_uppercase();
            out.extend(upper.next());
            out.extend(upper.flat_map(char::to_lowercase));
        }
        c => out.extend(c.to_uppercase()),
    }
}

/// `str.title()`: a cased character after an uncased one is title-cased, other cased ones
/// lower-cased.
pub fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut previous_is_cased = false;
    for c in s.chars() {
        if previous_is_cased {
            out.extend(c.to_lowercase());
        } else {
            push_titlecase(&mut out, c);
        }
        previous_is_cased = is_cased(c);
    }
    out
}

/// `str.capitalize()`: the first character title-cased, the rest lower-cased.
pub fn capitalize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    if let Some(first) = chars.next() {
        push_titlecase(&mut out, first);
    }
    out.extend(chars.flat_map(char::to_lowercase));
    out
}

/// jinja2's `title` filter: each word's first character upper-cased and the rest lower-cased,
/// words starting after `-`, whitespace, `(`, `{`, `[` or `<`.
pub fn title_filter(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut at_start = true;
    for c in s.chars() {
        if c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_python_space(c) {
            out.push(c);
            at_start = true;
        } else if at_start {
            out.extend(c.to_uppercase());
            at_start = false;
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: Value) -> Vec<String> {
        v.try_iter()
            .unwrap()
            .map(|x| x.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn whitespace_is_pythons() {
        assert_eq!(strip("\x1f a \u{3000}\x1c", None, true, true), "a");
        assert_eq!(strip("xxaxx", Some("x"), true, false), "axx");
        assert_eq!(
            strings(split(" a\x1eb  c ", None, -1).unwrap()),
            ["a", "b", "c"]
        );
        assert_eq!(strings(split(" a b  c ", None, 1).unwrap()), ["a", "b  c "]);
        assert_eq!(
            strings(split("a,b,,c", Some(","), 2).unwrap()),
            ["a", "b", ",c"]
        );
        assert!(split("a", Some(""), -1).is_err());
    }

    #[test]
    fn splitlines_knows_pythons_boundaries() {
        assert_eq!(
            strings(splitlines("a\r\nb\rc\x0bd\u{2028}e\n", false)),
            ["a", "b", "c", "d", "e"]
        );
        assert_eq!(strings(splitlines("a\r\nb", true)), ["a\r\n", "b"]);
        assert!(strings(splitlines("", false)).is_empty());
    }

    #[test]
    fn casing_is_pythons() {
        assert_eq!(title("0a </think> hello-WORLD"), "0A </Think> Hello-World");
        assert_eq!(capitalize("hELLO wORLD"), "Hello world");
        assert_eq!(title("ßa ﬁx ǆb"), "Ssa Fix ǅb");
        assert_eq!(capitalize("ßA"), "Ssa");
        assert_eq!(
            title_filter("hello </think>(x) a-b"),
            "Hello </think>(X) A-B"
        );
    }
}
