//! Chat requests as the engine sees them: the messages rendered with the tokenizer's chat
//! template (`kvroute_chat`, minijinja set up as `transformers` sets up jinja2), to be encoded
//! without added special tokens (the template wrote them).
//!
//! The template and the special tokens come from the tokenizer directory as `transformers`
//! loads them: `tokenizer_config.json`'s `chat_template` (a string, or a list of named
//! templates of which `default` is used), else `chat_template.jinja`; `bos_token`,
//! `eos_token`, `unk_token`, `pad_token` (strings or serialized `AddedToken`s) and
//! `additional_special_tokens`.
//!
//! Messages are taken as vLLM passes them to a template that reads `content` as a string: a
//! list of content parts becomes its text parts joined by newlines, a null content the empty
//! string. A chat the router cannot render (an image part, a template that raises) is routed
//! untokenized, and the worker judges the request.

use std::path::Path;

use kvroute_chat::{ChatInput, ChatTemplate, DateTime, Value};
use serde_json::{Map, Value as Json};

use crate::config::ConfigError;

/// A special token as `tokenizer_config.json` writes it.
fn token_content(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// The tokenizer directory's chat template and special tokens (None: it has no template).
pub fn load_template(dir: &Path) -> Result<Option<ChatTemplate>, ConfigError> {
    let file = dir.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(None); // a tokenizer.json alone: no template to render with
    };
    let config: Json = serde_json::from_str(&text)
        .map_err(|e| ConfigError(format!("cannot read {}: {e}", file.display())))?;
    let mut source = match config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
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
    ChatTemplate::new(&source, special).map(Some).map_err(|e| {
        ConfigError(format!(
            "{}: chat template does not parse: {}",
            dir.display(),
            e.0
        ))
    })
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

/// `messages` with content-part lists joined into plain text and null content made empty;
/// None when a part is not text.
pub fn flattened(messages: &[Json]) -> Option<Vec<Json>> {
    messages
        .iter()
        .map(|m| {
            let Json::Object(fields) = m else {
                return Some(m.clone());
            };
            let content = match fields.get("content") {
                None | Some(Json::Null) => Json::String(String::new()),
                Some(Json::Array(parts)) => {
                    let texts: Option<Vec<&str>> = parts
                        .iter()
                        .map(|p| match p.get("type") {
                            Some(Json::String(t)) if t == "text" => p.get("text")?.as_str(),
                            _ => None,
                        })
                        .collect();
                    Json::String(texts?.join("\n"))
                }
                Some(other) => other.clone(),
            };
            let mut out: Map<String, Json> = fields.clone();
            out.insert("content".into(), content);
            Some(Json::Object(out))
        })
        .collect()
}

/// The text of a chat body's prompt (None: it cannot be rendered here, or its messages hold
/// more than `max_text_bytes` of text before the template adds to it).
pub fn render(
    template: &ChatTemplate,
    fields: &Map<String, Json>,
    messages: &[Json],
    max_text_bytes: usize,
) -> Option<String> {
    let flat = flattened(messages)?;
    let text_bytes: usize = flat
        .iter()
        .filter_map(|m| m.get("content")?.as_str())
        .map(str::len)
        .sum();
    if text_bytes > max_text_bytes {
        return None;
    }
    let add_generation_prompt = fields
        .get("add_generation_prompt")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    let kwargs: Vec<(String, Value)> = match fields.get("chat_template_kwargs") {
        Some(Json::Object(k)) => k
            .iter()
            .map(|(name, v)| (name.clone(), template_value(v)))
            .collect(),
        _ => Vec::new(),
    };
    let now: Option<DateTime> = template
        .uses_clock()
        .then(|| jiff::ZonedDateTime::now().datetime());
    let input = ChatInput {
        messages: Value::from(flat.iter().map(template_value).collect::<Vec<_>>()),
        add_generation_prompt,
        kwargs: &kwargs,
        now,
    };
    template.render(&input).ok()
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
        let t = ChatTemplate::new(CHATML, Vec::new()).unwrap();
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

    #[test]
    fn what_cannot_be_rendered_routes_untokenized() {
        let t = ChatTemplate::new(CHATML, Vec::new()).unwrap();
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
        let raising = ChatTemplate::new("{{ raise_exception('no') }}", Vec::new()).unwrap();
        assert!(render(&raising, &f, m, 1 << 20).is_none());
    }
}
