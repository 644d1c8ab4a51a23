//! Criterion benches of structured outputs (`rust/grammar/structured_output.rs`): the
//! host cost per constrained sequence per step (compute the token mask, then
//! consume the sampled token) along a walk through a JSON schema, and the
//! masks of a 64-row step in one `fill_bitmasks` call.
//!
//! The vocabulary is synthetic (49,152 byte-level tokens shaped like a BPE
//! vocabulary: bytes, words with and without a leading space, digit runs,
//! JSON punctuation) unless `KVPAGE_BENCH_TOKENIZER_JSON` names a Hugging
//! Face tokenizer.json (e.g. SmolLM2's). Run:
//! `cargo bench --bench structured_output`. Figures go to benches/RESULTS.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvpage_core::grammar::structured_output::{
    fill_bitmasks, words, Grammar, GrammarMatcher, GrammarVocab, GuidedSpec,
};

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops", "qa"]},
                 "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": false},
        "score": {"type": "number", "minimum": 0, "maximum": 1}
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": false
}"#;

struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// (token bytes, EOS ids): a real tokenizer.json, or the synthetic vocabulary.
fn vocabulary() -> (Vec<Vec<u8>>, Vec<u32>) {
    if let Ok(path) = std::env::var("KVPAGE_BENCH_TOKENIZER_JSON") {
        let text = std::fs::read_to_string(&path).expect("read the tokenizer.json");
        let json: serde_json::Value = serde_json::from_str(&text).expect("tokenizer.json");
        let tokens = llguidance::token_bytes_from_tokenizer_json(&json).expect("token bytes");
        let eos = tokens
            .iter()
            .position(|t| t == b"\xff<|endoftext|>" || t == b"\xff</s>" || t == b"\xff<|im_end|>")
            .unwrap_or(0) as u32;
        return (tokens, vec![eos]);
    }
    let mut rng = Lcg(42);
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    for p in [
        "{\"", "\":", "\": ", "\",", "\", \"", "\"}", "}}", "[\"", "\"]", "true", "false", "null",
    ] {
        tokens.push(p.as_bytes().to_vec());
    }
    let letters = b"etaoinshrdlucmfwypvbgkjqxz";
    let mut seen = std::collections::HashSet::new();
    while tokens.len() < 49_151 {
        let mut t = Vec::new();
        match rng.below(10) {
            0 => (0..1 + rng.below(3)).for_each(|_| t.push(b'0' + rng.below(10) as u8)),
            1..=5 => t.push(b' '),
            _ => {}
        }
        for _ in 0..1 + rng.below(8) {
            // skewed towards frequent letters
            t.push(letters[rng.below(letters.len()).min(rng.below(letters.len()))]);
        }
        if seen.insert(t.clone()) {
            tokens.push(t);
        }
    }
    tokens.push(b"\xff<|endoftext|>".to_vec());
    let eos = tokens.len() as u32 - 1;
    (tokens, vec![eos])
}

/// A valid walk through the grammar: uniformly random allowed tokens (EOS
/// excluded until nothing else is allowed).
fn walk(grammar: &Grammar, eos: u32, seed: u64) -> Vec<u32> {
    let mut rng = Lcg(seed);
    let mut m = grammar.matcher();
    let w = words(m.vocab_size());
    let mut mask = vec![0u32; w];
    let mut path = Vec::new();
    while !m.is_stopped() && path.len() < 400 {
        m.fill_mask(&mut mask).unwrap();
        let allowed: Vec<u32> = (0..m.vocab_size() as u32)
            .filter(|&t| t != eos && mask[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect();
        let token = if allowed.is_empty() {
            eos
        } else {
            allowed[rng.below(allowed.len())]
        };
        m.consume(token).unwrap();
        path.push(token);
    }
    path
}

/// One constrained sequence's host work per step, over a whole walk.
fn run_walk(m: &mut GrammarMatcher, path: &[u32], mask: &mut [u32]) {
    for &t in path {
        m.fill_mask(mask).unwrap();
        m.consume(black_box(t)).unwrap();
    }
}

fn structured(c: &mut Criterion) {
    let (tokens, eos) = vocabulary();
    let vocab = GrammarVocab::new(tokens, &eos).unwrap();
    let grammar = vocab
        .compile(&GuidedSpec::Json(SCHEMA.to_string()))
        .unwrap();
    let path = walk(&grammar, eos[0], 7);
    let w = vocab.words();
    eprintln!(
        "structured_output bench: vocab {} tokens, walk of {} tokens",
        vocab.vocab_size(),
        path.len()
    );

    let mut group = c.benchmark_group("structured_output");
    group.throughput(Throughput::Elements(path.len() as u64));
    group.measurement_time(Duration::from_secs(8));
    group.bench_function("compile/json_schema", |b| {
        b.iter(|| {
            vocab
                .compile(&GuidedSpec::Json(SCHEMA.to_string()))
                .unwrap()
        })
    });
    let mut mask = vec![0u32; w];
    // A new request: its own lexer caches, filled along the walk.
    group.bench_function("mask_and_consume_per_token/cold", |b| {
        b.iter_batched(
            || grammar.matcher(),
            |mut m| run_walk(&mut m, &path, &mut mask),
            BatchSize::SmallInput,
        )
    });
    // A request whose lexer caches already hold this walk's states (a long
    // generation, or a clone of a warmed matcher, as n > 1 forks are).
    let warm = grammar.matcher();
    run_walk(&mut warm.clone(), &path, &mut mask);
    group.bench_function("mask_and_consume_per_token/warm", |b| {
        b.iter_batched(
            || warm.clone(),
            |mut m| run_walk(&mut m, &path, &mut mask),
            BatchSize::SmallInput,
        )
    });

    // 64 sequences at different points of their walks: one step's masks.
    let rows = 64;
    let matchers: Vec<GrammarMatcher> = (0..rows)
        .map(|r| {
            let mut m = grammar.matcher();
            let p = walk(&grammar, eos[0], 100 + r as u64);
            let upto = (r * p.len() / rows).min(p.len().saturating_sub(1));
            for &t in &p[..upto] {
                m.consume(t).unwrap();
            }
            m
        })
        .collect();
    let mut out = vec![0u32; rows * w];
    group.throughput(Throughput::Elements(rows as u64));
    // Fresh clones each iteration: a parser caches the mask of its current
    // state, and a real step always asks in a new state.
    group.bench_function("fill_bitmasks/64_rows", |b| {
        b.iter_batched(
            || matchers.clone(),
            |mut batch| {
                let refs: Vec<Option<&mut GrammarMatcher>> = batch.iter_mut().map(Some).collect();
                fill_bitmasks(refs, &mut out, w)
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, structured);
criterion_main!(benches);
