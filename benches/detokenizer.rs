//! Criterion bench of the Rust detokenizer: one decode step (one new token
//! and one streamed delta per sequence, with a stop string that never
//! matches) for 256, 1024 and 4096 sequences, on the byte-level BPE
//! tokenizer of the model that ships with kvpage.
//! Run: `cargo bench --bench detokenizer`. Figures go to benches/RESULTS.md.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvpage_core::detokenizer::{Scratch, SeqDetokenizer, TokenDecoder};

const TEXT: &str = "The engine schedules one step at a time: finished sequences leave and \
    waiting ones join. Ünïcödé text, émojis 🙂🚀 and 中文字符 must round-trip byte by byte.\n\
    def step(self):\n    plan = self.scheduler.schedule()\n    return plan\n";

fn tokenizer_json() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/python/kvpage/assets/default_model/tokenizer.json"
    );
    std::fs::read_to_string(path).expect("the default model's tokenizer.json")
}

fn detokenize_steps(c: &mut Criterion) {
    let json = tokenizer_json();
    let decoder = TokenDecoder::from_json(&json).unwrap();
    assert!(decoder.is_byte_level());
    let tokenizer: tokenizers::Tokenizer = json.parse().unwrap();
    let cycle = tokenizer.encode(TEXT, false).unwrap().get_ids().to_vec();
    let mut group = c.benchmark_group("detokenize_step");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    for running in [256usize, 1024, 4096] {
        group.bench_function(format!("{running}"), |b| {
            // Fresh sequences every 200 steps keep the texts short; not timed.
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut scratch = Scratch::default();
                let mut done = 0;
                while done < iters {
                    let mut seqs: Vec<SeqDetokenizer> = (0..running)
                        .map(|_| {
                            SeqDetokenizer::new(
                                &cycle[..6],
                                vec!["\n###END###".into()],
                                false,
                                true,
                            )
                        })
                        .collect();
                    let steps = (iters - done).min(200);
                    let start = Instant::now();
                    for step in 0..steps as usize {
                        for (i, seq) in seqs.iter_mut().enumerate() {
                            let token = cycle[(i * 7 + step) % cycle.len()];
                            seq.add_tokens(&decoder, &[token], &mut scratch);
                            std::hint::black_box(seq.take_delta(false));
                        }
                    }
                    total += start.elapsed();
                    done += steps;
                }
                total
            })
        });
    }
    group.finish();
}

criterion_group!(benches, detokenize_steps);
criterion_main!(benches);
