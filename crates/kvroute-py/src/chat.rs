//! `ChatTemplate` for Python: a Hugging Face chat template rendered natively
//! (`kvroute_chat`), which `kvroute.tokens.HFTokenizer.apply_chat_template` calls, so the
//! router, the emulator and the benchmark all render chats through the one implementation
//! the native router uses.

use std::str::FromStr;

use kvroute_chat::{ChatInput, DateTime, RenderError, Value};
use kvroute_serve::chat::{ChatTemplates, Template};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// Deepest nesting of lists and dicts converted for a template (deeper input is refused
/// rather than risking the native stack; JSON bodies the router accepts are far shallower).
const MAX_DEPTH: usize = 256;

/// A chat template compiled in ``transformers``' jinja2 environment, with the tokenizer's
/// special tokens (see the ``kvroute_chat`` crate docs for every compatibility setting).
///
/// Args:
///     source: the template text (``tokenizer_config.json``'s ``chat_template``).
///     special_tokens: ``bos_token``, ``eos_token``, ... passed to every render.
///
/// Raises:
///     ValueError: the template does not parse (the message says where).
#[pyclass(module = "kvroute._native", frozen)]
pub struct ChatTemplate {
    inner: ChatTemplates,
}

#[pymethods]
impl ChatTemplate {
    #[new]
    #[pyo3(signature = (source, special_tokens = None))]
    fn new(source: &str, special_tokens: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let special = match special_tokens {
            Some(dict) => pairs(dict)?,
            None => Vec::new(),
        };
        let inner = Template::new(source, special).map_err(|e| PyValueError::new_err(e.0))?;
        Ok(Self {
            inner: ChatTemplates::single(inner),
        })
    }

    /// Whether the template calls ``strftime_now`` (a render then reads the clock).
    #[getter]
    fn uses_clock(&self) -> bool {
        self.inner.default.chat.uses_clock()
    }

    /// The chat rendered to text, as ``apply_chat_template(..., tokenize=False)`` renders it.
    ///
    /// Args:
    ///     messages: OpenAI-style messages (dicts; content already plain text where the
    ///         template expects a string).
    ///     add_generation_prompt: end with the header of an assistant reply.
    ///     kwargs: the request's ``chat_template_kwargs`` (e.g. ``enable_thinking``).
    ///     now: the local time ``strftime_now`` formats, ISO 8601 without zone
    ///         (``"2026-12-01T20:05:09"``); the clock's local time when None.
    ///     tools, documents: the template's ``tools`` and ``documents`` (None by default).
    ///
    /// Raises:
    ///     ValueError: the template raised (``raise_exception``; the message is its text) or
    ///         failed to render.
    ///     TypeError: a value that is not JSON-like (str, int, float, bool, None, list, dict).
    #[pyo3(signature = (messages, add_generation_prompt = true, kwargs = None, now = None, tools = None, documents = None))]
    fn render(
        &self,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
        now: Option<&str>,
        tools: Option<&Bound<'_, PyAny>>,
        documents: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        let py = messages.py();
        let messages = to_value(messages, 0)?;
        let tools = tools.map_or(Ok(Value::from(())), |t| to_value(t, 0))?;
        let documents = documents.map_or(Ok(Value::from(())), |d| to_value(d, 0))?;
        let kwargs = match kwargs {
            Some(dict) => pairs(dict)?,
            None => Vec::new(),
        };
        let now = match now {
            Some(text) => Some(
                DateTime::from_str(text).map_err(|e| PyValueError::new_err(format!("now: {e}")))?,
            ),
            None if self.inner.default.chat.uses_clock() => {
                Some(jiff::ZonedDateTime::now().datetime())
            }
            None => None,
        };
        let input = ChatInput {
            messages,
            tools,
            documents,
            add_generation_prompt,
            kwargs: &kwargs,
            now,
        };
        py.detach(|| self.inner.default.chat.render(&input))
            .map_err(|e| match e {
                RenderError::Raised(message) | RenderError::Failed(message) => {
                    PyValueError::new_err(message)
                }
            })
    }

    /// The prompt text ``kvroute serve`` renders for a ``/v1/chat/completions`` body, as vLLM
    /// would build it (its messages as vLLM's conversation, its ``tools``, ``documents``,
    /// ``chat_template_kwargs`` and ``reasoning_effort``; see ``kvroute_serve::chat``), or
    /// None where the router routes the chat untokenized (a part that is not text, a body
    /// vLLM would refuse, a request's own ``chat_template``, ``continue_final_message``).
    ///
    /// Raises:
    ///     ValueError: ``body`` is not a JSON object with a ``messages`` list.
    fn render_request(&self, py: Python<'_>, body: &str) -> PyResult<Option<String>> {
        let body: serde_json::Value = serde_json::from_str(body)
            .map_err(|e| PyValueError::new_err(format!("body is not JSON: {e}")))?;
        let Some(fields) = body.as_object() else {
            return Err(PyValueError::new_err("body must be a JSON object"));
        };
        let Some(serde_json::Value::Array(messages)) = fields.get("messages") else {
            return Err(PyValueError::new_err("body needs a messages list"));
        };
        Ok(py.detach(|| kvroute_serve::chat::render(&self.inner, fields, messages, usize::MAX)))
    }
}

/// A dict's items as (name, value) pairs, in order.
fn pairs(dict: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Value)>> {
    let mut out = Vec::with_capacity(dict.len());
    for (key, value) in dict.iter() {
        let name: String = key
            .extract()
            .map_err(|_| PyTypeError::new_err("template variable names must be strings"))?;
        out.push((name, to_value(&value, 0)?));
    }
    Ok(out)
}

/// A JSON-like Python value as a template value (dicts keep their order).
fn to_value(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "chat template input nested deeper than {MAX_DEPTH}"
        )));
    }
    if obj.is_none() {
        return Ok(Value::from(()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        // A JSON body may hold a lone surrogate ("\ud800"): not text a template can render.
        let text = s.to_str().map_err(|_| {
            PyValueError::new_err("chat template input: a string with a lone surrogate")
        })?;
        return Ok(Value::from(text));
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::from(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return match obj.extract::<i64>() {
            Ok(n) => Ok(Value::from(n)),
            Err(_) => Ok(Value::from(obj.extract::<i128>().map_err(|_| {
                PyTypeError::new_err("chat template input: an integer beyond 128 bits")
            })?)),
        };
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::from(f.value()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items = obj
            .try_iter()?
            .map(|item| to_value(&item?, depth + 1))
            .collect::<PyResult<Vec<Value>>>()?;
        return Ok(Value::from(items));
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        let mut items = Vec::with_capacity(dict.len());
        for (key, value) in dict.iter() {
            items.push((to_value(&key, depth + 1)?, to_value(&value, depth + 1)?));
        }
        return Ok(kvroute_chat::ordered_map(items));
    }
    Err(PyTypeError::new_err(format!(
        "chat template input must be JSON-like, not {}",
        obj.get_type().name()?
    )))
}

/// A chat message's content (a string, a list of parts, or None) as the one string vLLM's
/// "string" content format hands a template (``kvroute_serve::chat::content_text``: text parts
/// joined by newlines, empty ones skipped, a system text's billing-header line dropped), or
/// None when a part is not text.
///
/// Raises:
///     ValueError: a string with a lone surrogate, or nesting deeper than the renderer takes.
///     TypeError: a value that is not JSON-like.
#[pyfunction]
fn message_text(role: &str, content: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let content = json_of(content, 0)?;
    Ok(kvroute_serve::chat::content_text(role, Some(&content)))
}

/// A JSON-like Python value as JSON (what the router parses a body into).
fn json_of(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<serde_json::Value> {
    use serde_json::Value as J;
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "chat template input nested deeper than {MAX_DEPTH}"
        )));
    }
    if obj.is_none() {
        return Ok(J::Null);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        let text = s.to_str().map_err(|_| {
            PyValueError::new_err("chat template input: a string with a lone surrogate")
        })?;
        return Ok(J::from(text));
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(J::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(n) = obj.extract::<i64>() {
            return Ok(J::from(n));
        }
        return Ok(J::from(obj.extract::<u64>().map_err(|_| {
            PyTypeError::new_err("chat template input: an integer beyond 64 bits")
        })?));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(J::from(f.value()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let items: PyResult<Vec<J>> = obj
            .try_iter()?
            .map(|item| json_of(&item?, depth + 1))
            .collect();
        return Ok(J::Array(items?));
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::with_capacity(dict.len());
        for (key, value) in dict.iter() {
            let key: String = key.extract().map_err(|_| {
                PyTypeError::new_err("chat template input: a dict key that is not a string")
            })?;
            map.insert(key, json_of(&value, depth + 1)?);
        }
        return Ok(J::Object(map));
    }
    Err(PyTypeError::new_err(format!(
        "chat template input must be JSON-like, not {}",
        obj.get_type().name()?
    )))
}

/// Add `ChatTemplate` and `message_text` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ChatTemplate>()?;
    m.add_function(wrap_pyfunction!(message_text, m)?)
}
