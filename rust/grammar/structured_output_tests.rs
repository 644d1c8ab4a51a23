//! Tests of structured outputs: grammar compilation and masks
//! (`structured_output.rs`) and the scheduler carrying matchers
//! (`sched/scheduler/grammar.rs`), over a small byte-level vocabulary.

use std::collections::HashMap;

use crate::error::KvError;
use crate::grammar::structured_output::{
    fill_bitmasks, words, GrammarMatcher, GrammarVocab, GuidedSpec,
};
use crate::sched::request::{FinishReason, RequestParams};
use crate::sched::scheduler::{Scheduler, SchedulerConfig, TokenEvent};
use crate::test_rng::SplitMix64;

/// Ids 0..256 are the single bytes, then a few multi-byte tokens, then EOS.
const MULTI: [&str; 8] = ["{\"", "\":", "true", "false", "12", "ab", ", ", "\"}"];
const EOS: u32 = 256 + MULTI.len() as u32;
/// Vocabulary padded past the tokenizer, as model embeddings often are.
const VOCAB: usize = EOS as usize + 1 + 7;

fn vocab() -> GrammarVocab {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    tokens.extend(MULTI.iter().map(|s| s.as_bytes().to_vec()));
    tokens.push(b"\xff<eos>".to_vec());
    tokens.resize(VOCAB, Vec::new());
    GrammarVocab::new(tokens, &[EOS]).unwrap()
}

fn token_bytes(token: u32) -> Vec<u8> {
    match token {
        0..=255 => vec![token as u8],
        t if t < EOS => MULTI[(t - 256) as usize].as_bytes().to_vec(),
        _ => Vec::new(),
    }
}

fn allowed(mask: &[u32]) -> Vec<u32> {
    (0..VOCAB as u32)
        .filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1)
        .collect()
}

fn mask_of(m: &mut GrammarMatcher) -> Vec<u32> {
    let mut out = vec![0u32; words(VOCAB)];
    m.fill_mask(&mut out).unwrap();
    allowed(&out)
}

/// Sample uniformly among the allowed tokens until the grammar is done
/// (or EOS is drawn); returns the text.
fn random_walk(m: &mut GrammarMatcher, rng: &mut SplitMix64, limit: usize) -> String {
    let mut text = Vec::new();
    for _ in 0..limit {
        if m.is_stopped() {
            break;
        }
        let options = mask_of(m);
        assert!(!options.is_empty(), "a row must never be fully masked");
        let token = options[rng.below(options.len())];
        m.consume(token).unwrap();
        if token == EOS {
            break;
        }
        text.extend(token_bytes(token));
    }
    String::from_utf8(text).unwrap()
}

fn compile(kind: &str, value: &str) -> crate::grammar::structured_output::Grammar {
    vocab()
        .compile(&GuidedSpec::parse(kind, value).unwrap())
        .unwrap()
}

#[test]
fn choice_allows_only_its_strings_and_then_only_eos() {
    let grammar = compile("choice", r#"["yes", "no"]"#);
    let mut m = grammar.matcher();
    let first = mask_of(&mut m);
    assert_eq!(first, vec![b'n' as u32, b'y' as u32]);
    for &b in b"no" {
        m.consume(b as u32).unwrap();
    }
    assert!(m.is_stopped(), "a complete choice leaves nothing to add");
    assert_eq!(mask_of(&mut m), vec![EOS]);
}

#[test]
fn regex_masks_follow_the_pattern_and_padding_is_never_allowed() {
    let grammar = compile("regex", "[0-9]{2}x");
    let mut m = grammar.matcher();
    let digits: Vec<u32> = (b'0'..=b'9').map(u32::from).collect();
    let mut first = digits.clone();
    first.push(260); // "12" fits two digits at once
    assert_eq!(mask_of(&mut m), first);
    m.consume(260).unwrap();
    assert_eq!(mask_of(&mut m), vec![b'x' as u32]);
    m.consume(b'x' as u32).unwrap();
    assert!(m.is_stopped());
    for t in EOS + 1..VOCAB as u32 {
        assert!(!mask_of(&mut grammar.matcher()).contains(&t));
    }
}

#[test]
fn random_walks_through_a_json_schema_always_validate() {
    let schema = r#"{
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
        },
        "required": ["name", "ok", "n"],
        "additionalProperties": false
    }"#;
    let grammar = compile("json", schema);
    let mut rng = SplitMix64::new(7);
    for _ in 0..30 {
        let mut m = grammar.matcher();
        let text = random_walk(&mut m, &mut rng, 400);
        assert!(m.is_stopped(), "the grammar must force termination: {text}");
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let obj = value.as_object().unwrap();
        assert!(obj["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        assert!(obj["ok"].is_boolean(), "{text}");
        assert!((0..=99).contains(&obj["n"].as_i64().unwrap()), "{text}");
        if let Some(tags) = obj.get("tags") {
            let tags = tags.as_array().unwrap();
            assert!(tags.len() <= 3);
            assert!(tags.iter().all(|t| t == "a" || t == "b"), "{text}");
        }
        assert!(obj
            .keys()
            .all(|k| ["name", "ok", "n", "tags"].contains(&k.as_str())));
    }
}

#[test]
fn json_object_output_is_an_object() {
    let grammar = compile("json_object", "");
    let mut rng = SplitMix64::new(3);
    let mut m = grammar.matcher();
    assert_eq!(
        mask_of(&mut m),
        vec![b'{' as u32, 256],
        "only '{{' and '{{\"' start an object"
    );
    let text = random_walk(&mut m, &mut rng, 300);
    if m.is_stopped() {
        assert!(serde_json::from_str::<serde_json::Value>(&text)
            .unwrap()
            .is_object());
    }
}

#[test]
fn invalid_specs_are_rejected_naming_the_field() {
    let v = vocab();
    let err = |kind: &str, value: &str| match GuidedSpec::parse(kind, value)
        .and_then(|spec| v.compile(&spec))
    {
        Err(KvError::InvalidArgument(msg)) => msg,
        other => panic!("{kind} {value:?} should fail, got {other:?}"),
    };
    assert!(err("json", "{not json").starts_with("json:"));
    assert!(err("json", r#"{"type": "strin"}"#).starts_with("json:"));
    assert!(err("regex", "(unclosed").starts_with("regex:"));
    assert!(err("choice", "[]").starts_with("choice"));
    assert!(err("choice", r#"{"a": 1}"#).starts_with("choice"));
    assert!(err("grammar", "start: foo").starts_with("grammar:"));
    assert!(err("xml", "").contains("unknown guided decoding kind"));
    let msg = err("json", r#"{"type": "integer", "minimum": 5, "maximum": 1}"#);
    assert!(msg.starts_with("json:"), "{msg}");
}

#[test]
fn vocab_rejects_missing_or_out_of_range_eos() {
    let tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    assert!(GrammarVocab::new(tokens.clone(), &[]).is_err());
    assert!(GrammarVocab::new(tokens, &[300]).is_err());
}

#[test]
fn a_clone_walks_on_its_own() {
    let grammar = compile("choice", r#"["ab", "ac"]"#);
    let mut a = grammar.matcher();
    a.consume(b'a' as u32).unwrap();
    let mut b = a.clone();
    a.consume(b'b' as u32).unwrap();
    assert!(a.is_stopped());
    assert!(!b.is_stopped());
    assert_eq!(mask_of(&mut b), vec![b'b' as u32, b'c' as u32]);
    b.consume(b'c' as u32).unwrap();
    assert!(b.is_stopped());
}

#[test]
fn a_rejected_token_is_an_error_and_the_mask_falls_back_to_eos() {
    let mut m = compile("regex", "a+").matcher();
    assert!(m.consume(b'z' as u32).is_err());
    assert!(m.error().is_some());
    let mut out = vec![0u32; words(VOCAB)];
    assert!(m.fill_mask(&mut out).is_err());
    assert_eq!(allowed(&out), vec![EOS]);
}

#[test]
fn fill_bitmasks_fills_every_row_in_parallel_or_not() {
    let grammar = compile("regex", "b");
    let w = words(VOCAB);
    for n in [1, 2, 6] {
        let mut matchers: Vec<GrammarMatcher> = (0..n).map(|_| grammar.matcher()).collect();
        let mut rows: Vec<Option<&mut GrammarMatcher>> = matchers.iter_mut().map(Some).collect();
        rows.push(None);
        let mut out = vec![0u32; (n + 1) * w];
        assert_eq!(fill_bitmasks(rows, &mut out, w), n);
        for row in out.chunks(w).take(n) {
            assert_eq!(allowed(row), vec![b'b' as u32]);
        }
        assert!(out[n * w..].iter().all(|&x| x == u32::MAX));
    }
}

// ---- the scheduler carrying matchers ---------------------------------------

fn scheduler(num_blocks: usize, max_model_len: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len,
        eos_token_ids: vec![EOS],
        ..SchedulerConfig::default()
    })
    .unwrap()
}

fn params(n: u32, max_tokens: u32) -> RequestParams {
    RequestParams {
        n,
        max_tokens,
        ..RequestParams::default()
    }
}

type Outputs = HashMap<(u64, u32), (Vec<u32>, Option<FinishReason>)>;

/// Run to completion; each sampled row draws uniformly among the tokens its
/// mask allows (all tokens but EOS for an unconstrained row).
fn run_masked(sched: &mut Scheduler, seed: u64) -> (Outputs, usize) {
    let mut rng = SplitMix64::new(seed);
    let mut out = Outputs::new();
    let mut events: Vec<TokenEvent> = Vec::new();
    let w = words(VOCAB);
    let mut steps = 0;
    while sched.has_unfinished_requests() {
        let rows = sched.schedule().unwrap().num_sampled();
        let mut masks = vec![0u32; rows * w];
        sched.fill_token_bitmask(&mut masks, w).unwrap();
        let sampled: Vec<i64> = masks
            .chunks(w)
            .map(|row| {
                let unconstrained = row.iter().all(|&x| x == u32::MAX);
                let options: Vec<u32> = allowed(row)
                    .into_iter()
                    .filter(|&t| !unconstrained || t < EOS)
                    .collect();
                options[rng.below(options.len())] as i64
            })
            .collect();
        events.clear();
        sched.update(&sampled, &mut events).unwrap();
        for e in &events {
            let entry = out.entry((e.request, e.sample_index)).or_default();
            entry.0.push(e.token);
            entry.1 = e.finish;
        }
        sched.check_invariants().unwrap();
        steps += 1;
        assert!(steps < 10_000);
    }
    (out, steps)
}

fn text(tokens: &[u32]) -> String {
    String::from_utf8(
        tokens
            .iter()
            .filter(|&&t| t != EOS)
            .flat_map(|&t| token_bytes(t))
            .collect(),
    )
    .unwrap()
}

#[test]
fn scheduler_finishes_a_complete_grammar_with_stop() {
    let grammar = compile("choice", r#"["alpha", "beta"]"#);
    let mut sched = scheduler(64, 128);
    let h = sched
        .add_request(&[1, 2, 3], params(1, 50), 0, None)
        .unwrap();
    sched.set_grammar(h, &grammar).unwrap();
    let free = sched.add_request(&[4, 5], params(1, 3), 0, None).unwrap();
    let (out, _) = run_masked(&mut sched, 1);
    let (tokens, finish) = &out[&(h, 0)];
    assert!(["alpha", "beta"].contains(&text(tokens).as_str()));
    assert_eq!(*finish, Some(FinishReason::Stop));
    assert_eq!(out[&(free, 0)].1, Some(FinishReason::Length));
}

#[test]
fn forked_samples_each_follow_the_grammar_on_their_own() {
    let grammar = compile("regex", "(ab|cd)(ef|gh)");
    let mut sched = scheduler(64, 128);
    let h = sched
        .add_request(&[1, 2, 3, 4, 5], params(6, 20), 0, None)
        .unwrap();
    sched.set_grammar(h, &grammar).unwrap();
    let (out, _) = run_masked(&mut sched, 11);
    let texts: Vec<String> = (0..6).map(|i| text(&out[&(h, i)].0)).collect();
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t.len(), 4, "{t}");
        assert!(["ab", "cd"].contains(&&t[..2]) && ["ef", "gh"].contains(&&t[2..]));
        assert_eq!(out[&(h, i as u32)].1, Some(FinishReason::Stop));
    }
    let distinct: std::collections::HashSet<_> = texts.iter().collect();
    assert!(distinct.len() > 1, "samples diverge: {texts:?}");
}

#[test]
fn preempted_constrained_sequences_resume_their_grammar() {
    // 12 blocks of 4 tokens for 6 requests of up to 40 tokens: preemption.
    let grammar = compile("regex", "[a-c]{25}");
    let mut sched = scheduler(12, 48);
    let mut handles = Vec::new();
    for i in 0..6 {
        let h = sched
            .add_request(&[10 + i, 11, 12, 13, 14, 15], params(1, 40), 0, None)
            .unwrap();
        sched.set_grammar(h, &grammar).unwrap();
        handles.push(h);
    }
    let (out, _) = run_masked(&mut sched, 5);
    assert!(
        sched.stats.num_preemptions > 0,
        "the pool is meant to overflow"
    );
    for h in handles {
        let (tokens, finish) = &out[&(h, 0)];
        let t = text(tokens);
        assert_eq!(t.len(), 25, "{t}");
        assert!(t.bytes().all(|b| (b'a'..=b'c').contains(&b)));
        assert_eq!(*finish, Some(FinishReason::Stop));
    }
}

#[test]
fn a_token_outside_the_mask_finishes_with_error() {
    let grammar = compile("regex", "x+");
    let mut sched = scheduler(64, 128);
    let h = sched.add_request(&[1, 2], params(1, 10), 0, None).unwrap();
    sched.set_grammar(h, &grammar).unwrap();
    sched.schedule().unwrap();
    let mut events = Vec::new();
    sched.update(&[b'y' as i64], &mut events).unwrap();
    assert_eq!(events[0].finish, Some(FinishReason::Error));
    sched.check_invariants().unwrap();
}

#[test]
fn set_grammar_refuses_a_scheduled_request_and_fill_needs_a_plan() {
    let grammar = compile("regex", "x");
    let mut sched = scheduler(64, 128);
    let mut masks = vec![0u32; words(VOCAB)];
    assert!(sched.fill_token_bitmask(&mut masks, words(VOCAB)).is_err());
    let h = sched.add_request(&[1, 2], params(1, 10), 0, None).unwrap();
    sched.schedule().unwrap();
    assert!(sched.set_grammar(h, &grammar).is_err());
    assert!(sched
        .fill_token_bitmask(&mut masks[..1], words(VOCAB))
        .is_err());
    assert_eq!(
        sched.fill_token_bitmask(&mut masks, words(VOCAB)).unwrap(),
        0
    );
    assert!(masks.iter().all(|&x| x == u32::MAX));
}
