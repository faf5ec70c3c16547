//! The chunker's ids are the library's whole-text `encode` ids, on a byte-level BPE tokenizer
//! laid out like Qwen's (what `kvroute make-tiny-model` writes: NFC, the Qwen split regex then
//! ByteLevel, ChatML added tokens), trained here in code on generated text.

use std::sync::OnceLock;

use kvroute_tokenize::split::SplitPattern;
use kvroute_tokenize::{ChunkerConfig, TextChunker};
use proptest::prelude::*;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern as HfSplit};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Pseudo-words from syllables, picked by a fixed LCG: a corpus with recurring words, digits,
/// punctuation and some accented letters, so BPE learns multi-byte merges.
fn corpus() -> Vec<String> {
    const SYLLABLES: [&str; 16] = [
        "ka", "lo", "min", "te", "ras", "vu", "ne", "sol", "é", "qui", "dor", "an", "be", "zu",
        "ri", "ox",
    ];
    const MARKS: [&str; 6] = [".", ",", "!", "?", ";", "'s"];
    let mut state = 12345u64;
    let mut next = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    (0..400)
        .map(|_| {
            let mut line = String::new();
            for w in 0..(5 + next(20)) {
                if w > 0 {
                    line.push(' ');
                }
                if next(10) == 0 {
                    line.push_str(&next(10_000).to_string());
                    continue;
                }
                for _ in 0..(1 + next(3)) {
                    line.push_str(SYLLABLES[next(16) as usize]);
                }
                if next(6) == 0 {
                    line.push_str(MARKS[next(6) as usize]);
                }
            }
            line.push('\n');
            line
        })
        .collect()
}

/// A trained Qwen-layout tokenizer; with `bos`, a template puts `<|endoftext|>` before the
/// sequence (as Llama 3's post-processor puts its BOS).
fn tokenizer(bos: bool) -> Tokenizer {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_normalizer(Some(NFC));
    let split = Split::new(
        HfSplit::Regex(SplitPattern::Qwen.regex().to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("split regex");
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    if bos {
        let template = TemplateProcessing::builder()
            .try_single("<|endoftext|> $A")
            .expect("template")
            .special_tokens(vec![("<|endoftext|>", 0)])
            .build()
            .expect("template");
        tokenizer.with_post_processor(Some(template));
    } else {
        tokenizer.with_post_processor(Some(ByteLevel::new(false, false, false)));
    }
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainerBuilder::new()
            .vocab_size(600)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(
                SPECIALS
                    .iter()
                    .map(|s| AddedToken::from(*s, true))
                    .collect(),
            )
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build(),
    );
    tokenizer
        .train(&mut trainer, corpus().into_iter())
        .expect("training");
    tokenizer
}

fn qwen_like() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| tokenizer(false))
}

fn with_bos() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| tokenizer(true))
}

fn whole(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Vec<u32> {
    tokenizer
        .encode(text, add_special_tokens)
        .expect("encode")
        .get_ids()
        .to_vec()
}

fn every_cut() -> ChunkerConfig {
    ChunkerConfig {
        cut_one_in: 1,
        ..ChunkerConfig::default()
    }
}

/// Text fragments that stress the split regex and the cut argument: words, contractions,
/// digits, every ASCII whitespace in runs, punctuation, control bytes, non-ASCII letters,
/// Unicode spaces, emoji, added tokens.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z]{1,8}",
        3 => Just(" ".to_owned()),
        1 => "[0-9]{1,6}",
        2 => "[ \t\r\n\x0b\x0c]{1,5}",
        1 => "'(s|t|re|ve|m|ll|d|S|RE|x)",
        1 => "[!-/:-@\\[-`{-~]{1,3}",
        1 => "[\x00-\x08\x0e-\x1f\x7f]",
        1 => "[éüßçñ中文日本語]{1,3}",
        1 => "[\u{a0}\u{2028}\u{3000}\u{85}]",
        1 => "[😀🚀]",
        1 => "e\u{301}",
        1 => prop::sample::select(SPECIALS.to_vec()).prop_map(str::to_owned),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Random texts, every candidate cut (the most pieces), one chunker across cases so the
    /// caches are exercised too: identical ids, with and without special tokens.
    #[test]
    fn identical_to_whole_encode(parts in prop::collection::vec(fragment(), 0..80), special in any::<bool>()) {
        static CHUNKER: OnceLock<std::sync::Mutex<TextChunker>> = OnceLock::new();
        let chunker = CHUNKER.get_or_init(|| {
            std::sync::Mutex::new(TextChunker::new(qwen_like().clone(), every_cut()).expect("qualifies"))
        });
        let text = parts.concat();
        let got = chunker.lock().expect("lock").encode(&text, special).expect("encode");
        prop_assert_eq!(got, whole(qwen_like(), &text, special), "{:?}", text);
    }

    /// The same with a BOS template and the default (sparse) cuts on longer texts.
    #[test]
    fn identical_with_a_bos_template(parts in prop::collection::vec(fragment(), 0..400)) {
        static CHUNKER: OnceLock<std::sync::Mutex<TextChunker>> = OnceLock::new();
        let chunker = CHUNKER.get_or_init(|| {
            std::sync::Mutex::new(TextChunker::new(with_bos().clone(), ChunkerConfig::default()).expect("qualifies"))
        });
        let text = parts.concat();
        let got = chunker.lock().expect("lock").encode(&text, true).expect("encode");
        prop_assert_eq!(got, whole(with_bos(), &text, true), "{:?}", text);
    }
}

#[test]
fn shared_prefixes_hit_the_piece_cache() {
    let mut chunker = TextChunker::new(qwen_like().clone(), ChunkerConfig::default()).expect("ok");
    let lines = corpus();
    let prefix: String = lines[..100].concat();
    for (i, suffix) in lines[100..140].iter().enumerate() {
        let text = format!("{prefix}{suffix}");
        assert_eq!(
            chunker.encode(&text, true).expect("encode"),
            whole(qwen_like(), &text, true),
            "request {i}"
        );
    }
    let stats = chunker.stats();
    assert!(stats.hits > 10 * stats.misses, "{stats:?}");
    assert!(stats.piece_bytes <= ChunkerConfig::default().piece_cache_bytes);
}

#[test]
fn caches_stay_within_their_bytes() {
    let config = ChunkerConfig {
        piece_cache_bytes: 256 << 10,
        word_cache_bytes: 16 << 10,
        cut_one_in: 32,
    };
    let mut chunker = TextChunker::new(qwen_like().clone(), config).expect("ok");
    for (i, line) in corpus().iter().cycle().take(3000).enumerate() {
        let text = format!("{i} {line} {line}");
        chunker.encode(&text, false).expect("encode");
        let stats = chunker.stats();
        assert!(stats.piece_bytes <= config.piece_cache_bytes, "{stats:?}");
        assert!(stats.word_bytes <= config.word_cache_bytes, "{stats:?}");
    }
    assert!(chunker.stats().evictions > 0);
}

#[test]
fn refuses_other_pipelines() {
    let mut other = qwen_like().clone();
    let split = Split::new(
        HfSplit::Regex(r"\s+|\S+".to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("regex");
    other.with_pre_tokenizer(Some(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, false, false).into(),
    ])));
    let err = TextChunker::new(other, ChunkerConfig::default())
        .err()
        .expect("refused");
    assert!(err.0.contains("whitelisted"), "{err}");
    let odd_config = ChunkerConfig {
        cut_one_in: 3,
        ..ChunkerConfig::default()
    };
    assert!(TextChunker::new(qwen_like().clone(), odd_config).is_err());
}
