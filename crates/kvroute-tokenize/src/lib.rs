//! Exact tokenization of text prompts in cached pieces: the ids of one whole
//! `Tokenizer::encode(text, add_special_tokens)`, at a fraction of its cost, because prompts
//! that share a prefix share most of their pieces and each piece is tokenized once.
//!
//! Why: a KV-aware router must know a text prompt's token ids to hash its blocks, and Hugging
//! Face's whole-text pipeline spends most of its time on alignment bookkeeping
//! (`NormalizedString`) and the onig split regex: for a prompt of a few thousand tokens,
//! several times the rest of a request's routing. This crate is pure (no I/O, no clock, no threads): serve's data plane
//! (`kvroute_serve::prompt`) calls it directly, Python through the bindings.
//!
//! **Where to cut.** Byte-level BPE tokenizers (Qwen, Llama 3 and their kin) work word by word:
//! the pre-tokenizer's regex cuts the text into words, each word is encoded on its own. The text
//! is cut only before a space that follows an ASCII letter and precedes another (`word| word`).
//! For the whitelisted split regexes ([`split::SplitPattern`]) no match that contains a letter
//! can continue into a following space (the letter alternatives are `\p{L}+` runs and
//! contractions, which end in letters), so a match ends right before the space in the whole text
//! and in the left piece alike (an end of input and a space both stop the run, and both pass the
//! one look-ahead `(?!\S)`); the patterns have no look-behind, so matching from the space on is
//! the same in the right piece as in the whole text. NFC (the only normalizer accepted besides
//! none) never composes across a space, and added tokens may not contain whitespace or strip it,
//! so none straddles a cut. Anything else in the pipeline makes [`TextChunker::new`] refuse the
//! tokenizer (the caller encodes whole), and a self-check against whole encodes backs the
//! argument at construction.
//!
//! **Which cuts.** Content-defined ([`cuts`]): a candidate is kept when a hash of the 8 bytes
//! before it falls in 1/[`cuts::CUT_ONE_IN`] of its range, so cuts depend only on nearby text and
//! two prompts that share a prefix cut it identically.
//!
//! **New pieces.** A piece not in the cache that is pure ASCII and holds no added token is cut
//! into words by a hand-written scanner of the split regex's ASCII translation ([`split`]), and
//! each word's ids come from a word cache or from the tokenizer's own BPE model (what the
//! pipeline runs per word). Other pieces go through the library's whole pipeline.
//!
//! **Bounded.** Both caches ([`cache::ByteCache`]) are bounded in bytes (keys, ids and a fixed
//! per-entry overhead), whatever their entry count: a client may send many large prompts.

pub mod cache;
pub mod chunker;
pub mod cuts;
pub mod split;
pub mod synthetic;

pub use chunker::{ChunkerConfig, NotChunkable, TextChunker};
pub use synthetic::SyntheticTokenizer;
