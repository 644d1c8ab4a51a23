//! Criterion bench of the Rust side of the streaming path: one decode step of
//! `OutputStreams` -- `push` (one new token per sequence), `detokenize` (text,
//! with a stop string that never matches) and `take_outputs` (a streamed delta
//! per sequence) -- for 256, 1024 and 4096 sequences, on the byte-level BPE
//! tokenizer of the model that ships with kvpage.
//! Run: `cargo bench --bench output_streams`. Figures go to benches/RESULTS.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvpage_core::output::detokenizer::TokenDecoder;
use kvpage_core::output::output_streams::{OutputMode, OutputStreams, PushedTokens, TextSpec};
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

fn output_stream_steps(c: &mut Criterion) {
    let json = tokenizer_json();
    let decoder = Arc::new(TokenDecoder::from_json(&json).unwrap());
    assert!(decoder.is_byte_level());
    let tokenizer: tokenizers::Tokenizer = json.parse().unwrap();
    let cycle = tokenizer.encode(TEXT, false).unwrap().get_ids().to_vec();
    let mut group = c.benchmark_group("output_streams_step");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    for running in [256usize, 1024, 4096] {
        group.bench_function(format!("{running}"), |b| {
            let handles: Vec<u64> = (0..running as u64).collect();
            let zeros = vec![0u32; running];
            let codes = vec![0u8; running];
            let flags = vec![false; running];
            let logprobs = vec![-0.5f32; running];
            // Fresh streams every 200 steps keep the texts short; not timed.
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut done = 0;
                let mut accepted = Vec::new();
                while done < iters {
                    let mut streams = OutputStreams::new();
                    for &h in &handles {
                        let text = TextSpec {
                            decoder: Arc::clone(&decoder),
                            prompt_token_ids: cycle[..6].to_vec(),
                            stops: vec!["\n###END###".into()],
                            include_stop: false,
                            skip_special: true,
                            stop_token_ids: vec![0],
                        };
                        streams
                            .add_request(h, 1, OutputMode::Delta, false, Some(text))
                            .unwrap();
                    }
                    let steps = (iters - done).min(200);
                    let mut tokens = vec![0u32; running];
                    let start = Instant::now();
                    for step in 0..steps as usize {
                        for (i, token) in tokens.iter_mut().enumerate() {
                            *token = cycle[(i * 7 + step) % cycle.len()];
                        }
                        let pushed = PushedTokens {
                            handles: &handles,
                            sample_indices: &zeros,
                            tokens: &tokens,
                            finish_codes: &codes,
                            stop_tokens: &flags,
                            logprobs: &logprobs,
                        };
                        streams.push(pushed, 0.0, 0, &mut accepted).unwrap();
                        std::hint::black_box(streams.detokenize());
                        streams.take_outputs(|view| {
                            std::hint::black_box(view.samples[0].text);
                        });
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

criterion_group!(benches, output_stream_steps);
criterion_main!(benches);
