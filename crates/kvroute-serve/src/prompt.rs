//! From a request body to what routing needs: the prompt's length and its full blocks' chained
//! hashes, as the engine will see them (pure: no I/O).
//!
//! - A completion prompt given as token ids is used as given (exact, and the cheapest). A batch
//!   (a list of prompts) is routed by its first prompt, which vLLM serves first.
//! - A completion prompt given as text is encoded with `add_special_tokens`, as vLLM encodes
//!   it, through the engines' tokenizer (`kvroute_tokenize::TextChunker`: each text piece is
//!   tokenized once). Without a tokenizer, kvroute's built-in synthetic tokenizer
//!   (`kvroute_tokenize::synthetic`, what emulated workers without a tokenizer use).
//! - Chat messages are checked (a non-empty list of objects with a role), rendered with the
//!   tokenizer's chat template ([`crate::chat`]) and encoded without added special tokens (the
//!   template wrote them); without a tokenizer, as ChatML for the synthetic tokenizer. A chat
//!   that cannot be rendered is routed untokenized.
//! - With retention on, a tokenized prompt (not a batch) keeps its ids ([`Retained`]): a
//!   refresh of its prefix sends them as token ids, whichever route the prompt came by.
//!
//! The body is parsed once with `serde_json` (nesting past its recursion limit is an error, not
//! a stack overflow) and its depth checked against the router's own limit before any field is
//! read.

use std::path::Path;
use std::sync::Mutex;

use kvroute_core::blocks::{BlockHasher, BlockKeys};
use kvroute_tokenize::{ChunkerConfig, SyntheticTokenizer, TextChunker};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::config::ConfigError;
use crate::models::AdapterNames;

/// The two generation routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

impl Route {
    /// The route's path: what is forwarded to a worker, never the client's spelling of it.
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }
}

/// A body the router cannot route as it stands (the client's mistake: a 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRequest {
    pub message: String,
    /// The offending field, for the OpenAI error's `param`.
    pub param: Option<&'static str>,
    /// The body nested deeper than the limit (counted as `json_too_deep`).
    pub too_deep: bool,
}

fn bad(message: impl Into<String>, param: Option<&'static str>) -> BadRequest {
    BadRequest {
        message: message.into(),
        param,
        too_deep: false,
    }
}

/// What routing needs from one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    /// Prompt tokens (0 when untokenized and unknown).
    pub tokens: usize,
    /// Chained hashes of its full blocks (empty when untokenized), under its LoRA adapter
    /// and cache salt as vLLM keys them (`kvroute_core::blocks::BlockKeys`).
    pub block_hashes: Vec<u64>,
    /// The body's `model` (None when absent): routed only among the workers that serve it.
    pub model: Option<String>,
    /// Routed without a prefix match (no tokenizer, or longer than any engine takes).
    pub untokenized: bool,
    /// What retention needs of a tokenized prompt (None when untokenized, for a batch, or when
    /// retention is off).
    pub retained: Option<Retained>,
}

impl Prompt {
    /// A prompt routed without a prefix match, of `tokens` tokens (0: not known).
    pub fn untokenized(tokens: usize) -> Self {
        Self {
            tokens,
            block_hashes: Vec::new(),
            model: None,
            untokenized: true,
            retained: None,
        }
    }
}

/// A tokenized prompt as retention reads it: a refresh sends the prefix's ids (as token ids
/// to `/v1/completions`, whatever route the prompt came by: for text and chats, the ids the
/// router encoded, which are the engine's when its tokenizer and chat template are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retained {
    pub ids: Vec<u32>,
    /// `max_tokens` (a chat's `max_completion_tokens` first), or [`DEFAULT_OUTPUT_TOKENS`].
    pub output_tokens: usize,
    /// The body's `model`, sent on with the refreshes.
    pub model: Option<String>,
    /// The body's `cache_salt`, sent on with the refreshes.
    pub cache_salt: Option<String>,
}

/// Output budget assumed for a body without `max_tokens` (vLLM's default is the context).
pub const DEFAULT_OUTPUT_TOKENS: usize = 16;

/// Depth of the deepest list or object in `value` (a scalar is depth 0), walking without
/// recursion.
fn depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        deepest = deepest.max(d + 1);
        stack.extend(children.map(|c| (c, d + 1)));
    }
    deepest
}

/// Turns bodies into [`Prompt`]s: the block hasher, and the tokenizer when there is one.
pub struct Prompts {
    hasher: BlockHasher,
    /// The engines' tokenizer, in pieces; a lock because its caches are shared by all threads
    /// (an encode of a new 2,000-token prompt holds it ~1 ms, a cached one ~50 µs).
    chunker: Option<Mutex<Encoder>>,
    /// The tokenizer's chat template, if it has one.
    template: Option<crate::chat::ChatTemplates>,
    /// Without a tokenizer directory: the built-in synthetic tokenizer.
    synthetic: Option<SyntheticTokenizer>,
    max_json_depth: usize,
    /// Longest prompt (in tokens, or text bytes) worth tokenizing and hashing.
    max_prompt_tokens: usize,
    max_text_bytes: usize,
    /// Keep prompts' ids for retention.
    keep_ids: bool,
    /// The tokenizer's maximum length (`model_max_length`) and longest vocabulary entry in
    /// bytes, when it states the first: what the body limit is derived from.
    limits: Option<(usize, usize)>,
    /// The workers' LoRA adapters: a `model` naming one keys every block with its name.
    adapters: AdapterNames,
}

/// The tokenizer in pieces where its pipeline allows, whole otherwise.
enum Encoder {
    Pieces(Box<TextChunker>),
    Whole(Box<Tokenizer>),
}

/// The `model_max_length` a tokenizer directory's `tokenizer_config.json` states, when it is a
/// real one (`transformers` writes a 1e30 sentinel when it does not know).
fn model_max_length(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let config: Value = serde_json::from_str(&text).ok()?;
    let value = config.get("model_max_length")?.as_f64()?;
    // Truncated as Python's int() does.
    (value > 0.0 && value < 1e8).then_some(value as usize)
}

/// Longest token-id prompt hashed (more ids than any engine accepts are routed untokenized).
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;
/// The synthetic tokenizer's vocabulary (`kvroute.tokens.SyntheticTokenizer`'s default).
pub const SYNTHETIC_VOCAB: u32 = 32000;
/// Longest prompt text tokenized (~1M tokens).
pub const MAX_TEXT_BYTES: usize = 4 << 20;

impl Prompts {
    /// Prompts hashed with `hasher`, text encoded with the tokenizer in `tokenizer_dir`.
    pub fn new(
        hasher: BlockHasher,
        tokenizer_dir: Option<&Path>,
        cache_bytes: usize,
        max_json_depth: usize,
        keep_ids: bool,
    ) -> Result<Self, ConfigError> {
        let template = match tokenizer_dir {
            Some(dir) => crate::chat::load_template(dir)?,
            None => None,
        };
        let mut longest_token_bytes = None;
        let chunker = match tokenizer_dir {
            None => None,
            Some(dir) => {
                let file = dir.join("tokenizer.json");
                let tokenizer = Tokenizer::from_file(&file).map_err(|e| {
                    ConfigError::new(format!("cannot load the tokenizer {}: {e}", file.display()))
                })?;
                longest_token_bytes = tokenizer.get_vocab(true).keys().map(String::len).max();
                let config = ChunkerConfig {
                    piece_cache_bytes: cache_bytes / 2,
                    word_cache_bytes: cache_bytes / 8,
                    ..ChunkerConfig::default()
                };
                Some(Mutex::new(
                    match TextChunker::new(tokenizer.clone(), config) {
                        Ok(c) => Encoder::Pieces(Box::new(c)),
                        Err(_) => Encoder::Whole(Box::new(tokenizer)),
                    },
                ))
            }
        };
        let limits = tokenizer_dir
            .and_then(model_max_length)
            .zip(longest_token_bytes);
        let synthetic = tokenizer_dir.is_none().then(|| {
            SyntheticTokenizer::new(SYNTHETIC_VOCAB).expect("a vocabulary past the specials")
        });
        Ok(Self {
            hasher,
            chunker,
            template,
            synthetic,
            max_json_depth,
            max_prompt_tokens: MAX_PROMPT_TOKENS,
            max_text_bytes: MAX_TEXT_BYTES,
            keep_ids,
            limits,
            adapters: AdapterNames::default(),
        })
    }

    /// The adapter names this parser hashes under, for the fleet to keep up to date.
    pub fn adapter_names(&self) -> AdapterNames {
        self.adapters.clone()
    }

    /// The block keys of a body: its `model` when that names a served LoRA adapter, and its
    /// `cache_salt` (already checked by [`Prompts::parse`]).
    fn keys(&self, fields: &serde_json::Map<String, Value>) -> BlockKeys {
        let lora = fields
            .get("model")
            .and_then(Value::as_str)
            .filter(|m| self.adapters.contains(m));
        BlockKeys::new(lora, fields.get("cache_salt").and_then(Value::as_str))
    }

    /// The tokenizer's `(maximum length, longest token's bytes)`, when it states a maximum.
    pub fn tokenizer_limits(&self) -> Option<(usize, usize)> {
        self.limits
    }

    /// The refusal of a body nested deeper than the limit.
    fn too_deep(&self) -> BadRequest {
        BadRequest {
            too_deep: true,
            ..bad(
                format!("JSON nested deeper than {} levels", self.max_json_depth),
                None,
            )
        }
    }

    /// The prompt of `body` for `route`.
    pub fn parse(&self, route: Route, body: &[u8]) -> Result<Prompt, BadRequest> {
        let (mut prompt, model) = self.parse_body(route, body)?;
        prompt.model = model;
        Ok(prompt)
    }

    /// [`Prompts::parse`] but the prompt's `model`, returned beside it.
    fn parse_body(
        &self,
        route: Route,
        body: &[u8],
    ) -> Result<(Prompt, Option<String>), BadRequest> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            if e.to_string().contains("recursion limit") {
                self.too_deep()
            } else {
                bad(format!("body is not valid JSON: {e}"), None)
            }
        })?;
        if depth(&value) > self.max_json_depth {
            return Err(self.too_deep());
        }
        let Value::Object(fields) = &value else {
            return Err(bad("body must be a JSON object", None));
        };
        // vLLM's rule (its request models' `check_cache_salt_support`).
        if let Some(salt) = fields.get("cache_salt").filter(|v| !v.is_null())
            && salt.as_str().is_none_or(str::is_empty)
        {
            return Err(bad(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
                Some("cache_salt"),
            ));
        }
        let model = fields
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned);
        self.prompt_of(route, fields).map(|p| (p, model))
    }

    /// The prompt of a body's `fields` for `route`.
    fn prompt_of(
        &self,
        route: Route,
        fields: &serde_json::Map<String, Value>,
    ) -> Result<Prompt, BadRequest> {
        let untokenized = Prompt::untokenized;
        match route {
            Route::Chat => {
                let Some(Value::Array(messages)) = fields.get("messages") else {
                    return Err(bad("messages: expected a non-empty list", Some("messages")));
                };
                if messages.is_empty() {
                    return Err(bad("messages: expected a non-empty list", Some("messages")));
                }
                for (i, m) in messages.iter().enumerate() {
                    if !matches!(m.get("role"), Some(Value::String(_))) {
                        return Err(bad(
                            format!("messages.{i}: expected an object with a role"),
                            Some("messages"),
                        ));
                    }
                }
                let text = match (&self.template, &self.synthetic) {
                    (Some(t), _) => crate::chat::render(t, fields, messages, self.max_text_bytes),
                    (None, Some(_)) => Self::chatml(fields, messages),
                    (None, None) => None,
                };
                Ok(match text {
                    Some(text) if text.len() <= self.max_text_bytes => {
                        self.encoded(&text, false, fields, false)
                    }
                    _ => untokenized(0),
                })
            }
            Route::Completions => {
                let mut prompt = fields.get("prompt");
                let mut batch = false;
                if let Some(Value::Array(items)) = prompt
                    && matches!(items.first(), Some(Value::String(_) | Value::Array(_)))
                {
                    prompt = items.first(); // a batch: routed by its first prompt
                    batch = true;
                }
                match prompt {
                    Some(Value::String(text)) if text.len() <= self.max_text_bytes => {
                        Ok(self.encoded(text, true, fields, batch))
                    }
                    Some(Value::String(_)) => Ok(untokenized(0)),
                    Some(Value::Array(items)) if !items.is_empty() => {
                        if items.len() > self.max_prompt_tokens {
                            return Ok(untokenized(items.len()));
                        }
                        let ids: Option<Vec<u32>> = items
                            .iter()
                            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                            .collect();
                        let ids = ids.ok_or_else(|| {
                            bad(
                                "prompt: token ids must be integers in [0, 2^32)",
                                Some("prompt"),
                            )
                        })?;
                        Ok(self.tokenized(ids, fields, batch))
                    }
                    _ => Err(bad(
                        "prompt: expected a string, a list of token ids, or a list of those",
                        Some("prompt"),
                    )),
                }
            }
        }
    }

    /// A chat as the synthetic tokenizer's ChatML (None when a content is not text).
    fn chatml(fields: &serde_json::Map<String, Value>, messages: &[Value]) -> Option<String> {
        let flat = crate::chat::conversation(messages)?;
        let pairs: Option<Vec<(&str, &str)>> = flat
            .iter()
            .map(|m| Some((m.get("role")?.as_str()?, m.get("content")?.as_str()?)))
            .collect();
        let add_generation_prompt = fields
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        Some(SyntheticTokenizer::chat_text(pairs?, add_generation_prompt))
    }

    /// The prompt of these token ids, with what retention needs of it unless it is the first
    /// of a `batch` (a refresh ahead of a batch would serve only its first prompt).
    fn tokenized(
        &self,
        ids: Vec<u32>,
        fields: &serde_json::Map<String, Value>,
        batch: bool,
    ) -> Prompt {
        let budget = |key: &str| fields.get(key).and_then(Value::as_u64).filter(|&n| n > 0);
        let keys = self.keys(fields);
        let block_hashes = self.hasher.hash_blocks_keyed(&ids, None, 0, None, &keys);
        let tokens = ids.len();
        let retained = (self.keep_ids && !batch).then(|| Retained {
            output_tokens: budget("max_completion_tokens")
                .or_else(|| budget("max_tokens"))
                .map_or(DEFAULT_OUTPUT_TOKENS, |n| n as usize),
            model: fields
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned),
            cache_salt: keys.cache_salt.clone(),
            ids,
        });
        Prompt {
            tokens,
            block_hashes,
            model: None,
            untokenized: false,
            retained,
        }
    }

    /// `text` encoded (with the special tokens the tokenizer adds when `add_special_tokens`)
    /// and hashed, as [`Prompts::tokenized`]; untokenized when the tokenizer fails on it.
    fn encoded(
        &self,
        text: &str,
        add_special_tokens: bool,
        fields: &serde_json::Map<String, Value>,
        batch: bool,
    ) -> Prompt {
        let Some(encoder) = &self.chunker else {
            let Some(synthetic) = &self.synthetic else {
                return Prompt::untokenized(0);
            };
            let mut ids = Vec::with_capacity(text.len() / 4);
            synthetic.encode(text, &mut ids);
            return self.tokenized(ids, fields, batch);
        };
        // A poisoned lock means another request panicked mid-encode; the caches stay usable.
        let mut encoder = encoder.lock().unwrap_or_else(|p| p.into_inner());
        let ids = match &mut *encoder {
            Encoder::Pieces(c) => c.encode(text, add_special_tokens),
            Encoder::Whole(t) => t
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| kvroute_tokenize::NotChunkable(e.to_string())),
        };
        drop(encoder);
        match ids {
            Ok(ids) => self.tokenized(ids, fields, batch),
            Err(_) => Prompt::untokenized(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts() -> Prompts {
        Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, true).unwrap()
    }

    #[test]
    fn token_ids_are_hashed_as_the_core_hashes_them() {
        let p = prompts()
            .parse(
                Route::Completions,
                br#"{"prompt": [1,2,3,4,5,6,7,8,9], "stream": true}"#,
            )
            .unwrap();
        let hasher = BlockHasher::new(4, 0).unwrap();
        assert_eq!(p.tokens, 9);
        assert_eq!(
            p.block_hashes,
            hasher.hash_blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9], None, 0, None)
        );
        assert_eq!(p.block_hashes.len(), 2);
    }

    #[test]
    fn adapters_and_salts_key_the_hashes_as_vllm_does() {
        let p = prompts();
        let hasher = BlockHasher::new(4, 0).unwrap();
        let ids = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let parse = |body: &str| p.parse(Route::Completions, body.as_bytes());
        let plain = parse(r#"{"prompt": [1,2,3,4,5,6,7,8], "model": "sql"}"#).unwrap();
        // Until a worker lists `sql` as an adapter, it is a model name like any other.
        assert_eq!(plain.block_hashes, hasher.hash_blocks(&ids, None, 0, None));
        assert_eq!(plain.model.as_deref(), Some("sql"));
        p.adapter_names().set(["sql".to_owned()].into());
        let lora = parse(r#"{"prompt": [1,2,3,4,5,6,7,8], "model": "sql"}"#).unwrap();
        let keys = BlockKeys::new(Some("sql"), None);
        assert_eq!(
            lora.block_hashes,
            hasher.hash_blocks_keyed(&ids, None, 0, None, &keys)
        );
        assert_ne!(lora.block_hashes, plain.block_hashes);
        let body = r#"{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t1"}"#;
        let chat = p.parse(Route::Chat, body.as_bytes()).unwrap();
        let unsalted = p
            .parse(
                Route::Chat,
                br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            )
            .unwrap();
        assert_eq!(chat.tokens, unsalted.tokens);
        assert_ne!(chat.block_hashes.first(), unsalted.block_hashes.first());
        let retained = chat.retained.unwrap();
        assert_eq!(retained.cache_salt.as_deref(), Some("t1"));
        assert_eq!(unsalted.retained.unwrap().cache_salt, None);
        for bad_salt in ["\"\"", "3", "[]"] {
            let body = format!(r#"{{"prompt": [1,2,3,4], "cache_salt": {bad_salt}}}"#);
            assert_eq!(parse(&body).unwrap_err().param, Some("cache_salt"));
        }
        let null = parse(r#"{"prompt": [1,2,3,4], "cache_salt": null}"#).unwrap();
        assert_eq!(
            null.block_hashes,
            hasher.hash_blocks(&ids[..4], None, 0, None)
        );
    }

    #[test]
    fn a_batch_is_routed_by_its_first_prompt() {
        let p = prompts()
            .parse(Route::Completions, br#"{"prompt": [[1,2,3,4], [5]]}"#)
            .unwrap();
        assert_eq!(p.tokens, 4);
        assert_eq!(p.block_hashes.len(), 1);
        assert!(p.retained.is_none()); // a batch is not refreshed
    }

    #[test]
    fn token_id_completions_carry_what_retention_needs() {
        let p = prompts()
            .parse(
                Route::Completions,
                br#"{"prompt": [5,6,7,8], "max_tokens": 3, "model": "m"}"#,
            )
            .unwrap();
        let r = p.retained.unwrap();
        assert_eq!(
            (r.ids, r.output_tokens, r.model.as_deref()),
            (vec![5, 6, 7, 8], 3, Some("m"))
        );
        let p = prompts()
            .parse(Route::Completions, br#"{"prompt": [5]}"#)
            .unwrap();
        assert_eq!(p.retained.unwrap().output_tokens, DEFAULT_OUTPUT_TOKENS);
    }

    #[test]
    fn text_and_chat_prompts_carry_their_encoded_ids_for_retention() {
        let p = prompts();
        let t = p
            .parse(
                Route::Completions,
                br#"{"prompt": "ba be bi bo", "max_tokens": 5, "model": "m"}"#,
            )
            .unwrap();
        let r = t.retained.unwrap();
        assert_eq!(
            (r.ids, r.output_tokens, r.model.as_deref()),
            (vec![3, 4, 5, 6], 5, Some("m"))
        );
        let c = p
            .parse(
                Route::Chat,
                br#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "max_tokens": 9}"#,
            )
            .unwrap();
        let r = c.retained.unwrap();
        assert_eq!((r.ids.len(), r.output_tokens), (c.tokens, 7));
        let batch = p
            .parse(Route::Completions, br#"{"prompt": ["ba be", "bi"]}"#)
            .unwrap();
        assert!(batch.retained.is_none());
        let off = Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, false).unwrap();
        let t = off
            .parse(Route::Completions, br#"{"prompt": "ba be bi bo"}"#)
            .unwrap();
        assert!(t.retained.is_none(), "retention off keeps no ids");
    }

    #[test]
    fn client_mistakes_are_bad_requests_with_their_field() {
        let p = prompts();
        for (route, body, param) in [
            (Route::Completions, &b"{"[..], None),
            (Route::Completions, b"[1]", None),
            (Route::Completions, br#"{"prompt": 3}"#, Some("prompt")),
            (
                Route::Completions,
                br#"{"prompt": [1, -1]}"#,
                Some("prompt"),
            ),
            (
                Route::Completions,
                br#"{"prompt": [1, 4294967296]}"#,
                Some("prompt"),
            ),
            (Route::Completions, br#"{"prompt": [1.5]}"#, Some("prompt")),
            (Route::Chat, br#"{"messages": []}"#, Some("messages")),
            (
                Route::Chat,
                br#"{"messages": [{"content": "x"}]}"#,
                Some("messages"),
            ),
        ] {
            let err = p.parse(route, body).unwrap_err();
            assert_eq!(err.param, param, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn deep_nesting_is_refused_whatever_the_depth() {
        let p = prompts();
        let nested = |n: usize| {
            format!(
                r#"{{"prompt": [1], "x": {}{}}}"#,
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        assert!(p.parse(Route::Completions, nested(6).as_bytes()).is_ok());
        for n in [8, 200, 100_000] {
            let err = p
                .parse(Route::Completions, nested(n).as_bytes())
                .unwrap_err();
            assert!(
                err.too_deep && err.message.contains("nested deeper"),
                "{n}: {}",
                err.message
            );
        }
    }

    #[test]
    fn without_a_tokenizer_text_and_chats_use_the_synthetic_one() {
        let p = prompts();
        let t = p
            .parse(Route::Completions, br#"{"prompt": "ba be bi bo"}"#)
            .unwrap();
        assert_eq!((t.tokens, t.untokenized), (4, false));
        assert_eq!(
            t.block_hashes,
            BlockHasher::new(4, 0)
                .unwrap()
                .hash_blocks(&[3, 4, 5, 6], None, 0, None)
        );
        let c = p
            .parse(
                Route::Chat,
                br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            )
            .unwrap();
        // <|im_start|> user hi <|im_end|> <|im_start|> assistant
        assert_eq!((c.tokens, c.untokenized), (6, false));
        let odd = p
            .parse(
                Route::Chat,
                br#"{"messages": [{"role": "user", "content": {"a": 1}}]}"#,
            )
            .unwrap();
        assert!(odd.untokenized);
    }
}
