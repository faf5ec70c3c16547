//! The whitelisted split regexes, and a hand-written scanner of their ASCII translation.
//!
//! Qwen2/Qwen3 and Llama 3 (GPT-4's cl100k) cut text into words with one regex each, differing
//! only in how digits group (one at a time, or runs of up to three):
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! On pure-ASCII text `\p{L}` is `[A-Za-z]`, `\p{N}` is `[0-9]` and the tokenizer's `\s` (onig,
//! Unicode White_Space) is `[\t-\r ]` (not the separators `\x1c`–`\x1f`). The scanner below
//! applies the alternation leftmost-first, as onig does, with the backtracking worked out by
//! hand; a table of byte classes replaces the regex engines (which cost ~20% of a request in the
//! spike: a look-ahead needs a backtracking VM). Every position starts a match (a letter, digit,
//! whitespace or other byte each has an alternative), so the words cover the text.

/// A split regex this crate knows, with the one parameter its ASCII scanner needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitPattern {
    /// Qwen2/Qwen3: digits one at a time.
    Qwen,
    /// Llama 3 / cl100k: digits in runs of up to three.
    Cl100k,
}

impl SplitPattern {
    /// The pattern whose regex (as written in `tokenizer.json`) is `regex`, if whitelisted.
    pub fn from_regex(regex: &str) -> Option<Self> {
        [Self::Qwen, Self::Cl100k]
            .into_iter()
            .find(|p| p.regex() == regex)
    }

    /// The regex as `tokenizer.json` writes it.
    pub fn regex(self) -> &'static str {
        match self {
            Self::Qwen => {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
            Self::Cl100k => {
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            }
        }
    }

    fn max_digits(self) -> usize {
        match self {
            Self::Qwen => 1,
            Self::Cl100k => 3,
        }
    }
}

const LETTER: u8 = 1;
const DIGIT: u8 = 2;
/// `[\t-\r ]`.
const SPACE: u8 = 4;
/// `[\r\n]` (also SPACE).
const NEWLINE: u8 = 8;

/// The class bits of every ASCII byte (0: "other", the `[^\s\p{L}\p{N}]` of the pattern).
const CLASSES: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut b = 0;
    while b < 128 {
        let c = b as u8;
        t[b] = if c.is_ascii_alphabetic() {
            LETTER
        } else if c.is_ascii_digit() {
            DIGIT
        } else if c == b'\r' || c == b'\n' {
            SPACE | NEWLINE
        } else if (c >= b'\t' && c <= 0x0c) || c == b' ' {
            SPACE
        } else {
            0
        };
        b += 1;
    }
    t
};

/// Cuts pure-ASCII text into the words a whitelisted split regex finds in it.
#[derive(Clone, Copy, Debug)]
pub struct AsciiWords {
    max_digits: usize,
}

impl AsciiWords {
    /// The scanner for `pattern`.
    pub fn new(pattern: SplitPattern) -> Self {
        Self {
            max_digits: pattern.max_digits(),
        }
    }

    /// Calls `word` with each word of `text` (ASCII), in order; the words cover the text.
    #[inline]
    pub fn for_each(&self, text: &[u8], mut word: impl FnMut(&[u8])) {
        debug_assert!(text.is_ascii());
        let mut i = 0;
        while i < text.len() {
            let end = self.word_end(text, i);
            word(&text[i..end]);
            i = end;
        }
    }

    /// The end of the match that starts at `i` (`i < text.len()`).
    #[inline]
    fn word_end(&self, s: &[u8], i: usize) -> usize {
        let n = s.len();
        let class = |j: usize| CLASSES[usize::from(s[j] & 0x7f)];
        let c = class(i);
        // (?i:'s|'t|'re|'ve|'m|'ll|'d): `b | 32 == lowercase` holds only for that letter's two cases.
        if s[i] == b'\'' && i + 1 < n {
            let next = s[i + 1] | 32;
            if matches!(next, b's' | b't' | b'm' | b'd') {
                return i + 2;
            }
            if i + 2 < n {
                let pair = (next, s[i + 2] | 32);
                if matches!(pair, (b'r', b'e') | (b'v', b'e') | (b'l', b'l')) {
                    return i + 3;
                }
            }
        }
        let run = |mut j: usize, bits: u8| {
            while j < n && class(j) & bits != 0 {
                j += 1;
            }
            j
        };
        let other_run = |mut j: usize| {
            while j < n && class(j) == 0 {
                j += 1;
            }
            j
        };
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if c & LETTER != 0 {
            return run(i + 1, LETTER);
        }
        if c & (DIGIT | NEWLINE) == 0 && i + 1 < n && class(i + 1) & LETTER != 0 {
            return run(i + 2, LETTER);
        }
        // \p{N} or \p{N}{1,3}
        if c & DIGIT != 0 {
            let mut j = i + 1;
            while j < n && j - i < self.max_digits && class(j) & DIGIT != 0 {
                j += 1;
            }
            return j;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`: the optional space is taken only if "other" follows it.
        let others_from = if c == 0 {
            Some(i)
        } else if s[i] == b' ' && i + 1 < n && class(i + 1) == 0 {
            Some(i + 1)
        } else {
            None
        };
        if let Some(j) = others_from {
            return run(other_run(j), NEWLINE);
        }
        // Whitespace from here on (every other class returned above).
        debug_assert!(c & SPACE != 0);
        let end = run(i + 1, SPACE);
        // \s*[\r\n]+: the greedy \s* backs off to the run's last newline.
        if let Some(last) = s[i..end].iter().rposition(|&b| b == b'\r' || b == b'\n') {
            return i + last + 1;
        }
        // \s+(?!\S): the whole run at the end of the text; else all but its last space, which
        // is left to prefix the next word (`\s+` takes a single space when that leaves nothing).
        if end == n || end - i == 1 {
            end
        } else {
            end - 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pattern: SplitPattern, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        AsciiWords::new(pattern).for_each(text.as_bytes(), |w| {
            out.push(String::from_utf8(w.to_vec()).expect("ascii"))
        });
        out
    }

    fn onig_words(pattern: SplitPattern, text: &str) -> Vec<String> {
        let re = onig::Regex::new(pattern.regex()).expect("pattern");
        re.find_iter(text)
            .map(|(a, b)| text[a..b].to_owned())
            .collect()
    }

    #[test]
    fn examples() {
        let got = words(SplitPattern::Qwen, "Hello world's  end 123\n\n  x 'RE (a) ");
        assert_eq!(
            got,
            [
                "Hello", " world", "'s", " ", " end", " ", "1", "2", "3", "\n\n", " ", " x", " '",
                "RE", " (", "a", ")", " "
            ]
        );
        assert_eq!(words(SplitPattern::Cl100k, "12345"), ["123", "45"]);
    }

    #[test]
    fn known_patterns_round_trip() {
        for p in [SplitPattern::Qwen, SplitPattern::Cl100k] {
            assert_eq!(SplitPattern::from_regex(p.regex()), Some(p));
        }
        assert_eq!(SplitPattern::from_regex(r"\s+"), None);
    }

    proptest::proptest! {
        /// The scanner finds exactly the words onig finds with the original pattern, on any
        /// ASCII text (whitespace, punctuation and contractions made frequent).
        #[test]
        fn matches_onig_on_ascii(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::string::string_regex("[a-zA-Z]{1,6}").expect("re"),
                    proptest::string::string_regex("[0-9]{1,5}").expect("re"),
                    proptest::string::string_regex("[ \t\r\n\x0b\x0c]{1,4}").expect("re"),
                    proptest::string::string_regex("'(s|t|re|ve|m|ll|d|S|T|RE|Ve|LL|D|x)").expect("re"),
                    proptest::string::string_regex("[\x00-\x7f]{1,3}").expect("re"),
                ],
                0..40,
            )
        ) {
            let text: String = parts.concat();
            for p in [SplitPattern::Qwen, SplitPattern::Cl100k] {
                proptest::prop_assert_eq!(words(p, &text), onig_words(p, &text), "{:?}", text);
            }
        }
    }
}
