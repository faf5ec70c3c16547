//! Hugging Face chat templates, rendered to the text vLLM renders.
//!
//! A router predicts which worker holds a chat's KV blocks only if it tokenizes the chat exactly
//! as the engine does, and for `/v1/chat/completions` the engine first renders the chat with the
//! model's Jinja chat template (`tokenizer_config.json`'s `chat_template`) through
//! `transformers`' `apply_chat_template(..., tokenize=False)`. One character of difference in
//! that text moves every block boundary after it, so this crate renders the same template text
//! with [`minijinja`] set up the way `transformers` sets up jinja2
//! (`transformers/utils/chat_template_utils.py::_compile_jinja_template`):
//!
//! * `ImmutableSandboxedEnvironment`: templates cannot mutate what they are given; minijinja's
//!   values are immutable anyway, and Python's list/dict mutators are not provided.
//! * `trim_blocks=True, lstrip_blocks=True`: the newline after a block tag and the indentation
//!   before one are dropped. Every template is written against these, and the rendered
//!   whitespace is part of the prompt.
//! * `keep_trailing_newline=False` (jinja2's default): a single newline ending the template
//!   source is dropped.
//! * No autoescaping: `from_string` templates are not HTML; `<|im_start|>` stays as written.
//! * Undefined values are jinja2's default `Undefined`: printing one writes nothing, testing it
//!   is false, iterating it yields nothing, its attributes are errors
//!   ([`UndefinedBehavior::Lenient`]).
//! * `jinja2.ext.loopcontrols`: `{% break %}` and `{% continue %}`.
//! * `AssistantTracker`'s `{% generation %}...{% endgeneration %}`: only marks assistant text
//!   for training masks; rendering emits its body, so it is rewritten to an always-true
//!   `{% if %}` with the same whitespace controls (see [`rewrite_generation_tags`]).
//! * `raise_exception(message)`: the template refuses the chat; [`RenderError::Raised`] carries
//!   the message alone, as jinja2's `TemplateError` does.
//! * `tojson` overridden with `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`: jinja2's own escapes HTML characters, `transformers`' does not
//!   ([`python::json_dumps`]).
//! * `strftime_now(format)`: `datetime.now().strftime(format)`. The time is an input
//!   ([`ChatInput::now`]), so the crate reads no clock.
//!
//! And what Python itself does when a template runs in it: values print as `str()` prints them
//! (`None`, `True`, `['a', 1]`, `1e+16`; see [`python::write_str`]), the `string` filter
//! likewise, and Python's `str`/`dict`/`list` methods (`.strip()`, `.startswith()`,
//! `.items()`, `.get()`, `.split()`, ...) come from `minijinja_contrib::pycompat`, except
//! where its whitespace or casing is not Python's ([`pystr`]; also the `trim`, `capitalize`
//! and `title` filters).
//!
//! The context is the one `render_jinja_template` passes: `messages`, `tools` and `documents`
//! (None unless the request has them), `add_generation_prompt`, the tokenizer's special tokens
//! (`bos_token`, `eos_token`, ...), then the request's `chat_template_kwargs`, which override
//! special tokens as `{**special_tokens_map, **kwargs}` does.
//!
//! Known differences from jinja2 (none met by the templates checked in kvroute's tests):
//! * the `~` operator and `join` write booleans, None and floats as minijinja does (`true`,
//!   `none`, `10000000000000000.0`) where Python writes `True`, `None`, `1e+16`;
//! * iterating None renders nothing where jinja2 raises `TypeError`;
//! * code points unassigned in the Python's Unicode version: Rust's tables are newer, so case
//!   mappings and whitespace may differ, and inside a printed list or dict they are not
//!   escaped as `repr` does ([`python::write_repr`]);
//! * Python's `%` string formatting and Python methods beyond pycompat's and [`pystr`]'s are
//!   render errors.

pub mod pystr;
pub mod python;

use indexmap::IndexMap;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};

pub use jiff::civil::DateTime;
pub use minijinja::Value;

/// The name the one template is stored under in its environment (appears in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// Context variables the renderer sets itself; `chat_template_kwargs` may not replace them
/// (in Python they are keyword arguments of `render`, and a second value is a `TypeError`).
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// A template that does not parse: the message says where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileError(pub String);

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CompileError {}

/// Why a chat did not render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenderError {
    /// The template called `raise_exception(message)`: it refuses this chat (an unsupported
    /// role, a system message out of place, ...).
    Raised(String),
    /// Rendering failed otherwise (an undefined attribute, a type error, a bad kwarg).
    Failed(String),
}

impl std::fmt::Display for RenderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RenderError::Raised(message) | RenderError::Failed(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for RenderError {}

/// Marks an error as raised by the template's `raise_exception` (found again through
/// `Error::source` once minijinja has added the template location).
#[derive(Debug)]
struct Raised;

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("raised by the template")
    }
}

impl std::error::Error for Raised {}

/// One chat to render: what `apply_chat_template` receives per request.
#[derive(Debug, Clone)]
pub struct ChatInput<'a> {
    /// The messages (a sequence of maps with `role`, `content`, ...), content already plain
    /// text where the template expects a string.
    pub messages: Value,
    /// The tool definitions (a sequence of maps, as vLLM's `tool.model_dump()` writes them),
    /// or None.
    pub tools: Value,
    /// The documents for retrieval-augmented generation (a sequence of maps), or None.
    pub documents: Value,
    /// End with the header of an assistant reply.
    pub add_generation_prompt: bool,
    /// The request's `chat_template_kwargs` (e.g. `enable_thinking`), in order.
    pub kwargs: &'a [(String, Value)],
    /// The local wall-clock time `strftime_now` formats (Python's naive `datetime.now()`);
    /// None only when [`ChatTemplate::uses_clock`] is false, else `strftime_now` fails.
    pub now: Option<DateTime>,
}

/// A compiled chat template together with the tokenizer's special tokens it is rendered with.
///
/// Compiled once per tokenizer and shared: [`render`](Self::render) takes `&self` and the
/// type is `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, Value)>,
    uses_clock: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special_tokens", &self.special_tokens)
            .field("uses_clock", &self.uses_clock)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile `source` in `transformers`' environment.
    ///
    /// `special_tokens` are `bos_token`, `eos_token`, `pad_token`, `unk_token`,
    /// `additional_special_tokens` as `tokenizer_config.json` gives them, passed to every
    /// render as `transformers` passes its `special_tokens_map`.
    ///
    /// # Errors
    /// [`CompileError`] when the template does not parse.
    pub fn new(source: &str, special_tokens: Vec<(String, Value)>) -> Result<Self, CompileError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| CompileError(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(|state, value, method, args| {
            if let Some(s) = value.as_str()
                && let Some(result) = pystr::method(s, method, args)
            {
                return result;
            }
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        // jinja2's filters of these names call Python's str methods (or, for `title`, split on
        // Python's whitespace); minijinja's use Rust's notion of whitespace and words.
        env.add_filter("trim", |s: &str, chars: Option<&str>| {
            pystr::strip(s, chars, true, true).to_string()
        });
        env.add_filter("capitalize", |s: &str| pystr::capitalize(s));
        // jinja2's `sequence` is "has len() and []" (strings and dicts too) and `iterable` is
        // "iter() works" (not None); its Undefined is both. minijinja's differ for strings,
        // dicts and None, which templates test before calling `| length` on tools or content.
        env.add_test("sequence", |value: &Value| is_py_sequence(value));
        env.add_test("iterable", |value: &Value| {
            is_py_sequence(value) || value.kind() == ValueKind::Iterable
        });
        env.add_filter("title", |s: &str| pystr::title_filter(s));
        env.set_formatter(|out, _state, value| {
            python::write_str(out, value).map_err(|_| Error::from(ErrorKind::WriteFailure))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |value: Value| {
            let mut text = String::new();
            // Writing to a String cannot fail.
            let _ = python::write_str(&mut text, &value);
            Value::from(text)
        });
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| CompileError(describe(&e)))?;
        Ok(Self {
            env,
            special_tokens,
            uses_clock: source.contains("strftime_now"),
        })
    }

    /// Whether the template mentions `strftime_now`, i.e. whether a render needs the time.
    pub fn uses_clock(&self) -> bool {
        self.uses_clock
    }

    /// Render one chat.
    ///
    /// # Errors
    /// [`RenderError::Raised`] when the template calls `raise_exception`,
    /// [`RenderError::Failed`] when rendering fails otherwise or a kwarg names a variable the
    /// renderer sets itself (`messages`, `tools`, `documents`, `add_generation_prompt`).
    pub fn render(&self, input: &ChatInput<'_>) -> Result<String, RenderError> {
        let mut context: IndexMap<Value, Value> =
            IndexMap::with_capacity(6 + self.special_tokens.len() + input.kwargs.len());
        context.insert(Value::from("messages"), input.messages.clone());
        context.insert(Value::from("tools"), input.tools.clone());
        context.insert(Value::from("documents"), input.documents.clone());
        context.insert(
            Value::from("add_generation_prompt"),
            Value::from(input.add_generation_prompt),
        );
        if let Some(now) = input.now {
            context.insert(Value::from("strftime_now"), strftime_now(now));
        }
        for (name, value) in &self.special_tokens {
            context.insert(Value::from(name.as_str()), value.clone());
        }
        for (name, value) in input.kwargs {
            if RESERVED.contains(&name.as_str()) {
                return Err(RenderError::Failed(format!(
                    "chat_template_kwargs may not set {name:?}"
                )));
            }
            context.insert(Value::from(name.as_str()), value.clone());
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| RenderError::Failed(describe(&e)))?;
        template.render(Value::from_object(context)).map_err(|e| {
            if raised_by_template(&e) {
                RenderError::Raised(e.detail().unwrap_or_default().to_string())
            } else {
                RenderError::Failed(describe(&e))
            }
        })
    }
}

/// Whether `error` (or what it wraps) came from `raise_exception`.
fn raised_by_template(error: &Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(e) = source {
        if e.is::<Raised>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// An error's kind, detail and template line in one sentence.
fn describe(error: &Error) -> String {
    error.to_string()
}

/// `strftime_now` for one render: formats `now` with Python's strftime directives.
fn strftime_now(now: DateTime) -> Value {
    Value::from_function(move |format: &str| -> Result<String, Error> {
        jiff::fmt::strtime::format(format, now)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {e}")))
    })
}

/// `transformers`' `tojson` filter: `json.dumps` with its keyword arguments.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an int")
                })?;
                " ".repeat(usize::try_from(n).unwrap_or(0))
            }
        }),
    };
    let separators = match kwargs.get::<Option<Value>>("separators")? {
        Some(v) if !v.is_none() => {
            let items: Vec<Value> = v.try_iter()?.collect();
            match items.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => Some((
                    item.as_str().unwrap_or_default().to_string(),
                    key.as_str().unwrap_or_default().to_string(),
                )),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ => None,
    };
    kwargs.assert_all_used()?;
    let options = python::JsonOptions {
        ensure_ascii,
        indent,
        separators,
        sort_keys,
    };
    let mut out = String::new();
    python::json_dumps(&mut out, value, &options, 0)?;
    Ok(Value::from(out))
}

/// `source` with `{% generation %}`/`{% endgeneration %}` replaced by `{% if true %}`/
/// `{% endif %}`, keeping each tag's `-`/`+` whitespace markers so trimming is unchanged.
///
/// `transformers`' `AssistantTracker` renders the body unchanged unless it is collecting
/// assistant masks (never, for a prompt), and minijinja has no custom tags. One difference: the
/// body of a jinja2 call block is a macro, so a `{% set %}` inside it does not leak out, while
/// inside `{% if %}` it does.
pub fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match generation_tag(tag) {
            Some((len, open_marker, word, close_marker)) => {
                let replacement = if word == "generation" {
                    "if true"
                } else {
                    "endif"
                };
                out.push_str("{%");
                out.push_str(open_marker);
                out.push(' ');
                out.push_str(replacement);
                out.push(' ');
                out.push_str(close_marker);
                out.push_str("%}");
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// If `tag` starts with `{%[-+]? (generation|endgeneration) [-+]?%}`: its length, markers and
/// word.
fn generation_tag(tag: &str) -> Option<(usize, &str, &str, &str)> {
    let body = &tag[2..];
    let open_len = usize::from(body.starts_with(['-', '+']));
    let open_marker = &body[..open_len];
    let after_open = &body[open_len..];
    let word_start = after_open.len() - after_open.trim_start().len();
    let words = &after_open[word_start..];
    let word = ["endgeneration", "generation"]
        .into_iter()
        .find(|w| words.starts_with(w))?;
    let after_word = &words[word.len()..];
    let spaces = after_word.len() - after_word.trim_start().len();
    let tail = &after_word[spaces..];
    let close_len = usize::from(tail.starts_with(['-', '+']));
    if !tail[close_len..].starts_with("%}") {
        return None;
    }
    let close_marker = &tail[..close_len];
    let len = 2 + open_len + word_start + word.len() + spaces + close_len + 2;
    Some((len, open_marker, word, close_marker))
}

/// A map [`Value`] that keeps `pairs` in order, as a Python dict does.
pub fn ordered_map(pairs: impl IntoIterator<Item = (Value, Value)>) -> Value {
    Value::from_object(pairs.into_iter().collect::<IndexMap<Value, Value>>())
}

/// jinja2's `sequence` test: the value has `len()` and `[]` (strings, bytes, lists, dicts, and
/// jinja2's Undefined).
fn is_py_sequence(value: &Value) -> bool {
    matches!(
        value.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

#[cfg(test)]
mod tests;
