//! Unit and seeded randomized tests of the output streams, on the byte-level
//! BPE tokenizer of the detokenizer's tests (ids 0..=255 are bytes).

use super::*;
use crate::output::detokenizer::tests::{byte_level_tokenizer, SPACE_EMOJI_START};
use crate::test_rng::SplitMix64;

const HELLO: u32 = 256; // " hello"
const WORLD: u32 = 257; // " world"

fn decoder() -> Arc<TokenDecoder> {
    Arc::new(TokenDecoder::new(byte_level_tokenizer()))
}

fn spec(stops: &[&str]) -> TextSpec {
    TextSpec {
        decoder: decoder(),
        prompt_token_ids: vec![b'A' as u32],
        stops: stops.iter().map(|s| s.to_string()).collect(),
        include_stop: false,
        skip_special: true,
        stop_token_ids: Vec::new(),
    }
}

/// Push one event per `(handle, sample, token, finish code)`, logprob -0.5 each.
fn push(streams: &mut OutputStreams, events: &[(u64, u32, u32, u8)]) -> Vec<bool> {
    push_flagged(streams, events, &vec![false; events.len()])
}

/// [`push`], with each event's "one of the request's stop token ids" flag.
fn push_flagged(
    streams: &mut OutputStreams,
    events: &[(u64, u32, u32, u8)],
    flags: &[bool],
) -> Vec<bool> {
    let handles: Vec<u64> = events.iter().map(|e| e.0).collect();
    let samples: Vec<u32> = events.iter().map(|e| e.1).collect();
    let tokens: Vec<u32> = events.iter().map(|e| e.2).collect();
    let codes: Vec<u8> = events.iter().map(|e| e.3).collect();
    let logprobs = vec![-0.5f32; events.len()];
    let mut accepted = Vec::new();
    streams
        .push(
            PushedTokens {
                handles: &handles,
                sample_indices: &samples,
                tokens: &tokens,
                finish_codes: &codes,
                stop_tokens: flags,
                logprobs: &logprobs,
            },
            1.0,
            0,
            &mut accepted,
        )
        .expect("valid push");
    accepted
}

/// `(handle, done, [(index, text, tokens, finish)])` of every output taken.
type Taken = Vec<(
    u64,
    bool,
    Vec<(u32, String, Vec<u32>, Option<FinishReason>)>,
)>;

fn take(streams: &mut OutputStreams) -> Taken {
    let mut out = Vec::new();
    streams.take_outputs(|view| {
        let samples = view
            .samples
            .iter()
            .map(|s| (s.index, s.text.to_owned(), s.tokens.to_vec(), s.finish))
            .collect();
        out.push((view.handle, view.done, samples));
    });
    out
}

const LENGTH: u8 = FinishReason::Length as u8;
const STOP: u8 = FinishReason::Stop as u8;
const MODES: [OutputMode; 3] = [
    OutputMode::Delta,
    OutputMode::Cumulative,
    OutputMode::FinalOnly,
];

/// What a client holds of each request: `(text, tokens, finish)`.
type Clients = HashMap<u64, (String, Vec<u32>, Option<FinishReason>)>;

/// Detokenize and take the outputs into `seen`, as a client reassembles them
/// (deltas joined, cumulative outputs replacing the last).
fn drain(streams: &mut OutputStreams, seen: &mut Clients) {
    streams.detokenize();
    streams.take_outputs(|view| {
        let client = seen.entry(view.handle).or_default();
        for s in &view.samples {
            if s.token_start == 0 {
                client.0.clear();
                client.1.clear();
            }
            client.0.push_str(s.text);
            client.1.extend_from_slice(s.tokens);
            client.2 = s.finish;
        }
    });
}

#[test]
fn delta_outputs_carry_new_text_and_tokens_and_hold_back_split_characters() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(7, 1, OutputMode::Delta, false, Some(spec(&[])))
        .unwrap();
    push(&mut streams, &[(7, 0, HELLO, 0)]);
    assert!(streams.detokenize().is_empty());
    assert_eq!(
        take(&mut streams),
        vec![(7, false, vec![(0, " hello".into(), vec![HELLO], None)])]
    );
    // "é" is two byte tokens: no text until both are in.
    push(&mut streams, &[(7, 0, 0xC3, 0)]);
    streams.detokenize();
    assert_eq!(
        take(&mut streams),
        vec![(7, false, vec![(0, String::new(), vec![0xC3], None)])]
    );
    push(&mut streams, &[(7, 0, 0xA9, LENGTH)]);
    streams.detokenize();
    let last = take(&mut streams);
    assert_eq!(
        last,
        vec![(
            7,
            true,
            vec![(0, "é".into(), vec![0xA9], Some(FinishReason::Length))]
        )]
    );
    assert!(
        streams.is_empty(),
        "a done request is dropped after its last output"
    );
    assert!(take(&mut streams).is_empty());
}

#[test]
fn a_stop_string_cuts_text_and_tokens_and_is_reported_once() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(1, 1, OutputMode::Cumulative, false, Some(spec(&[" wor"])))
        .unwrap();
    // Three tokens in one step (as after a scheduler catch-up): the stop string
    // ends in the second; the third is dropped.
    push(
        &mut streams,
        &[(1, 0, HELLO, 0), (1, 0, WORLD, 0), (1, 0, HELLO, 0)],
    );
    assert_eq!(streams.detokenize(), vec![(1, 0)]);
    let sample = streams.get(1).unwrap().samples[0].as_ref().unwrap();
    assert_eq!(sample.stop, Some(StopReason::Text(" wor".into())));
    assert_eq!(
        take(&mut streams),
        vec![(
            1,
            true,
            vec![(
                0,
                " hello".into(),
                vec![HELLO, WORLD],
                Some(FinishReason::Stop)
            )]
        )]
    );
}

#[test]
fn a_finished_sample_takes_no_tokens() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(1, 1, OutputMode::Delta, false, Some(spec(&[" hello"])))
        .unwrap();
    assert_eq!(push(&mut streams, &[(1, 0, HELLO, 0)]), vec![true]);
    assert_eq!(streams.detokenize(), vec![(1, 0)]);
    // The next step was planned before the stop string was found.
    assert_eq!(
        push(&mut streams, &[(1, 0, WORLD, 0), (99, 0, WORLD, 0)]),
        vec![false, false]
    );
    let taken = take(&mut streams);
    assert_eq!(
        taken,
        vec![(
            1,
            true,
            vec![(0, String::new(), vec![HELLO], Some(FinishReason::Stop))]
        )]
    );
}

#[test]
fn a_stop_string_overrides_a_length_finish_without_telling_the_scheduler() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(1, 1, OutputMode::Delta, false, Some(spec(&[" world"])))
        .unwrap();
    push(&mut streams, &[(1, 0, WORLD, LENGTH)]);
    assert!(
        streams.detokenize().is_empty(),
        "the scheduler already finished it"
    );
    let taken = take(&mut streams);
    assert_eq!(
        taken,
        vec![(
            1,
            true,
            vec![(0, String::new(), vec![WORLD], Some(FinishReason::Stop))]
        )]
    );
}

#[test]
fn final_only_requests_hand_out_one_output_when_every_sample_is_done() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(3, 2, OutputMode::FinalOnly, false, Some(spec(&[])))
        .unwrap();
    push(&mut streams, &[(3, 0, HELLO, 0), (3, 1, WORLD, 0)]);
    streams.detokenize();
    assert!(take(&mut streams).is_empty());
    push(&mut streams, &[(3, 0, WORLD, LENGTH), (3, 1, HELLO, 0)]);
    streams.detokenize();
    assert!(take(&mut streams).is_empty(), "sample 1 still runs");
    push(&mut streams, &[(3, 1, HELLO, LENGTH)]);
    streams.detokenize();
    let taken = take(&mut streams);
    assert_eq!(taken.len(), 1);
    let (_, done, samples) = &taken[0];
    assert!(*done);
    assert_eq!(samples[0].1, " hello world");
    assert_eq!(samples[1].1, " world hello hello");
    assert_eq!(samples[1].2, vec![WORLD, HELLO, HELLO]);
}

#[test]
fn finishing_a_request_closes_it_even_with_samples_not_started() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(5, 3, OutputMode::Delta, false, Some(spec(&["zz"])))
        .unwrap();
    push(&mut streams, &[(5, 0, HELLO, 0)]);
    assert!(streams.finish_request(5, FinishReason::Abort));
    let view = streams
        .take_request(5, |v| {
            let s = &v.samples[0];
            (v.done, v.samples.len(), s.text.to_owned(), s.finish)
        })
        .unwrap();
    // The held-back tail (a stop string could start there) comes out at the end,
    // and the samples that never started end too.
    assert_eq!(
        view,
        (true, 3, " hello".to_owned(), Some(FinishReason::Abort))
    );
    assert!(streams.is_empty());
    assert!(!streams.finish_request(5, FinishReason::Abort));
    assert!(
        take(&mut streams).is_empty(),
        "taken at once, not again in the bulk"
    );
}

#[test]
fn without_a_decoder_tokens_stream_and_text_is_empty() {
    let mut streams = OutputStreams::new();
    streams
        .add_request(2, 1, OutputMode::Delta, false, None)
        .unwrap();
    push(&mut streams, &[(2, 0, 11, 0)]);
    push(&mut streams, &[(2, 0, 12, 0)]);
    streams.detokenize();
    assert_eq!(
        take(&mut streams),
        vec![(2, false, vec![(0, String::new(), vec![11, 12], None)])]
    );
}

#[test]
fn bad_input_is_refused_with_a_message() {
    let mut streams = OutputStreams::new();
    assert!(streams
        .add_request(1, 0, OutputMode::Delta, false, None)
        .is_err());
    streams
        .add_request(1, 1, OutputMode::Delta, false, None)
        .unwrap();
    assert!(streams
        .add_request(1, 1, OutputMode::Delta, false, None)
        .unwrap_err()
        .contains("already"));
    assert!(streams
        .add_request(2, 1, OutputMode::Delta, false, Some(spec(&[""])))
        .is_err());
    let mut accepted = Vec::new();
    let err = streams
        .push(
            PushedTokens {
                handles: &[1],
                sample_indices: &[0],
                tokens: &[],
                finish_codes: &[0],
                stop_tokens: &[false],
                logprobs: &[0.0],
            },
            0.0,
            0,
            &mut accepted,
        )
        .unwrap_err();
    assert!(err.contains("one sample index, token"), "{err}");
    let sample_err = std::panic::catch_unwind(|| ()).map(|_| {
        let mut s = OutputStreams::new();
        s.add_request(1, 1, OutputMode::Delta, false, None).unwrap();
        let mut a = Vec::new();
        s.push(
            PushedTokens {
                handles: &[1],
                sample_indices: &[4],
                tokens: &[1],
                finish_codes: &[0],
                stop_tokens: &[false],
                logprobs: &[0.0],
            },
            0.0,
            0,
            &mut a,
        )
        .unwrap_err()
    });
    assert!(sample_err.unwrap().contains("out of range"));
}

/// Random requests, modes, chunkings and stops: what the outputs hand out,
/// joined, equals one detokenizer fed the same tokens, and invariants hold.
#[test]
fn randomized_streams_match_a_plain_detokenizer() {
    let decoder = decoder();
    let all_stops = ["lo w", "é!"];
    let vocab = [HELLO, WORLD, 0xC3, 0xA9, b'!' as u32, b'o' as u32];
    let modes = [
        OutputMode::Delta,
        OutputMode::Cumulative,
        OutputMode::FinalOnly,
    ];
    for seed in 0..60u64 {
        let mut rng = SplitMix64::new(seed);
        let mut streams = OutputStreams::new();
        let num_requests = 1 + rng.below(5);
        let mut planned: Vec<(Vec<u32>, Vec<String>)> = Vec::new();
        for h in 0..num_requests {
            let stops: Vec<String> = all_stops[..rng.below(3)]
                .iter()
                .map(|s| s.to_string())
                .collect();
            let mut s = spec(&[]);
            s.stops = stops.clone();
            s.decoder = Arc::clone(&decoder);
            streams
                .add_request(h as u64, 1, modes[rng.below(3)], false, Some(s))
                .unwrap();
            let len = 1 + rng.below(12);
            planned.push((
                (0..len).map(|_| vocab[rng.below(vocab.len())]).collect(),
                stops,
            ));
        }
        let mut seen = Clients::new();
        let mut pos = vec![0usize; num_requests];
        while !streams.is_empty() {
            let mut events = Vec::new();
            for (h, (tokens, _)) in planned.iter().enumerate() {
                if pos[h] < tokens.len() && rng.below(3) > 0 {
                    let last = pos[h] + 1 == tokens.len();
                    events.push((h as u64, 0, tokens[pos[h]], if last { LENGTH } else { 0 }));
                    pos[h] += 1;
                }
            }
            push(&mut streams, &events);
            if rng.below(2) == 0 {
                drain(&mut streams, &mut seen);
            }
            streams.check_invariants().unwrap();
        }
        for (h, (tokens, stops)) in planned.iter().enumerate() {
            let (text, got, finish) = &seen[&(h as u64)];
            assert!(finish.is_some(), "seed {seed}: request {h} never finished");
            let mut plain = SeqDetokenizer::new(&[b'A' as u32], stops.clone(), false, true);
            let mut scratch = Scratch::default();
            let taken = plain.add_tokens(&decoder, tokens, &mut scratch);
            plain.finish(&decoder, &mut scratch); // the last token finished it
            assert_eq!(text, plain.text(), "seed {seed}: request {h}");
            assert_eq!(got, &tokens[..taken], "seed {seed}: request {h}");
        }
    }
}

#[test]
fn a_sample_ending_mid_character_hands_out_what_decode_gives() {
    let tokenizer = byte_level_tokenizer();
    let ids = vec![HELLO, SPACE_EMOJI_START];
    let want = tokenizer.decode(&ids, true).unwrap();
    assert_eq!(want, " hello \u{FFFD}");
    for mode in MODES {
        let mut streams = OutputStreams::new();
        for handle in [1, 2] {
            streams
                .add_request(handle, 1, mode, false, Some(spec(&[])))
                .unwrap();
        }
        let mut seen = Clients::new();
        push(&mut streams, &[(1, 0, HELLO, 0), (2, 0, HELLO, 0)]);
        drain(&mut streams, &mut seen);
        // Request 1 ends on its length, request 2 is aborted, both with " " and
        // 3 of the 4 bytes of an emoji held back.
        push(
            &mut streams,
            &[
                (1, 0, SPACE_EMOJI_START, LENGTH),
                (2, 0, SPACE_EMOJI_START, 0),
            ],
        );
        assert!(streams.finish_request(2, FinishReason::Abort));
        drain(&mut streams, &mut seen);
        let length = (want.clone(), ids.clone(), Some(FinishReason::Length));
        assert_eq!(seen[&1], length, "{mode:?}");
        let abort = (want.clone(), ids.clone(), Some(FinishReason::Abort));
        assert_eq!(seen[&2], abort, "{mode:?}");
        assert!(streams.is_empty());
    }
}

#[test]
fn the_text_of_a_stop_token_that_finished_a_sample_is_left_out_unless_include_stop() {
    let tokenizer = byte_level_tokenizer();
    let eos = tokenizer.token_to_id("<s>").unwrap(); // a special token, as EOS is
    let decode = |ids: &[u32]| tokenizer.decode(ids, false).unwrap();
    for include_stop in [false, true] {
        // The text of a sample that a stop token finished.
        let stopped = |ids: &[u32]| {
            decode(if include_stop {
                ids
            } else {
                &ids[..ids.len() - 1]
            })
        };
        for mode in MODES {
            let mut streams = OutputStreams::new();
            for handle in 1..=4 {
                let mut s = spec(&[]);
                s.skip_special = false;
                s.include_stop = include_stop;
                s.stop_token_ids = vec![eos, WORLD];
                streams
                    .add_request(handle, 1, mode, false, Some(s))
                    .unwrap();
            }
            let mut seen = Clients::new();
            push(
                &mut streams,
                &[(1, 0, HELLO, 0), (2, 0, HELLO, 0), (3, 0, HELLO, 0)],
            );
            drain(&mut streams, &mut seen);
            push(&mut streams, &[(2, 0, SPACE_EMOJI_START, 0)]);
            drain(&mut streams, &mut seen);
            push_flagged(
                &mut streams,
                &[
                    (1, 0, eos, STOP),   // EOS
                    (2, 0, WORLD, STOP), // a stop token id, after a split character
                    (3, 0, eos, LENGTH), // EOS as the last token of the length
                    (4, 0, HELLO, STOP), // a grammar's end: not a stop token
                ],
                &[false, true, false, false],
            );
            drain(&mut streams, &mut seen);
            assert!(streams.is_empty());
            let case = format!("{mode:?}, include_stop {include_stop}");
            assert_eq!(seen[&1].0, stopped(&[HELLO, eos]), "{case}");
            assert_eq!(
                seen[&1].1,
                [HELLO, eos],
                "the stop token stays in the tokens"
            );
            let ids = [HELLO, SPACE_EMOJI_START, WORLD];
            assert_eq!(seen[&2].0, stopped(&ids), "{case}");
            assert_eq!(seen[&2].1, ids);
            assert_eq!(
                seen[&3].0,
                decode(&[HELLO, eos]),
                "a length finish shows every token"
            );
            assert_eq!(seen[&4].0, " hello", "{case}");
            for (_, _, finish) in seen.values() {
                assert!(finish.is_some());
            }
        }
    }
    assert_eq!(decode(&[HELLO, SPACE_EMOJI_START]), " hello \u{FFFD}");
}
