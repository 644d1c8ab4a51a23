//! Unit tests of the incremental detokenizer on two small tokenizers built
//! in memory: a byte-level BPE one (the precomputed-bytes path) and a
//! SentencePiece-style one with byte fallback (the `tokenizers` decode path).

use super::*;
use crate::test_rng::SplitMix64;

const SPECIAL: u32 = 300;
const ADDED: u32 = 301;
const CAFE: u32 = 302;
// (The crate renumbers added tokens past the model's vocabulary: tests look
// their ids up by content.)
/// "é", two bytes in one token.
const E_ACUTE: u32 = 259;
/// " " and the first three of the four bytes of "😀" (F0 9F 98 80), as in
/// SmolLM2's `'ĠðŁĺ'`: a space then an incomplete character.
pub(crate) const SPACE_EMOJI_START: u32 = 260;

/// GPT-2's byte-to-character table, written out the long way as a reference:
/// printable bytes map to themselves, the other 68 to U+0100 onwards in order.
fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(255 + next).expect("U+0100..U+0143 are chars")
        };
    }
    table
}

/// Byte-level BPE: ids 0..=255 are the 256 byte characters, then words; added
/// tokens `<s>` (special), `<tool>` and `café` (not special).
pub(crate) fn byte_level_tokenizer() -> Tokenizer {
    let chars = byte_level_chars();
    let mut vocab: Vec<(String, u32)> = (0..=255u8)
        .map(|b| (chars[b as usize].to_string(), b as u32))
        .collect();
    for (i, word) in ["Ġhello", "Ġworld", "ĠÃ©t", "Ã©", "ĠðŁĺ"]
        .iter()
        .enumerate()
    {
        vocab.push((word.to_string(), 256 + i as u32));
    }
    let vocab_json: Vec<String> = vocab
        .iter()
        .map(|(token, id)| format!("{}: {id}", serde_json_string(token)))
        .collect();
    let json = format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[
          {{"id":{SPECIAL},"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}},
          {{"id":{ADDED},"content":"<tool>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":false}},
          {{"id":{CAFE},"content":"café","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":false}}],
        "normalizer":null,
        "pre_tokenizer":{{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}},
        "post_processor":null,
        "decoder":{{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}},
        "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
          "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
          "vocab":{{{}}},"merges":[]}}}}"#,
        vocab_json.join(",")
    );
    json.parse().expect("valid tokenizer json")
}

/// SentencePiece style: Metaspace words, byte fallback, a Strip decoder.
fn sentencepiece_tokenizer() -> Tokenizer {
    let mut vocab = vec![
        ("<unk>".to_string(), 0u32),
        ("<s>".into(), 1),
        ("</s>".into(), 2),
        ("▁hello".into(), 3),
        ("▁world".into(), 4),
        ("!".into(), 5),
        ("▁".into(), 6),
    ];
    for b in 0..=255u32 {
        vocab.push((format!("<0x{b:02X}>"), 7 + b));
    }
    let vocab_json: Vec<String> = vocab
        .iter()
        .map(|(token, id)| format!("{}: {id}", serde_json_string(token)))
        .collect();
    let json = format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[
          {{"id":1,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
        "normalizer":null,"pre_tokenizer":null,"post_processor":null,
        "decoder":{{"type":"Sequence","decoders":[
          {{"type":"Replace","pattern":{{"String":"▁"}},"content":" "}},
          {{"type":"ByteFallback"}},{{"type":"Fuse"}},
          {{"type":"Strip","content":" ","start":1,"stop":0}}]}},
        "model":{{"type":"BPE","dropout":null,"unk_token":"<unk>","continuing_subword_prefix":null,
          "end_of_word_suffix":null,"fuse_unk":true,"byte_fallback":true,"ignore_merges":false,
          "vocab":{{{}}},"merges":[]}}}}"#,
        vocab_json.join(",")
    );
    json.parse().expect("valid tokenizer json")
}

fn serde_json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn byte_id(b: u8) -> u32 {
    b as u32
}

/// Feed `ids` one by one, streaming; the deltas handed out after each token.
fn stream(decoder: &TokenDecoder, detok: &mut SeqDetokenizer, ids: &[u32]) -> Vec<String> {
    let mut scratch = Scratch::default();
    let mut deltas = Vec::new();
    for &id in ids {
        let stopped = detok.add_token(decoder, id, &mut scratch);
        deltas.push(detok.take_delta(stopped).to_string());
        if stopped {
            break;
        }
    }
    deltas
}

fn plain(stops: &[&str], include_stop: bool) -> SeqDetokenizer {
    SeqDetokenizer::new(
        &[],
        stops.iter().map(|s| s.to_string()).collect(),
        include_stop,
        true,
    )
}

#[test]
fn byte_table_is_the_crates_byte_level_mapping() {
    let chars = byte_level_chars();
    let alphabet = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
    assert_eq!(alphabet.len(), 256);
    assert!(chars.iter().all(|c| alphabet.contains(c)));
    // Every valid two- and three-byte character round-trips through the crate's decoder.
    let tokenizer = byte_level_tokenizer();
    for lead in 0xC2..=0xDFu8 {
        for cont in 0x80..=0xBFu8 {
            let ids = [byte_id(lead), byte_id(cont)];
            let want = std::str::from_utf8(&[lead, cont]).unwrap().to_string();
            assert_eq!(tokenizer.decode(&ids, true).unwrap(), want);
        }
    }
    for lead in 0xE1..=0xECu8 {
        let ids = [byte_id(lead), byte_id(0x80), byte_id(0x80)];
        let want = std::str::from_utf8(&[lead, 0x80, 0x80])
            .unwrap()
            .to_string();
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), want);
    }
}

#[test]
fn precomputed_bytes_decode_exactly_as_the_crate_on_random_windows() {
    let tokenizer = byte_level_tokenizer();
    let fast = TokenDecoder::new(tokenizer.clone());
    assert!(fast.is_byte_level());
    let special = tokenizer.token_to_id("<s>").unwrap();
    let added = tokenizer.token_to_id("<tool>").unwrap();
    let cafe = tokenizer.token_to_id("café").unwrap();
    let mut rng = SplitMix64::new(7);
    for _ in 0..3000 {
        let len = rng.below(8);
        // Mostly bytes >= 0x80 (broken and whole characters), some words and specials.
        let ids: Vec<u32> = (0..len)
            .map(|_| match rng.below(10) {
                0 => special,
                1 if rng.below(2) == 0 => added,
                1 => cafe,
                2 => 256 + rng.below(5) as u32,
                3 => 400, // outside the vocabulary: decode skips it
                4 | 5 => rng.below(128) as u32,
                _ => 0x80 + rng.below(128) as u32,
            })
            .collect();
        for skip in [true, false] {
            assert_eq!(
                fast.decode(&ids, skip),
                tokenizer.decode(&ids, skip).unwrap(),
                "{ids:?}"
            );
        }
    }
}

#[test]
fn a_character_split_across_tokens_is_held_until_complete() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&[], false);
    // "中" is E4 B8 AD: nothing until the third byte.
    let deltas = stream(
        &decoder,
        &mut detok,
        &[byte_id(b'a'), 0xE4, 0xB8, 0xAD, byte_id(b'b')],
    );
    assert_eq!(deltas, ["a", "", "", "中", "b"]);
    assert_eq!(detok.text(), "a中b");
    detok.check_invariants().unwrap();
}

#[test]
fn prompt_context_gives_the_right_leading_space() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let prompt: Vec<u32> = (0..10).map(|i| byte_id(b'a' + i)).collect();
    let mut detok = SeqDetokenizer::new(&prompt, vec![], false, true);
    assert_eq!(detok.ids.len(), PROMPT_CONTEXT_TOKENS);
    assert_eq!(
        stream(&decoder, &mut detok, &[256, 257]),
        [" hello", " world"]
    );
}

#[test]
fn a_stop_string_spanning_tokens_cuts_the_text() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["lo wo"], false);
    let deltas = stream(&decoder, &mut detok, &[256, 257, byte_id(b'!')]);
    assert_eq!(deltas.concat(), " hel");
    assert_eq!(detok.text(), " hel");
    assert_eq!(detok.stop_reason(), Some("lo wo"));
    // No more tokens are taken after a stop.
    let mut scratch = Scratch::default();
    assert_eq!(detok.add_tokens(&decoder, &[256], &mut scratch), 0);
    assert_eq!(detok.text(), " hel");
}

#[test]
fn include_stop_str_in_output_keeps_the_stop_string() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["world"], true);
    let deltas = stream(&decoder, &mut detok, &[256, 257, byte_id(b'!')]);
    assert_eq!(deltas.concat(), " hello world");
    assert_eq!(detok.stop_reason(), Some("world"));
}

#[test]
fn the_earliest_stop_wins_and_ties_go_to_the_first_listed() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["world", "hello world", "lo"], false);
    stream(&decoder, &mut detok, &[256, 257]);
    assert_eq!(detok.stop_reason(), Some("lo")); // " hel|lo" ends first... at index 4
    assert_eq!(detok.text(), " hel");
    let mut detok = plain(&["hello", "hell"], false);
    stream(&decoder, &mut detok, &[256]);
    assert_eq!(detok.stop_reason(), Some("hello"));
}

#[test]
fn streaming_holds_back_what_could_start_a_stop_string() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["world!"], false); // holds back 5 characters
    let mut scratch = Scratch::default();
    detok.add_token(&decoder, 256, &mut scratch); // " hello"
    assert_eq!(detok.take_delta(false), " ");
    detok.add_token(&decoder, 257, &mut scratch); // " hello world"
    assert_eq!(detok.take_delta(false), "hello ");
    assert_eq!(detok.emitted(), 7);
    detok.add_token(&decoder, byte_id(b'?'), &mut scratch);
    assert_eq!(detok.take_delta(false), "w");
    assert_eq!(detok.take_delta(true), "orld?");
    assert_eq!(detok.take_delta(true), "");
}

#[test]
fn holdback_counts_characters_not_bytes() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["xé"], false); // holds back 1 character
    let mut scratch = Scratch::default();
    for id in [byte_id(b'a'), E_ACUTE, E_ACUTE] {
        detok.add_token(&decoder, id, &mut scratch); // "aéé": é is 2 bytes
    }
    assert_eq!(detok.take_delta(false), "aé");
    assert_eq!(detok.take_delta(true), "é");
}

#[test]
fn skip_special_tokens_decides_whether_special_tokens_show() {
    let tokenizer = byte_level_tokenizer();
    let special = tokenizer.token_to_id("<s>").unwrap();
    let added = tokenizer.token_to_id("<tool>").unwrap();
    let decoder = TokenDecoder::new(tokenizer);
    let mut skip = SeqDetokenizer::new(&[], vec![], false, true);
    let mut keep = SeqDetokenizer::new(&[], vec![], false, false);
    let ids = [256, special, added, 257];
    assert_eq!(
        stream(&decoder, &mut skip, &ids).concat(),
        " hello<tool> world"
    );
    assert_eq!(
        stream(&decoder, &mut keep, &ids).concat(),
        " hello<s><tool> world"
    );
}

#[test]
fn sentencepiece_byte_fallback_goes_through_the_crate() {
    let decoder = TokenDecoder::new(sentencepiece_tokenizer());
    assert!(!decoder.is_byte_level());
    let mut detok = SeqDetokenizer::new(&[1, 3], vec![], false, true);
    // " world" then "中" as three byte-fallback tokens, then "!".
    let ids = [4, 7 + 0xE4, 7 + 0xB8, 7 + 0xAD, 5];
    let deltas = stream(&decoder, &mut detok, &ids);
    assert_eq!(deltas, [" world", "", "", "中", "!"]);
    // Without prompt context the Strip decoder eats the first leading space.
    let mut detok = SeqDetokenizer::new(&[], vec![], false, true);
    assert_eq!(
        stream(&decoder, &mut detok, &[3, 4]).concat(),
        "hello world"
    );
}

#[test]
fn random_streams_keep_the_invariants_and_agree_with_whole_decodes() {
    let tokenizer = byte_level_tokenizer();
    let decoder = TokenDecoder::new(tokenizer.clone());
    let mut rng = SplitMix64::new(11);
    for _ in 0..300 {
        let ids: Vec<u32> = (0..rng.below(40))
            .map(|_| {
                if rng.below(3) == 0 {
                    256 + rng.below(5) as u32
                } else {
                    rng.below(256) as u32
                }
            })
            .collect();
        let mut detok = plain(&[], false);
        let mut scratch = Scratch::default();
        let mut streamed = String::new();
        for &id in &ids {
            detok.add_token(&decoder, id, &mut scratch);
            streamed.push_str(detok.take_delta(false));
        }
        detok.check_invariants().unwrap();
        // Whatever was emitted is a prefix of the whole decode; at the end
        // the rest (an incomplete character and what precedes it in its
        // token) comes out too.
        let whole = tokenizer.decode(&ids, true).unwrap();
        assert!(whole.starts_with(&streamed), "{streamed:?} vs {whole:?}");
        assert!(!detok.finish(&decoder, &mut scratch));
        streamed.push_str(detok.take_delta(true));
        assert_eq!(streamed, whole, "{ids:?}");
        detok.check_invariants().unwrap();
    }
}

#[test]
fn a_stop_cutting_text_already_handed_out_keeps_emitted_like_python() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["lo wo"], false);
    let mut scratch = Scratch::default();
    detok.add_token(&decoder, 256, &mut scratch);
    assert_eq!(detok.take_delta(true), " hello"); // handed out before the end
    assert!(detok.add_token(&decoder, 257, &mut scratch));
    assert_eq!(detok.text(), " hel");
    assert_eq!(detok.emitted(), 6);
    assert_eq!(detok.take_delta(true), "");
    assert_eq!(detok.emitted(), 6);
    detok.check_invariants().unwrap();
}

#[test]
fn byte_of_char_inverts_gpt2s_table() {
    let chars = byte_level_chars();
    for b in 0..=255u8 {
        assert_eq!(byte_of_char(chars[b as usize]), Some(b));
    }
    let table: Vec<char> = chars.to_vec();
    for c in ('\0'..='\u{300}').chain(['😀', '中']) {
        if !table.contains(&c) {
            assert_eq!(byte_of_char(c), None, "{c:?}");
        }
    }
}

#[test]
fn byte_level_bytes_follows_the_crates_decoder_for_every_kind_of_token() {
    let tokenizer = byte_level_tokenizer();
    let bytes = |token: &str| {
        let mut out = b"kept".to_vec(); // appends after what is there
        byte_level_bytes(token, &mut out);
        out[4..].to_vec()
    };
    assert_eq!(bytes("Ġhello"), b" hello");
    assert_eq!(bytes("ĠðŁĺ"), b" \xF0\x9F\x98");
    // An added token made of byte-table chars is those bytes, not its UTF-8:
    // "café" is c a f 0xE9, which `decode` shows as "caf\u{FFFD}".
    assert_eq!(bytes("café"), b"caf\xE9");
    let cafe = tokenizer.token_to_id("café").unwrap();
    assert_eq!(tokenizer.decode(&[cafe], true).unwrap(), "caf\u{FFFD}");
    assert_eq!(
        TokenDecoder::new(tokenizer).decode(&[cafe], true),
        "caf\u{FFFD}"
    );
    // A token with any other char is its UTF-8.
    assert_eq!(bytes("😀x"), "😀x".as_bytes());
    assert_eq!(bytes("<tool>"), b"<tool>");
    assert_eq!(bytes(""), b"");
}

#[test]
fn finishing_releases_a_held_back_character_as_decode_renders_it() {
    let tokenizer = byte_level_tokenizer();
    let decoder = TokenDecoder::new(tokenizer.clone());
    let mut detok = plain(&[], false);
    let ids = [256, SPACE_EMOJI_START]; // " hello", then " " + 3 of 4 bytes
    assert_eq!(stream(&decoder, &mut detok, &ids), [" hello", ""]);
    let mut scratch = Scratch::default();
    assert!(!detok.finish(&decoder, &mut scratch));
    assert_eq!(detok.text(), tokenizer.decode(&ids, true).unwrap());
    assert_eq!(detok.text(), " hello \u{FFFD}");
    assert_eq!(detok.take_delta(true), " \u{FFFD}");
    detok.check_invariants().unwrap();
    // Again: nothing is held back any more.
    assert!(!detok.finish(&decoder, &mut scratch));
    assert_eq!(detok.text(), " hello \u{FFFD}");
    assert_eq!(detok.take_delta(true), "");
}

#[test]
fn finishing_with_nothing_held_back_changes_nothing() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["xyz"], false);
    stream(&decoder, &mut detok, &[256, 257]);
    assert!(!detok.finish(&decoder, &mut Scratch::default()));
    assert_eq!(detok.text(), " hello world");
    // A special token skipped from the text is held (no new text) and released as nothing.
    let tokenizer = byte_level_tokenizer();
    let special = tokenizer.token_to_id("<s>").unwrap();
    let mut detok = plain(&[], false);
    stream(&decoder, &mut detok, &[256, special]);
    assert!(!detok.finish(&decoder, &mut Scratch::default()));
    assert_eq!(detok.text(), " hello");
}

#[test]
fn a_stop_string_in_the_released_text_still_cuts_it() {
    let decoder = TokenDecoder::new(byte_level_tokenizer());
    let mut detok = plain(&["a "], false);
    stream(&decoder, &mut detok, &[byte_id(b'a'), SPACE_EMOJI_START]);
    assert_eq!(detok.text(), "a");
    assert!(detok.finish(&decoder, &mut Scratch::default()));
    assert_eq!(detok.stop_reason(), Some("a "));
    assert_eq!(detok.text(), "");
    assert_eq!(detok.take_delta(true), "");
    // Once stopped, finishing reports the stop and changes nothing.
    assert!(detok.finish(&decoder, &mut Scratch::default()));
    detok.check_invariants().unwrap();
}
