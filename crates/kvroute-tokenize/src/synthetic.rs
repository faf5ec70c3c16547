//! kvroute's built-in synthetic tokenizer (`kvroute.tokens.SyntheticTokenizer`), natively: what
//! a router started without `--tokenizer` tokenizes text with, exact against emulated workers
//! that run without a tokenizer too.
//!
//! Ids `[0, 3)` are ChatML's special tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`);
//! every other id is a pseudo-word of two-letter syllables, numbered in bijective base 70. Text
//! is cut into special tokens, runs of word characters and single other non-space characters
//! (Python's `special|\w+|[^\w\s]`); a run that is a pseudo-word gets its id, any other piece
//! `3 + xxh3(piece, seed) mod (vocab − 3)`. Word and space characters are Unicode's alphabetic
//! and numeric ones (plus `_`) and its white space. This is the one implementation: the Python
//! class wraps it, so the router, the emulator and the simulator cut text alike.

/// ChatML's special tokens, in id order.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Consonants and vowels of the syllables (`ba`, `be`, …, `zu`: 70 of them).
const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
const VOWELS: &[u8] = b"aeiou";
/// Seed of the hash that maps unknown pieces into the vocabulary (the Python class's).
const UNKNOWN_WORD_SEED: u64 = 0x0073_796E_7468;

/// The synthetic tokenizer of a vocabulary of `vocab_size` ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticTokenizer {
    vocab_size: u32,
}

/// A vocabulary too small to hold the special tokens and one word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabTooSmall(pub u32);

impl std::fmt::Display for VocabTooSmall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vocab_size must exceed {}, got {}",
            SPECIAL_TOKENS.len(),
            self.0
        )
    }
}

impl std::error::Error for VocabTooSmall {}

/// A token id outside the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdOutOfRange {
    /// The id.
    pub id: u32,
    /// The vocabulary's size.
    pub vocab_size: u32,
}

impl std::fmt::Display for IdOutOfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "token id {} is outside [0, {})",
            self.id, self.vocab_size
        )
    }
}

impl std::error::Error for IdOutOfRange {}

fn is_word(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// The digit (1..=70) of a two-letter syllable, if it is one.
fn syllable_digit(pair: &[u8]) -> Option<u64> {
    let c = CONSONANTS.iter().position(|&x| x == pair[0])?;
    let v = VOWELS.iter().position(|&x| x == pair[1])?;
    Some((c * VOWELS.len() + v) as u64 + 1)
}

impl SyntheticTokenizer {
    /// The tokenizer `kvroute.tokens.SyntheticTokenizer(vocab_size)` is.
    pub fn new(vocab_size: u32) -> Result<Self, VocabTooSmall> {
        if vocab_size as usize <= SPECIAL_TOKENS.len() {
            return Err(VocabTooSmall(vocab_size));
        }
        Ok(Self { vocab_size })
    }

    /// Ids in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    fn words(&self) -> u64 {
        u64::from(self.vocab_size) - SPECIAL_TOKENS.len() as u64
    }

    /// The id of one piece (a word run or a single character).
    fn piece_id(&self, piece: &str) -> u32 {
        let bytes = piece.as_bytes();
        let base = (CONSONANTS.len() * VOWELS.len()) as u64;
        if bytes.len() % 2 == 0 && !bytes.is_empty() {
            let mut value: u64 = 0;
            let mut pseudo = true;
            for pair in bytes.chunks(2) {
                match syllable_digit(pair) {
                    Some(d) if value <= (u64::MAX - d) / base => value = value * base + d,
                    _ => {
                        pseudo = false;
                        break;
                    }
                }
            }
            // Bijective numeration: the n-th word's digits spell n + 1.
            if pseudo && value - 1 < self.words() {
                return (SPECIAL_TOKENS.len() as u64 + value - 1) as u32;
            }
        }
        let hash = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, UNKNOWN_WORD_SEED);
        (SPECIAL_TOKENS.len() as u64 + hash % self.words()) as u32
    }

    /// The ids of `text` (it adds no special tokens of its own, like Qwen's tokenizer).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            if let Some((id, t)) = SPECIAL_TOKENS
                .iter()
                .enumerate()
                .find(|(_, t)| rest.starts_with(**t))
            {
                out.push(id as u32);
                rest = &rest[t.len()..];
            } else if is_word(c) {
                let end = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
                out.push(self.piece_id(&rest[..end]));
                rest = &rest[end..];
            } else {
                if !c.is_whitespace() {
                    out.push(self.piece_id(&rest[..c.len_utf8()]));
                }
                rest = &rest[c.len_utf8()..];
            }
        }
    }

    /// The text of `ids`: each id's word (a special token as written), joined by single
    /// spaces, so that `encode(decode(ids)) == ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, IdOutOfRange> {
        let base = (CONSONANTS.len() * VOWELS.len()) as u64;
        let mut text = String::new();
        let mut digits = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            if id >= self.vocab_size {
                return Err(IdOutOfRange {
                    id,
                    vocab_size: self.vocab_size,
                });
            }
            if k > 0 {
                text.push(' ');
            }
            if let Some(special) = SPECIAL_TOKENS.get(id as usize) {
                text.push_str(special);
                continue;
            }
            // Bijective numeration: word n is spelled by the digits (1..=70) of n + 1.
            let mut n = u64::from(id) - SPECIAL_TOKENS.len() as u64 + 1;
            digits.clear();
            while n > 0 {
                let digit = (n - 1) % base;
                n = (n - 1) / base;
                digits.push(digit as usize);
            }
            for &d in digits.iter().rev() {
                text.push(CONSONANTS[d / VOWELS.len()] as char);
                text.push(VOWELS[d % VOWELS.len()] as char);
            }
        }
        Ok(text)
    }

    /// The ChatML text `kvroute.tokens.SyntheticTokenizer.apply_chat_template` renders: one
    /// `<|im_start|>ROLE\nCONTENT<|im_end|>\n` per `(role, content)`, then
    /// `<|im_start|>assistant\n` when a reply is wanted.
    pub fn chat_text<'a>(
        messages: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> String {
        let mut text = String::new();
        for (role, content) in messages {
            text.push_str("<|im_start|>");
            text.push_str(role);
            text.push('\n');
            text.push_str(content);
            text.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            text.push_str("<|im_start|>assistant\n");
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        SyntheticTokenizer::new(32000)
            .unwrap()
            .encode(text, &mut out);
        out
    }

    #[test]
    fn pseudo_words_get_their_numbers() {
        // "ba" is word 0 (id 3), "be" word 1; "zu" the 70th; "baba" the 71st (bijective).
        assert_eq!(encode("ba be zu baba"), [3, 4, 72, 73]);
    }

    #[test]
    fn special_tokens_cut_the_text_and_spaces_vanish() {
        assert_eq!(encode("<|im_start|>ba\n<|im_end|>"), [1, 3, 2]);
        assert_eq!(encode("  \t\n"), Vec::<u32>::new());
    }

    #[test]
    fn decoding_spells_each_word_and_encoding_reads_it_back() {
        let t = SyntheticTokenizer::new(32000).unwrap();
        assert_eq!(
            t.decode(&[3, 4, 72, 73, 1]).unwrap(),
            "ba be zu baba <|im_start|>"
        );
        let ids: Vec<u32> = (0..32000).step_by(7).collect();
        let mut back = Vec::new();
        t.encode(&t.decode(&ids).unwrap(), &mut back);
        assert_eq!(back, ids);
        assert_eq!(
            t.decode(&[32000]),
            Err(IdOutOfRange {
                id: 32000,
                vocab_size: 32000
            })
        );
    }

    #[test]
    fn other_pieces_hash_into_the_vocabulary() {
        let ids = encode("hello, world!");
        assert_eq!(ids.len(), 4);
        assert!(ids.iter().all(|&i| (3..32000).contains(&i)));
        assert_eq!(ids[1], encode(",")[0]);
        // A run of syllables beyond the vocabulary is an unknown word, not an overflow.
        assert!((3..32000).contains(&encode(&"zu".repeat(40))[0]));
    }
}
