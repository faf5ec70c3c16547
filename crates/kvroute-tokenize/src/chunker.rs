//! [`TextChunker`]: `encode(text, add_special_tokens)` from cached pieces and words.
//!
//! What qualifies a tokenizer is checked on its `tokenizer.json` layout (the crate docs give the
//! argument): no truncation or padding, NFC or no normalizer, a BPE model without dropout, a
//! `[Split(whitelisted regex, Isolated), ByteLevel(no prefix space, no regex)]` pre-tokenizer,
//! added tokens that neither contain nor strip whitespace, and a post-processor that only puts
//! special tokens around the sequence. A self-check against whole encodes then backs it.

use std::fmt;

use aho_corasick::AhoCorasick;
use serde_json::Value;
use tokenizers::{Model, Tokenizer};

use crate::cache::ByteCache;
use crate::cuts::{CUT_ONE_IN, Piece, cut_pieces};
use crate::split::{AsciiWords, SplitPattern};

/// Longer words are encoded without being cached (a client's megabyte of letters is one word).
const MAX_CACHED_WORD: usize = 64;

/// The sizes a [`TextChunker`] works with.
#[derive(Clone, Copy, Debug)]
pub struct ChunkerConfig {
    /// See [`crate::cuts::cut_pieces`] (tests cut at every candidate with 1).
    pub cut_one_in: u64,
    /// Bytes of text and ids the piece cache may hold.
    pub piece_cache_bytes: usize,
    /// Bytes of words and ids the word cache may hold.
    pub word_cache_bytes: usize,
}

impl Default for ChunkerConfig {
    /// 64 MiB of pieces (a few thousand distinct 16 KB prompts), 8 MiB of words.
    fn default() -> Self {
        Self {
            cut_one_in: CUT_ONE_IN,
            piece_cache_bytes: 64 << 20,
            word_cache_bytes: 8 << 20,
        }
    }
}

/// Why a tokenizer cannot be tokenized in pieces (the caller then encodes whole).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotChunkable(pub String);

impl fmt::Display for NotChunkable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not tokenizable in pieces: {}", self.0)
    }
}

impl std::error::Error for NotChunkable {}

fn refuse<T>(why: impl Into<String>) -> Result<T, NotChunkable> {
    Err(NotChunkable(why.into()))
}

/// Counters of a chunker's caches (cumulative, except the sizes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChunkerStats {
    /// Pieces found in the piece cache.
    pub hits: u64,
    /// Pieces tokenized.
    pub misses: u64,
    /// Pieces dropped to stay within the byte bound.
    pub evictions: u64,
    /// Bytes the piece cache holds.
    pub piece_bytes: usize,
    /// Pieces it holds.
    pub pieces: usize,
    /// Bytes the word cache holds.
    pub word_bytes: usize,
}

/// Tokenizes text exactly like `Tokenizer::encode(text, add_special_tokens)`, piece by piece,
/// each piece's ids cached (see the crate docs for why the ids are identical).
pub struct TextChunker {
    tokenizer: Tokenizer,
    words: AsciiWords,
    /// Added tokens' contents: a piece holding one goes to the whole pipeline.
    added: Option<AhoCorasick>,
    /// Ids the post-processor puts before and after the sequence.
    before: Vec<u32>,
    after: Vec<u32>,
    /// GPT-2's byte-to-character map for ASCII bytes (what ByteLevel applies before BPE).
    byte_level: [char; 128],
    cut_one_in: u64,
    seed: u64,
    pieces: ByteCache,
    word_cache: ByteCache,
    hits: u64,
    misses: u64,
    // Scratch reused across calls (no per-request allocation once warm).
    cuts: Vec<Piece>,
    mapped: String,
    piece_ids: Vec<u32>,
}

/// GPT-2's byte-to-character map, ASCII half: printable bytes stand for themselves, the others
/// for characters from U+0100 on, in byte order.
fn byte_level_ascii() -> [char; 128] {
    let mut table = ['\0'; 128];
    let mut shifted = 0u32;
    for (b, slot) in (0u32..).zip(table.iter_mut()) {
        *slot = if (33..=126).contains(&b) {
            char::from_u32(b).expect("ascii")
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).expect("below the surrogates")
        };
    }
    table
}

/// The known split pattern of a `[Split, ByteLevel]` pre-tokenizer, or why not.
fn split_pattern(spec: &Value) -> Result<SplitPattern, NotChunkable> {
    if spec["type"] != "Sequence" {
        return refuse("pre-tokenizer is not a Sequence");
    }
    let subs = spec["pretokenizers"].as_array().map(Vec::as_slice);
    let Some([split, byte_level]) = subs else {
        return refuse("pre-tokenizer is not [Split, ByteLevel]");
    };
    let Some(pattern) = split["pattern"]["Regex"]
        .as_str()
        .and_then(SplitPattern::from_regex)
    else {
        return refuse("split regex is not a whitelisted one");
    };
    if split["type"] != "Split"
        || split["behavior"] != "Isolated"
        || split["invert"] != false
        || byte_level["type"] != "ByteLevel"
        || byte_level["add_prefix_space"] != false
        || byte_level["use_regex"] != false
    {
        return refuse("pre-tokenizer options differ from Qwen's/Llama 3's");
    }
    Ok(pattern)
}

/// Ids a TemplateProcessing puts before and after a single sequence.
fn template_specials(spec: &Value) -> Option<(Vec<u32>, Vec<u32>)> {
    let (mut before, mut after) = (Vec::new(), Vec::new());
    let mut seen_sequence = false;
    for item in spec["single"].as_array()? {
        if let Some(seq) = item.get("Sequence") {
            if seen_sequence || seq["id"] != "A" {
                return None;
            }
            seen_sequence = true;
        } else if let Some(special) = item.get("SpecialToken") {
            let entry = spec["special_tokens"].get(special["id"].as_str()?)?;
            let ids = entry["ids"]
                .as_array()?
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()));
            let ids: Option<Vec<u32>> = ids.collect();
            if seen_sequence {
                &mut after
            } else {
                &mut before
            }
            .extend(ids?);
        } else {
            return None;
        }
    }
    seen_sequence.then_some((before, after))
}

/// Ids `add_special_tokens` adds around a sequence, for post-processors known to add only those
/// (byte-level: offsets only; a template; a sequence of those); None for any other.
fn post_specials(spec: &Value) -> Option<(Vec<u32>, Vec<u32>)> {
    match spec["type"].as_str() {
        _ if spec.is_null() => Some((Vec::new(), Vec::new())),
        Some("ByteLevel") => Some((Vec::new(), Vec::new())),
        Some("TemplateProcessing") => template_specials(spec),
        Some("Sequence") => {
            let (mut before, mut after) = (Vec::new(), Vec::new());
            for sub in spec["processors"].as_array()? {
                let (b, a) = post_specials(sub)?;
                before.splice(0..0, b);
                after.extend(a);
            }
            Some((before, after))
        }
        _ => None,
    }
}

/// Texts the self-check compares piecewise against whole encodes (cut points fall in each).
fn self_check_texts() -> [String; 3] {
    [
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
        "Il était une fois   un   renard, qui n'aimait pas l'été! 12345 x\n\n  y's z'LL "
            .repeat(40),
        "<|im_start|>user\nhello there world<|im_end|>\n \t tabs\tand spaces  here ".repeat(30),
    ]
}

impl TextChunker {
    /// A chunker for `tokenizer` if its pipeline is one the cut argument covers and the
    /// self-check passes; why not otherwise.
    pub fn new(tokenizer: Tokenizer, config: ChunkerConfig) -> Result<Self, NotChunkable> {
        if !config.cut_one_in.is_power_of_two() {
            return refuse(format!(
                "cut_one_in must be a power of two, got {}",
                config.cut_one_in
            ));
        }
        let json = tokenizer
            .to_string(false)
            .map_err(|e| NotChunkable(e.to_string()))?;
        let spec: Value = serde_json::from_str(&json).map_err(|e| NotChunkable(e.to_string()))?;
        if !spec["truncation"].is_null() || !spec["padding"].is_null() {
            return refuse("truncation or padding is set");
        }
        let normalizer = &spec["normalizer"];
        if !normalizer.is_null() && normalizer["type"] != "NFC" {
            return refuse("normalizer is neither none nor NFC");
        }
        let model = &spec["model"];
        if model["type"] != "BPE" || !(model["dropout"].is_null() || model["dropout"] == 0.0) {
            return refuse("model is not a BPE without dropout");
        }
        let pattern = split_pattern(&spec["pre_tokenizer"])?;
        let added: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| {
                if t.lstrip
                    || t.rstrip
                    || t.single_word
                    || t.content.chars().any(char::is_whitespace)
                {
                    refuse(format!(
                        "added token {:?} strips or holds whitespace",
                        t.content
                    ))
                } else {
                    Ok(t.content)
                }
            })
            .collect::<Result<_, _>>()?;
        let Some((before, after)) = post_specials(&spec["post_processor"]) else {
            return refuse("post-processor adds more than special tokens around the sequence");
        };
        let added = if added.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&added).map_err(|e| NotChunkable(e.to_string()))?)
        };
        let mut chunker = Self {
            tokenizer,
            words: AsciiWords::new(pattern),
            added,
            before,
            after,
            byte_level: byte_level_ascii(),
            cut_one_in: config.cut_one_in,
            seed: process_seed(),
            pieces: ByteCache::new(config.piece_cache_bytes),
            word_cache: ByteCache::new(config.word_cache_bytes),
            hits: 0,
            misses: 0,
            cuts: Vec::new(),
            mapped: String::new(),
            piece_ids: Vec::new(),
        };
        let mut ids = Vec::new();
        for text in self_check_texts() {
            for add_special_tokens in [true, false] {
                let whole = chunker.encode_whole(&text, add_special_tokens)?;
                ids.clear();
                chunker.encode_into(&text, add_special_tokens, &mut ids)?;
                if ids != whole {
                    return refuse("self-check: piecewise ids differ from whole encodes");
                }
            }
        }
        chunker.pieces.clear();
        chunker.word_cache.clear();
        (chunker.hits, chunker.misses, chunker.pieces.evictions) = (0, 0, 0);
        Ok(chunker)
    }

    /// The tokenizer this chunker encodes like.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The library's own whole-text encode (the reference the chunker must equal).
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, NotChunkable> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| NotChunkable(e.to_string()))
    }

    /// Appends the ids of `encode(text, add_special_tokens)` to `out`. Errors only when the
    /// library's pipeline fails on a piece it is handed (`out` then holds a partial result).
    pub fn encode_into(
        &mut self,
        text: &str,
        add_special_tokens: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), NotChunkable> {
        let data = text.as_bytes();
        out.reserve(data.len() / 4 + self.before.len() + self.after.len());
        if add_special_tokens {
            out.extend_from_slice(&self.before);
        }
        let mut cuts = std::mem::take(&mut self.cuts);
        cut_pieces(data, self.cut_one_in, self.seed, &mut cuts);
        let mut result = Ok(());
        for piece in &cuts {
            let key = &data[piece.start..piece.stop];
            if let Some(ids) = self.pieces.get(piece.hash, key) {
                out.extend_from_slice(ids);
                self.hits += 1;
                continue;
            }
            self.misses += 1;
            let mut ids = std::mem::take(&mut self.piece_ids);
            ids.clear();
            result = self.encode_piece(&text[piece.start..piece.stop], &mut ids);
            if result.is_err() {
                self.piece_ids = ids;
                break;
            }
            out.extend_from_slice(&ids);
            self.pieces.insert(piece.hash, key, &ids);
            self.piece_ids = ids;
        }
        self.cuts = cuts;
        result?;
        if add_special_tokens {
            out.extend_from_slice(&self.after);
        }
        Ok(())
    }

    /// `encode(text, add_special_tokens)` as a new vector.
    pub fn encode(
        &mut self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, NotChunkable> {
        let mut out = Vec::new();
        self.encode_into(text, add_special_tokens, &mut out)?;
        Ok(out)
    }

    /// The ids of one piece, without special tokens: word by word if ASCII without added
    /// tokens, by the library's whole pipeline otherwise.
    fn encode_piece(&mut self, piece: &str, out: &mut Vec<u32>) -> Result<(), NotChunkable> {
        let bytes = piece.as_bytes();
        if !bytes.is_ascii() || self.added.as_ref().is_some_and(|a| a.is_match(bytes)) {
            let encoding = self
                .tokenizer
                .encode_fast(piece, false)
                .map_err(|e| NotChunkable(e.to_string()))?;
            out.extend_from_slice(encoding.get_ids());
            return Ok(());
        }
        let mut result = Ok(());
        let words = self.words;
        words.for_each(bytes, |word| {
            if result.is_err() {
                return;
            }
            let hash = xxhash_rust::xxh3::xxh3_64_with_seed(word, self.seed);
            if let Some(ids) = self.word_cache.get(hash, word) {
                out.extend_from_slice(ids);
                return;
            }
            self.mapped.clear();
            let table = &self.byte_level;
            self.mapped
                .extend(word.iter().map(|&b| table[usize::from(b)]));
            let start = out.len();
            match self.tokenizer.get_model().tokenize(&self.mapped) {
                Ok(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                Err(e) => {
                    result = Err(NotChunkable(e.to_string()));
                    return;
                }
            }
            if word.len() <= MAX_CACHED_WORD {
                self.word_cache.insert(hash, word, &out[start..]);
            }
        });
        result
    }

    /// The caches' counters and sizes.
    pub fn stats(&self) -> ChunkerStats {
        ChunkerStats {
            hits: self.hits,
            misses: self.misses,
            evictions: self.pieces.evictions,
            piece_bytes: self.pieces.nbytes(),
            pieces: self.pieces.len(),
            word_bytes: self.word_cache.nbytes(),
        }
    }
}

/// A seed for this process's cache hashes, from the standard library's per-process randomness
/// (`RandomState`), so the hashes a client's text gets are not known to the client.
fn process_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x006b_7672_6f75_7465_u64)
}
