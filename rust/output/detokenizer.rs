//! Incremental detokenization with stop strings, for many sequences at once.
//!
//! This is the Rust twin of `python/kvpage/outputs/detokenizer.py` and produces the
//! same text, character for character (a differential test in
//! `tests/outputs/test_detokenizer_rust.py` holds it to that). The algorithm:
//!
//! - Each sequence decodes a sliding window of its ids, seeded with the last
//!   [`PROMPT_CONTEXT_TOKENS`] prompt ids (so leading spaces come out right).
//!   The text of `ids[prefix..read]` is already emitted; the text of
//!   `ids[prefix..]` minus it (in characters) is new. New text ending in
//!   U+FFFD (an incomplete UTF-8 sequence) waits for the next token; when the
//!   sample ends first, [`SeqDetokenizer::finish`] releases it as `decode`
//!   renders it (with the U+FFFD): a finished sample's text is what `decode`
//!   gives for its ids (up to a stop string).
//! - Stop strings are searched in the text from `len(longest stop) - 1`
//!   characters before the old end; the earliest match wins (ties: the first
//!   listed). The text is cut before the stop string, or after it with
//!   `include_stop`, and the sequence takes no more tokens.
//! - While streaming, `take_delta` holds back the last `len(longest stop) - 1`
//!   characters, so a client never receives text a later match removes.
//!
//! Lengths and offsets the Python side sees are in characters (code points),
//! as Python's `str` counts them; internally text is UTF-8 and both the byte
//! and the character position of what was emitted are kept.
//!
//! Decoding a window ([`TokenDecoder`]): for a `ByteLevel` decoder (GPT-2,
//! Llama 3, Qwen, SmolLM...), the `tokenizers` crate's `decode` is exactly
//! "concatenate each kept token's bytes, then `String::from_utf8_lossy`", so
//! each token's bytes are computed once at load time and a window decodes
//! with no allocation beyond a scratch buffer. Any other decoder
//! (SentencePiece's Metaspace, WordPiece, Strip...) decodes through the
//! `tokenizers` crate itself, which is what the Python fast tokenizer calls.
//!
//! Invariants (checked by [`SeqDetokenizer::check_invariants`] in debug
//! builds after every mutation):
//! - `prefix <= read <= ids.len()`;
//! - `text_chars == text.chars().count()`;
//! - `emitted_bytes` is the byte offset of character `emitted_chars` in
//!   `text`, and `emitted_chars <= text_chars` -- except after a stop string
//!   cut text already handed out (possible only if `take_delta(true)` came
//!   before the end), when, as in Python, `emitted_chars` stays put and
//!   `emitted_bytes == text.len()`;
//! - once `stop_reason` is set the text never changes again.

use std::borrow::Cow;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

/// Prompt tokens decoded with the output so leading spaces come out right.
pub const PROMPT_CONTEXT_TOKENS: usize = 6;

const REPLACEMENT: char = '\u{FFFD}';

/// The bytes GPT-2's byte-level table keeps as their own character.
const fn printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The other 68 bytes, in order: GPT-2's table maps them to U+0100 onwards.
const MOVED: [u8; 68] = {
    let mut moved = [0u8; 68];
    let (mut b, mut n) = (0usize, 0usize);
    while b < 256 {
        if !printable(b as u8) {
            moved[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    moved
};

/// The byte `c` stands for in GPT-2's byte table, if it is one of its 256 chars.
fn byte_of_char(c: char) -> Option<u8> {
    match u8::try_from(u32::from(c)) {
        Ok(b) => printable(b).then_some(b),
        Err(_) => MOVED
            .get((u32::from(c) as usize).checked_sub(0x100)?)
            .copied(),
    }
}

/// Append the bytes `token` stands for under a `ByteLevel` decoder: the
/// `tokenizers` crate's rule, for every token (added and special ones too):
/// a token whose every char is in GPT-2's byte table is those bytes (so an
/// added token "café" is `caf\xE9`, and `decode` shows "caf\u{FFFD}"), any
/// other token its UTF-8. The one place kvpage computes it: the grammar
/// vocabulary (`python/kvpage/structured_outputs/vocab.py`) gets its byte-level
/// token bytes from here too, through `kvpage._core.byte_level_token_bytes`.
pub fn byte_level_bytes(token: &str, out: &mut Vec<u8>) {
    let start = out.len();
    for c in token.chars() {
        match byte_of_char(c) {
            Some(b) => out.push(b),
            None => {
                out.truncate(start);
                out.extend_from_slice(token.as_bytes());
                return;
            }
        }
    }
}

/// The bytes of each token id under a `ByteLevel` decoder, flattened.
#[derive(Debug)]
struct ByteTable {
    bytes: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` are the bytes of `id`.
    offsets: Vec<u32>,
    /// Ids that `decode` drops with `skip_special_tokens` (special added tokens).
    special: Vec<bool>,
}

impl ByteTable {
    fn new(tokenizer: &Tokenizer) -> Self {
        let added = tokenizer.get_added_vocabulary();
        let n = tokenizer
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let mut table = ByteTable {
            bytes: Vec::new(),
            offsets: Vec::with_capacity(n + 1),
            special: vec![false; n],
        };
        table.offsets.push(0);
        for id in 0..n {
            if let Some(token) = tokenizer.id_to_token(id as u32) {
                byte_level_bytes(&token, &mut table.bytes);
                table.special[id] = added.is_special_token(&token);
            }
            table.offsets.push(table.bytes.len() as u32);
        }
        table
    }

    fn token(&self, id: u32) -> &[u8] {
        let id = id as usize;
        if id + 1 >= self.offsets.len() {
            return &[];
        }
        &self.bytes[self.offsets[id] as usize..self.offsets[id + 1] as usize]
    }
}

/// How a window of ids becomes text: exactly `tokenizer.decode(ids, skip_special_tokens)`.
#[derive(Debug)]
pub struct TokenDecoder {
    tokenizer: Tokenizer,
    bytes: Option<ByteTable>,
}

/// Scratch buffers reused across windows, so decoding does not allocate.
#[derive(Debug, Default)]
pub struct Scratch {
    bytes: Vec<u8>,
    prefix: String,
    full: String,
}

impl TokenDecoder {
    /// Load a serialized `tokenizers` tokenizer (`tokenizer.json`, or what
    /// `backend_tokenizer.to_str()` returns in Python).
    pub fn from_json(json: &str) -> Result<Self, String> {
        let tokenizer: Tokenizer = json
            .parse()
            .map_err(|err| format!("cannot load the tokenizer: {err}"))?;
        Ok(Self::new(tokenizer))
    }

    pub fn new(tokenizer: Tokenizer) -> Self {
        let byte_level = matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let bytes = byte_level.then(|| ByteTable::new(&tokenizer));
        TokenDecoder { tokenizer, bytes }
    }

    /// True when windows decode from precomputed token bytes (a `ByteLevel` decoder).
    pub fn is_byte_level(&self) -> bool {
        self.bytes.is_some()
    }

    /// `tokenizer.decode(ids, skip_special)` into `out` (cleared first).
    pub fn decode_into(
        &self,
        ids: &[u32],
        skip_special: bool,
        buf: &mut Vec<u8>,
        out: &mut String,
    ) {
        out.clear();
        match &self.bytes {
            Some(table) => {
                buf.clear();
                for &id in ids {
                    if !(skip_special && table.special.get(id as usize).copied().unwrap_or(false)) {
                        buf.extend_from_slice(table.token(id));
                    }
                }
                match String::from_utf8_lossy(buf) {
                    Cow::Borrowed(text) => out.push_str(text),
                    Cow::Owned(text) => out.push_str(&text),
                }
            }
            None => {
                // The crate reports only unknown-decoder errors here; an id
                // outside the vocabulary is skipped, as in Python.
                if let Ok(text) = self.tokenizer.decode(ids, skip_special) {
                    out.push_str(&text);
                }
            }
        }
    }

    /// `tokenizer.decode(ids, skip_special)`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut out = String::new();
        self.decode_into(ids, skip_special, &mut Vec::new(), &mut out);
        out
    }
}

/// The growing text of one sample, with stop-string detection.
#[derive(Debug, Clone)]
pub struct SeqDetokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special: bool,
    stops: Vec<String>,
    include_stop: bool,
    holdback: usize,
    text: String,
    text_chars: usize,
    emitted_chars: usize,
    emitted_bytes: usize,
    stop_reason: Option<usize>,
}

/// Byte offset of the character `n` characters before the end of `text` (0 if fewer).
fn back_chars(text: &str, n: usize) -> usize {
    if n == 0 {
        return text.len();
    }
    text.char_indices().rev().nth(n - 1).map_or(0, |(at, _)| at)
}

impl SeqDetokenizer {
    pub fn new(
        prompt_token_ids: &[u32],
        stops: Vec<String>,
        include_stop: bool,
        skip_special: bool,
    ) -> Self {
        let start = prompt_token_ids.len().saturating_sub(PROMPT_CONTEXT_TOKENS);
        let ids = prompt_token_ids[start..].to_vec();
        let holdback = stops
            .iter()
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        SeqDetokenizer {
            read: ids.len(),
            ids,
            prefix: 0,
            skip_special,
            stops,
            include_stop,
            holdback,
            text: String::new(),
            text_chars: 0,
            emitted_chars: 0,
            emitted_bytes: 0,
            stop_reason: None,
        }
    }

    /// Output text so far (cut at a stop string once one matched).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Characters of `text` already handed out by [`Self::take_delta`].
    pub fn emitted(&self) -> usize {
        self.emitted_chars
    }

    /// The stop string that matched, if any.
    pub fn stop_reason(&self) -> Option<&str> {
        self.stop_reason.map(|i| self.stops[i].as_str())
    }

    /// Append one generated token; true when a stop string has matched.
    pub fn add_token(&mut self, decoder: &TokenDecoder, token: u32, scratch: &mut Scratch) -> bool {
        if self.stop_reason.is_some() {
            return true;
        }
        self.ids.push(token);
        self.advance(decoder, scratch, false)
    }

    /// The sample ended (no more tokens come): release the text held back
    /// waiting for the rest of a character, as `decode` renders it (an
    /// incomplete UTF-8 character as U+FFFD). True when a stop string has
    /// matched, in that text or before. Cheap when nothing is held back.
    pub fn finish(&mut self, decoder: &TokenDecoder, scratch: &mut Scratch) -> bool {
        if self.stop_reason.is_some() {
            return true;
        }
        if self.read == self.ids.len() {
            return false; // nothing held back
        }
        self.advance(decoder, scratch, true)
    }

    /// Decode the window and append its new text: only once it is complete
    /// (something new, not ending in U+FFFD), unless `finished`.
    fn advance(&mut self, decoder: &TokenDecoder, scratch: &mut Scratch, finished: bool) -> bool {
        let Scratch {
            bytes,
            prefix,
            full,
        } = scratch;
        decoder.decode_into(
            &self.ids[self.prefix..self.read],
            self.skip_special,
            bytes,
            prefix,
        );
        decoder.decode_into(&self.ids[self.prefix..], self.skip_special, bytes, full);
        let prefix_chars = prefix.chars().count();
        let full_chars = full.chars().count();
        let new = full_chars > prefix_chars;
        if !finished && (!new || full.ends_with(REPLACEMENT)) {
            return false; // nothing complete yet
        }
        let old_bytes = self.text.len();
        if new {
            let new_at = full
                .char_indices()
                .nth(prefix_chars)
                .map_or(full.len(), |(at, _)| at);
            self.text.push_str(&full[new_at..]);
            self.text_chars += full_chars - prefix_chars;
        }
        // Drop ids before the window: they are never decoded again.
        let done = self.read;
        self.ids.drain(..done);
        self.prefix = 0;
        self.read = self.ids.len();
        let stopped = self.check_stop(old_bytes);
        self.debug_check();
        stopped
    }

    /// Feed tokens until a stop string matches; returns how many were taken.
    pub fn add_tokens(
        &mut self,
        decoder: &TokenDecoder,
        tokens: &[u32],
        scratch: &mut Scratch,
    ) -> usize {
        for (taken, &token) in tokens.iter().enumerate() {
            if self.stop_reason.is_some() {
                return taken;
            }
            self.add_token(decoder, token, scratch);
        }
        tokens.len()
    }

    fn check_stop(&mut self, old_bytes: usize) -> bool {
        if self.stops.is_empty() {
            return false;
        }
        let start = back_chars(&self.text[..old_bytes], self.holdback);
        let haystack = &self.text[start..];
        let mut best: Option<(usize, usize)> = None;
        for (i, stop) in self.stops.iter().enumerate() {
            if let Some(at) = haystack.find(stop.as_str()) {
                if best.is_none_or(|(b, _)| at < b) {
                    best = Some((at, i));
                }
            }
        }
        let Some((at, i)) = best else {
            return false;
        };
        let cut = start
            + at
            + if self.include_stop {
                self.stops[i].len()
            } else {
                0
            };
        self.text.truncate(cut);
        self.text_chars = self.text.chars().count();
        if self.emitted_chars > self.text_chars {
            // Text handed out early (`take_delta(true)` before the end) can be
            // cut away: as in Python, `emitted` stays and no more text comes.
            self.emitted_bytes = self.text.len();
        }
        self.stop_reason = Some(i);
        true
    }

    /// Text not yet handed out. Until `finished`, the tail that could still
    /// be the start of a stop string is held back.
    pub fn take_delta(&mut self, finished: bool) -> &str {
        let held = if finished || self.stops.is_empty() {
            0
        } else {
            self.holdback
        };
        let end_chars = self.text_chars.saturating_sub(held);
        let start = self.emitted_bytes;
        if end_chars > self.emitted_chars {
            self.emitted_chars = end_chars;
            self.emitted_bytes = back_chars(&self.text, self.text_chars - end_chars);
        }
        self.debug_check();
        &self.text[start..self.emitted_bytes]
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            if let Err(err) = self.check_invariants() {
                panic!("detokenizer invariant broken: {err}");
            }
        }
    }

    /// Err naming the first broken invariant (see the module docs).
    pub fn check_invariants(&self) -> Result<(), String> {
        if !(self.prefix <= self.read && self.read <= self.ids.len()) {
            return Err(format!(
                "window {}..{} of {} ids",
                self.prefix,
                self.read,
                self.ids.len()
            ));
        }
        if self.text_chars != self.text.chars().count() {
            return Err("text_chars out of date".into());
        }
        let emitted = self
            .text
            .get(..self.emitted_bytes)
            .map(|t| t.chars().count());
        if emitted != Some(self.emitted_chars.min(self.text_chars))
            || (self.emitted_chars > self.text_chars && self.stop_reason.is_none())
        {
            return Err("emitted offsets disagree with the text".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "detokenizer_tests.rs"]
pub(crate) mod tests;
