//! Chat requests as the engine sees them: the messages rendered with the tokenizer's chat
//! template (`kvroute_chat`, minijinja set up as `transformers` sets up jinja2), to be encoded
//! without added special tokens (the template wrote them).
//!
//! The template and the special tokens come from the tokenizer directory as `transformers`
//! loads them: `tokenizer_config.json`'s `chat_template` (a string, or a list of named
//! templates: `default`, and `tool_use` for a request with tools when there is one), else
//! `chat_template.jinja`; `bos_token`, `eos_token`, `unk_token`, `pad_token` (strings or
//! serialized `AddedToken`s) and `additional_special_tokens`.
//!
//! What the template receives is what vLLM 0.32 passes for a template that reads `content` as
//! a string (`vllm/renderers/chat_utils.py::parse_chat_messages`, `online_renderer.py`,
//! `hf.py::safe_apply_chat_template`), checked against a real vLLM's `/tokenize` in the vLLM
//! tier:
//!
//! * each message rebuilt with the keys vLLM keeps: `role`, `content` (a list of text parts
//!   joined by newlines, empty parts skipped; a null content the empty string; a system
//!   message's Claude Code billing-header line dropped), an assistant's `tool_calls` (an empty
//!   list dropped; each call's keys as pydantic orders them, `arguments` parsed from its JSON
//!   string, an empty object where that is empty, not JSON or not an object) and `reasoning`
//!   (also as `reasoning_content`), a tool message's `tool_call_id`, a string `name` and
//!   `task`, a developer message's `tools`; other keys are dropped;
//! * developer messages as system messages, merged into one first system message, when the
//!   template does not name the `developer` role;
//! * `tools` as `[tool.model_dump() for tool in request.tools]`: `type`, `function` with
//!   `name`, `description` and `parameters` (null when absent), `strict` and `defer_loading`
//!   only when set; `documents` as given;
//! * `chat_template_kwargs`, then `reasoning_effort` and the `enable_thinking` it implies
//!   (unless the kwargs set it).
//!
//! A chat the router cannot render as the engine would is routed untokenized, and the worker
//! judges the request: an image part, a template that raises, a body vLLM would refuse (a
//! malformed tool or tool call), a request's own `chat_template` or `continue_final_message`.

use std::path::Path;

use kvroute_chat::{ChatInput, ChatTemplate, CompileError, DateTime, Value};
use serde_json::{Map, Value as Json};

use crate::config::ConfigError;

/// The first line of a system text that Claude Code writes and vLLM drops (its value changes
/// on every request, so keeping it would end every prefix there).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// One compiled chat template and what vLLM reads from its source.
pub struct Template {
    /// The compiled template.
    pub chat: ChatTemplate,
    /// Whether the source names the `developer` role (quoted); if not, vLLM sends developer
    /// messages to it as system ones (`hf.py::_detect_developer_role_support`).
    pub developer_role: bool,
}

impl Template {
    /// `source` compiled with these special tokens.
    pub fn new(source: &str, special_tokens: Vec<(String, Value)>) -> Result<Self, CompileError> {
        Ok(Self {
            chat: ChatTemplate::new(source, special_tokens)?,
            developer_role: source.contains("\"developer\"") || source.contains("'developer'"),
        })
    }
}

/// A tokenizer's chat templates: the one every chat uses, and the one a request with tools
/// uses when the tokenizer names a `tool_use` template (`get_chat_template(tools=...)`).
pub struct ChatTemplates {
    /// The template of chats without tools (and with, when there is no `tool_use` one).
    pub default: Template,
    /// The `tool_use` template, if the tokenizer has one.
    pub tool_use: Option<Template>,
}

impl ChatTemplates {
    /// One template for every chat.
    pub fn single(template: Template) -> Self {
        Self {
            default: template,
            tool_use: None,
        }
    }
}

/// A special token as `tokenizer_config.json` writes it.
fn token_content(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The tokenizer directory's chat templates and special tokens (None: it has no template).
pub fn load_template(dir: &Path) -> Result<Option<ChatTemplates>, ConfigError> {
    let file = dir.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None); // a tokenizer.json alone: no template to render with
    };
    let config: Json = serde_json::from_str(&text)
        .map_err(|e| ConfigError::new(format!("cannot read {}: {e}", file.display())))?;
    let named = |name: &str| match config.get("chat_template") {
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    };
    let mut source = match config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        _ => named("default"),
    };
    if source.is_none() {
        source = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
    }
    let Some(source) = source else {
        return Ok(None);
    };
    let mut special = Vec::new();
    for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        if let Some(content) = token_content(config.get(key)) {
            special.push((key.to_owned(), Value::from(content)));
        }
    }
    if let Some(Json::Array(extra)) = config.get("additional_special_tokens") {
        let tokens: Vec<Value> = extra
            .iter()
            .filter_map(|t| token_content(Some(t)))
            .map(Value::from)
            .collect();
        if !tokens.is_empty() {
            special.push(("additional_special_tokens".to_owned(), Value::from(tokens)));
        }
    }
    let compile = |source: &str| {
        Template::new(source, special.clone()).map_err(|e| {
            ConfigError::new(format!(
                "{}: chat template does not parse: {}",
                dir.display(),
                e.0
            ))
        })
    };
    Ok(Some(ChatTemplates {
        default: compile(&source)?,
        tool_use: named("tool_use").map(|s| compile(&s)).transpose()?,
    }))
}

/// A JSON value as a template value: objects keep their keys' order, as Python dicts do
/// (recursion bounded by the body's depth limit, checked before parsing got here).
fn template_value(json: &Json) -> Value {
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => n
            .as_i64()
            .map(Value::from)
            .or_else(|| n.as_u64().map(Value::from))
            .unwrap_or_else(|| Value::from(n.as_f64().unwrap_or(f64::NAN))),
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(template_value).collect::<Vec<_>>()),
        Json::Object(fields) => kvroute_chat::ordered_map(
            fields
                .iter()
                .map(|(k, v)| (Value::from(k.as_str()), template_value(v))),
        ),
    }
}

/// A system text without Claude Code's billing-header line (None: nothing is left of it).
fn without_billing_header(text: &str) -> Option<&str> {
    if !text.starts_with(BILLING_HEADER) {
        return Some(text);
    }
    let rest = text.split_once('\n').map_or("", |(_, rest)| rest);
    (!rest.is_empty()).then_some(rest)
}

/// A message's content as the text the template sees (None: a part that is not text): vLLM's
/// "string" content format, the text parts joined by newlines, empty ones skipped, a system
/// text's billing-header line dropped. The one owner of that rule: the emulator and the
/// synthetic tokenizer's chats call it too (`kvroute._native.message_text`).
pub fn content_text(role: &str, content: Option<&Json>) -> Option<String> {
    let system = role == "system";
    let keep = |text: &str| -> Option<String> {
        let text = if system {
            without_billing_header(text)?
        } else {
            text
        };
        (!text.is_empty()).then(|| text.to_owned())
    };
    match content {
        None | Some(Json::Null) => Some(String::new()),
        Some(Json::String(text)) => Some(keep(text).unwrap_or_default()),
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type"), part.get("text"), part.get("uuid")) {
                    (Some(Json::String(t)), Some(Json::String(text)), None) if t == "text" => {
                        texts.extend(keep(text));
                    }
                    _ => return None,
                }
            }
            Some(texts.join("\n"))
        }
        Some(_) => None,
    }
}

/// An assistant message's tool call as vLLM hands it to the template (None: vLLM would refuse
/// it): `id`, `function` (`arguments` as an object, `name`, then its other keys), `type`, then
/// the call's other keys.
fn tool_call(call: &Json) -> Option<Json> {
    let Json::Object(call) = call else {
        return None;
    };
    let Some(Json::Object(function)) = call.get("function") else {
        return None;
    };
    let (Some(Json::String(_)), Some(Json::String(t))) = (call.get("id"), call.get("type")) else {
        return None;
    };
    let (Some(Json::String(arguments)), Some(Json::String(_))) =
        (function.get("arguments"), function.get("name"))
    else {
        return None;
    };
    if t != "function" {
        return None;
    }
    let arguments = match serde_json::from_str::<Json>(arguments) {
        Ok(Json::Object(parsed)) => Json::Object(parsed),
        _ => Json::Object(Map::new()),
    };
    let mut f = Map::with_capacity(function.len());
    f.insert("arguments".into(), arguments);
    f.insert("name".into(), function["name"].clone());
    for (k, v) in function {
        if k != "arguments" && k != "name" {
            f.insert(k.clone(), v.clone());
        }
    }
    let mut out = Map::with_capacity(call.len());
    out.insert("id".into(), call["id"].clone());
    out.insert("function".into(), Json::Object(f));
    out.insert("type".into(), call["type"].clone());
    for (k, v) in call {
        if !matches!(k.as_str(), "id" | "function" | "type") {
            out.insert(k.clone(), v.clone());
        }
    }
    Some(Json::Object(out))
}

/// `messages` as vLLM's conversation (see the module docs); None when a content part is not
/// text or vLLM would refuse a message.
pub fn conversation(messages: &[Json]) -> Option<Vec<Json>> {
    messages
        .iter()
        .map(|m| {
            let Json::Object(fields) = m else {
                return None;
            };
            let role = fields.get("role")?.as_str()?;
            let mut out = Map::new();
            out.insert("role".into(), Json::String(role.to_owned()));
            out.insert(
                "content".into(),
                Json::String(content_text(role, fields.get("content"))?),
            );
            match role {
                "assistant" => {
                    match fields.get("tool_calls") {
                        None | Some(Json::Null) => {}
                        Some(Json::Array(calls)) if calls.is_empty() => {}
                        Some(Json::Array(calls)) => {
                            let calls = calls.iter().map(tool_call).collect::<Option<_>>()?;
                            out.insert("tool_calls".into(), Json::Array(calls));
                        }
                        Some(_) => return None,
                    }
                    match fields.get("reasoning") {
                        None | Some(Json::Null) => {}
                        Some(r @ Json::String(_)) => {
                            out.insert("reasoning".into(), r.clone());
                            out.insert("reasoning_content".into(), r.clone());
                        }
                        Some(_) => return None,
                    }
                }
                "tool" => {
                    if let Some(id) = fields.get("tool_call_id") {
                        out.insert("tool_call_id".into(), id.clone());
                    }
                }
                _ => {}
            }
            for key in ["name", "task"] {
                if let Some(v @ Json::String(_)) = fields.get(key) {
                    out.insert(key.into(), v.clone());
                }
            }
            if role == "developer" {
                out.insert(
                    "tools".into(),
                    fields.get("tools").cloned().unwrap_or(Json::Null),
                );
            }
            Some(Json::Object(out))
        })
        .collect()
}

/// Developer messages as system ones, every system message merged into the first (contents
/// joined by blank lines, empty ones dropped) when one is not first or there are several:
/// what vLLM does for a template that does not name the developer role.
fn developer_as_system(conversation: Vec<Json>) -> Vec<Json> {
    let converted: Vec<Json> = conversation
        .into_iter()
        .map(|mut m| {
            if m["role"] == "developer"
                && let Json::Object(fields) = &mut m
            {
                fields.insert("role".into(), Json::String("system".into()));
                fields.shift_remove("tools");
            }
            m
        })
        .collect();
    if !converted.iter().skip(1).any(|m| m["role"] == "system") {
        return converted;
    }
    let (system, rest): (Vec<Json>, Vec<Json>) =
        converted.into_iter().partition(|m| m["role"] == "system");
    let contents: Vec<&str> = system
        .iter()
        .filter_map(|m| m["content"].as_str())
        .filter(|c| !c.is_empty())
        .collect();
    let mut merged = Map::new();
    merged.insert("role".into(), Json::String("system".into()));
    merged.insert("content".into(), Json::String(contents.join("\n\n")));
    std::iter::once(Json::Object(merged)).chain(rest).collect()
}

/// `tools` as vLLM's `tool.model_dump()` writes each (None: vLLM would refuse them).
fn tool_dicts(tools: &[Json]) -> Option<Vec<Json>> {
    let optional = |v: Option<&Json>, ok: fn(&Json) -> bool| match v {
        None | Some(Json::Null) => Some(None),
        Some(v) if ok(v) => Some(Some(v.clone())),
        Some(_) => None,
    };
    tools
        .iter()
        .map(|tool| {
            let Json::Object(tool) = tool else {
                return None;
            };
            if tool.get("type").is_some_and(|t| t != "function") {
                return None;
            }
            let Some(Json::Object(function)) = tool.get("function") else {
                return None;
            };
            let name = function.get("name").filter(|n| n.is_string())?;
            let description = optional(function.get("description"), Json::is_string)?;
            let parameters = optional(function.get("parameters"), Json::is_object)?;
            let strict = optional(function.get("strict"), Json::is_boolean)?;
            let tool_defer = optional(tool.get("defer_loading"), Json::is_boolean)?;
            let defer = optional(function.get("defer_loading"), Json::is_boolean)?
                .or_else(|| tool_defer.clone());
            let mut f = Map::new();
            f.insert("name".into(), name.clone());
            f.insert("description".into(), description.unwrap_or(Json::Null));
            f.insert("parameters".into(), parameters.unwrap_or(Json::Null));
            if let Some(strict) = strict {
                f.insert("strict".into(), strict);
            }
            if let Some(defer) = defer {
                f.insert("defer_loading".into(), defer);
            }
            let mut out = Map::new();
            out.insert("type".into(), Json::String("function".into()));
            out.insert("function".into(), Json::Object(f));
            if let Some(defer) = tool_defer {
                out.insert("defer_loading".into(), defer);
            }
            Some(Json::Object(out))
        })
        .collect()
}

/// The text of a chat body's prompt (None: it cannot be rendered here as the engine would, or
/// its messages hold more than `max_text_bytes` of text before the template adds to it).
pub fn render(
    templates: &ChatTemplates,
    fields: &Map<String, Json>,
    messages: &[Json],
    max_text_bytes: usize,
) -> Option<String> {
    let refused = |key: &str| fields.get(key).is_some_and(|v| !v.is_null() && v != false);
    if refused("chat_template") || refused("continue_final_message") {
        return None;
    }
    let tools = match fields.get("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(tools)) => Some(tool_dicts(tools)?),
        Some(_) => return None,
    };
    let template = match (&tools, &templates.tool_use) {
        (Some(_), Some(tool_use)) => tool_use,
        _ => &templates.default,
    };
    let mut conversation = conversation(messages)?;
    let text_bytes: usize = conversation
        .iter()
        .filter_map(|m| m.get("content")?.as_str())
        .map(str::len)
        .sum();
    if text_bytes > max_text_bytes {
        return None;
    }
    if !template.developer_role && conversation.iter().any(|m| m["role"] == "developer") {
        conversation = developer_as_system(conversation);
    }
    let add_generation_prompt = fields
        .get("add_generation_prompt")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    let mut kwargs: Vec<(String, Value)> = match fields.get("chat_template_kwargs") {
        Some(Json::Object(k)) => k
            .iter()
            .map(|(name, v)| (name.clone(), template_value(v)))
            .collect(),
        _ => Vec::new(),
    };
    // `build_chat_params`: a reasoning effort reaches the template, and turns thinking on
    // unless it is "none" (where the kwargs do not say).
    if let Some(Json::String(effort)) = fields.get("reasoning_effort") {
        let thinking = !kwargs.iter().any(|(k, _)| k == "enable_thinking");
        if effort != "auto" {
            kwargs.retain(|(k, _)| k != "reasoning_effort");
            kwargs.push(("reasoning_effort".into(), Value::from(effort.as_str())));
        }
        if thinking {
            kwargs.push(("enable_thinking".into(), Value::from(effort != "none")));
        }
    }
    let documents = match fields.get("documents") {
        Some(d @ Json::Array(_)) => template_value(d),
        _ => Value::from(()),
    };
    let now: Option<DateTime> = template
        .chat
        .uses_clock()
        .then(|| jiff::ZonedDateTime::now().datetime());
    let input = ChatInput {
        messages: Value::from(conversation.iter().map(template_value).collect::<Vec<_>>()),
        tools: tools.map_or_else(
            || Value::from(()),
            |t| Value::from(t.iter().map(template_value).collect::<Vec<_>>()),
        ),
        documents,
        add_generation_prompt,
        kwargs: &kwargs,
        now,
    };
    template.chat.render(&input).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn fields(body: &str) -> Map<String, Json> {
        match serde_json::from_str(body).unwrap() {
            Json::Object(o) => o,
            _ => unreachable!(),
        }
    }

    #[test]
    fn messages_render_as_the_template_writes_them() {
        let t = ChatTemplates::single(Template::new(CHATML, Vec::new()).unwrap());
        let f = fields(
            r#"{"messages": [{"role": "system", "content": null},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        );
        let Json::Array(m) = &f["messages"] else {
            unreachable!()
        };
        let text = render(&t, &f, m, 1 << 20).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\n<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
        );
        let f2 = fields(
            r#"{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}"#,
        );
        let Json::Array(m2) = &f2["messages"] else {
            unreachable!()
        };
        assert_eq!(
            render(&t, &f2, m2, 1 << 20).unwrap(),
            "<|im_start|>user\nx<|im_end|>\n"
        );
    }

    /// The template context as JSON: what vLLM passes, key for key.
    const DUMP: &str = "{{ messages | tojson }}\n{{ tools | tojson }}";

    fn dump(body: &str) -> Option<String> {
        let t = ChatTemplates::single(Template::new(DUMP, Vec::new()).unwrap());
        let f = fields(body);
        let Json::Array(m) = &f["messages"] else {
            unreachable!()
        };
        render(&t, &f, m, 1 << 20)
    }

    /// The expected text is what vLLM 0.32's `/tokenize` rendered for this body with this
    /// template (detokenized), 2026-12-04.
    #[test]
    fn messages_and_tools_reach_the_template_as_vllm_passes_them() {
        let body = r#"{"messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nreal system"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                {"type": "text", "text": "b"}], "extra": 1, "name": "bob"},
            {"role": "assistant", "content": null, "reasoning": "hmm", "reasoning_content": "old",
                "tool_calls": [{"type": "function", "function": {"name": "f",
                "arguments": "{\"z\": 1, \"a\": [2]}"}, "id": "c1", "index": 0}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "not json",
                "name": "g"}, "id": "c2", "type": "function"}]}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                "extra": 5}, "x": 1},
                {"function": {"name": "g", "description": "G", "strict": true}, "defer_loading": false}]}"#;
        let messages = r#"[{"role": "system", "content": "real system"}, {"role": "user", "content": "a\nb", "name": "bob"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"arguments": {"z": 1, "a": [2]}, "name": "f"}, "type": "function", "index": 0}], "reasoning": "hmm", "reasoning_content": "hmm"}, {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}, {"role": "assistant", "content": "ok"}, {"role": "assistant", "content": "x", "tool_calls": [{"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"}]}]"#;
        let tools = r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}, {"type": "function", "function": {"name": "g", "description": "G", "parameters": null, "strict": true, "defer_loading": false}, "defer_loading": false}]"#;
        assert_eq!(dump(body).unwrap(), format!("{messages}\n{tools}"));
    }

    #[test]
    fn developer_messages_become_one_first_system_message_unless_the_template_names_the_role() {
        let body = r#"{"messages": [{"role": "system", "content": "s1"},
            {"role": "developer", "content": "d", "tools": []}, {"role": "user", "content": "u"}]}"#;
        assert_eq!(
            dump(body).unwrap(),
            r#"[{"role": "system", "content": "s1\n\nd"}, {"role": "user", "content": "u"}]"#
                .to_owned()
                + "\nnull"
        );
        let named = ChatTemplates::single(
            Template::new("{{ messages | tojson }} 'developer'", Vec::new()).unwrap(),
        );
        let f = fields(body);
        let Json::Array(m) = &f["messages"] else {
            unreachable!()
        };
        assert_eq!(
            render(&named, &f, m, 1 << 20).unwrap(),
            r#"[{"role": "system", "content": "s1"}, {"role": "developer", "content": "d", "tools": []}, {"role": "user", "content": "u"}] 'developer'"#
        );
    }

    #[test]
    fn a_request_with_tools_uses_the_tool_use_template() {
        let templates = ChatTemplates {
            default: Template::new("plain", Vec::new()).unwrap(),
            tool_use: Some(Template::new("tools {{ tools | length }}", Vec::new()).unwrap()),
        };
        let render_body = |body: &str| {
            let f = fields(body);
            let Json::Array(m) = &f["messages"] else {
                unreachable!()
            };
            render(&templates, &f, m, 1 << 20)
        };
        let user = r#""messages": [{"role": "user", "content": "u"}]"#;
        assert_eq!(render_body(&format!("{{{user}}}")).unwrap(), "plain");
        assert_eq!(
            render_body(&format!(
                r#"{{{user}, "tools": [{{"type": "function", "function": {{"name": "f"}}}}]}}"#
            ))
            .unwrap(),
            "tools 1"
        );
    }

    #[test]
    fn reasoning_effort_reaches_the_template_and_turns_thinking_on() {
        let t = ChatTemplates::single(
            Template::new("{{ reasoning_effort }} {{ enable_thinking }}", Vec::new()).unwrap(),
        );
        let render_body = |body: &str| {
            let f = fields(body);
            let Json::Array(m) = &f["messages"] else {
                unreachable!()
            };
            render(&t, &f, m, 1 << 20).unwrap()
        };
        let user = r#""messages": [{"role": "user", "content": "u"}]"#;
        assert_eq!(
            render_body(&format!(r#"{{{user}, "reasoning_effort": "low"}}"#)),
            "low True"
        );
        assert_eq!(
            render_body(&format!(r#"{{{user}, "reasoning_effort": "none"}}"#)),
            "none False"
        );
        assert_eq!(
            render_body(&format!(
                r#"{{{user}, "reasoning_effort": "high", "chat_template_kwargs": {{"enable_thinking": false}}}}"#
            )),
            "high False"
        );
        assert_eq!(render_body(&format!("{{{user}}}")), " ");
    }

    #[test]
    fn what_cannot_be_rendered_routes_untokenized() {
        let t = ChatTemplates::single(Template::new(CHATML, Vec::new()).unwrap());
        let f = fields(
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
        );
        let Json::Array(m) = &f["messages"] else {
            unreachable!()
        };
        assert!(render(&t, &f, m, 1 << 20).is_none());
        let f = fields(r#"{"messages": [{"role": "user", "content": "too long"}]}"#);
        let Json::Array(m) = &f["messages"] else {
            unreachable!()
        };
        assert!(render(&t, &f, m, 4).is_none());
        let raising = ChatTemplates::single(
            Template::new("{{ raise_exception('no') }}", Vec::new()).unwrap(),
        );
        assert!(render(&raising, &f, m, 1 << 20).is_none());
        // What the engine renders otherwise, or refuses: the request's own template,
        // continuing the last message, a tool without a name, a tool call without an id.
        let user = r#""messages": [{"role": "user", "content": "u"}]"#;
        for extra in [
            r#""chat_template": "{{ messages }}""#,
            r#""continue_final_message": true"#,
            r#""tools": [{"type": "function", "function": {}}]"#,
            r#""tools": {"type": "function"}"#,
        ] {
            assert!(dump(&format!("{{{user}, {extra}}}")).is_none(), "{extra}");
        }
        assert!(dump(&format!(r#"{{{user}, "continue_final_message": false}}"#)).is_some());
        let call = r#"{"messages": [{"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}"#;
        assert!(dump(call).is_none());
    }
}
