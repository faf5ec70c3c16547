//! Content-defined cut points of a UTF-8 text, each hashed once as it is found.
//!
//! A candidate is a space between two ASCII letters (where the whitelisted split regexes provably
//! cut, see the crate docs); one in [`CUT_ONE_IN`] is kept, chosen by a hash of the 8 bytes
//! before it, so the choice depends only on nearby text and two prompts that share a prefix cut
//! it alike. ASCII letters and spaces never occur inside a multi-byte UTF-8 sequence, so byte
//! offsets are valid `str` boundaries.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Keep one candidate cut in this many on average (a power of two): pieces of ~32 words, so a
/// request pays for re-tokenizing about one piece beyond its new text, and a 2,400-token prompt
/// is a few dozen cache lookups.
pub const CUT_ONE_IN: u64 = 32;
/// Bytes before a candidate that decide whether it is kept.
const WINDOW: usize = 8;
/// Fibonacci hashing of the window: the product's top bits depend on every input bit.
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// One piece of a cut text: its byte range and the hash of its bytes (the piece cache's key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// First byte of the piece.
    pub start: usize,
    /// One past its last byte.
    pub stop: usize,
    /// `xxh3_64_with_seed(&data[start..stop], seed)`.
    pub hash: u64,
}

#[inline]
fn is_letter(b: u8) -> bool {
    (b | 32).wrapping_sub(b'a') < 26
}

/// Cuts `data` into pieces (appended to `out`, which is cleared first), at the kept candidates
/// (`one_in`: a power of two; 1 keeps every candidate, which tests use), each piece hashed with
/// `seed`. An empty text has no pieces; otherwise the pieces cover it, in order.
pub fn cut_pieces(data: &[u8], one_in: u64, seed: u64, out: &mut Vec<Piece>) {
    debug_assert!(one_in.is_power_of_two());
    out.clear();
    let n = data.len();
    let mut start = 0;
    let mut piece = |stop: usize, out: &mut Vec<Piece>| {
        out.push(Piece {
            start,
            stop,
            hash: xxh3_64_with_seed(&data[start..stop], seed),
        });
        start = stop;
    };
    if n >= WINDOW + 2 {
        // Keeps the products whose top log2(one_in) bits are zero (all of them when one_in is 1).
        let bits = one_in.trailing_zeros();
        for i in memchr::memchr_iter(b' ', &data[WINDOW..n - 1]) {
            let i = i + WINDOW;
            if !(is_letter(data[i - 1]) && is_letter(data[i + 1])) {
                continue;
            }
            let window = u64::from_le_bytes(data[i - WINDOW..i].try_into().expect("8 bytes"));
            let h = window.wrapping_mul(MIX);
            if bits == 0 || h >> (64 - bits) == 0 {
                piece(i, out);
            }
        }
    }
    if n > 0 {
        piece(n, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct pseudo-words (base-26 numerals), so windows differ and some pass the 1/32 test.
    fn words(n: usize, offset: usize) -> String {
        (offset..offset + n)
            .map(|mut i| {
                let mut w = String::new();
                loop {
                    w.push(char::from(b'a' + (i % 26) as u8));
                    i /= 26;
                    if i == 0 {
                        break w;
                    }
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn cuts(text: &str, one_in: u64) -> Vec<usize> {
        let mut out = Vec::new();
        cut_pieces(text.as_bytes(), one_in, 7, &mut out);
        out.iter().map(|p| p.stop).collect()
    }

    #[test]
    fn every_candidate_with_one_in_one() {
        // Spaces between letters after the first 8 bytes; not before digits, punctuation or
        // another space.
        let text = "abcdefgh ij kl  mn 9 op. qr st";
        assert_eq!(cuts(text, 1), vec![8, 11, 27, text.len()]);
    }

    #[test]
    fn pieces_cover_the_text_and_hash_their_bytes() {
        let text = words(2000, 0);
        let mut out = Vec::new();
        cut_pieces(text.as_bytes(), CUT_ONE_IN, 3, &mut out);
        assert!(out.len() > 5, "{} pieces", out.len());
        let mut at = 0;
        for p in &out {
            assert_eq!(p.start, at);
            assert_eq!(
                p.hash,
                xxh3_64_with_seed(&text.as_bytes()[p.start..p.stop], 3)
            );
            at = p.stop;
        }
        assert_eq!(at, text.len());
    }

    #[test]
    fn shared_prefixes_cut_alike() {
        let base = words(1000, 0) + " ";
        let a = cuts(&(base.clone() + &words(200, 5000)), CUT_ONE_IN);
        let b = cuts(&(base.clone() + &words(200, 9000)), CUT_ONE_IN);
        let shared: Vec<_> = a.iter().filter(|&&c| c + 1 < base.len()).collect();
        assert!(!shared.is_empty());
        assert_eq!(
            shared,
            b.iter()
                .filter(|&&c| c + 1 < base.len())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn short_and_empty_texts() {
        assert_eq!(cuts("", 1), Vec::<usize>::new());
        assert_eq!(cuts("a b", 1), vec![3]);
    }
}
