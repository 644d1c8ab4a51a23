//! Output streams: what the engine's caller sees of each sample.
//!
//! The scheduler owns the sequence being generated (its tokens drive the KV
//! cache, stop tokens and lengths). An output stream owns what is handed
//! out: the generated tokens (cut at a stop string), their text
//! (incremental detokenization with stop strings, [`crate::output::detokenizer`]),
//! the cumulative logprob, the finish and stop reasons, which weights version
//! produced which tokens, the request's token times, and how much of all this
//! was already handed out. The engine drives every stream with three bulk calls
//! per step, so no token passes through Python one at a time:
//!
//! 1. [`OutputStreams::push`]: the step's sampled tokens (the scheduler's
//!    `update` events), appended with their finish reasons;
//! 2. [`OutputStreams::detokenize`]: the text of every pending token, and the
//!    stop strings it contains; returns the samples a stop string finished
//!    (the engine tells the scheduler). A finished sample's text is what
//!    `decode` gives for its tokens, an incomplete last character included
//!    (as U+FFFD); as in vLLM, the text of a stop token that finished it (EOS
//!    or a stop token id: [`TextSpec::stop_token_ids`]) is left out unless
//!    `include_stop` (its id stays in the tokens);
//! 3. [`OutputStreams::take_outputs`]: what is new, request by request, in the
//!    request's [`OutputMode`]; a request whose every sample finished is
//!    handed out one last time and dropped.
//!
//! A request whose text is made elsewhere (no decoder) still streams tokens.
//!
//! Invariants (checked by [`OutputStreams::check_invariants`], in debug builds
//! after every bulk call):
//! - per sample, `sent_tokens <= fed <= tokens.len()`; `fed == tokens.len()`
//!   once a stop string matched, and without a decoder;
//! - `stop_token_hidden` only on a finished sample;
//! - a finished sample takes no more tokens;
//! - `num_finished` counts the request's samples with a finish reason;
//! - `dirty` lists live requests, each once, exactly those with `dirty` set.

use std::collections::HashMap;
use std::sync::Arc;

use crate::output::detokenizer::{Scratch, SeqDetokenizer, TokenDecoder};
use crate::sched::request::FinishReason;

/// What a request's outputs carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputMode {
    /// Each output holds what is new since the last (streaming).
    Delta,
    /// Each output holds everything so far.
    Cumulative,
    /// One output, when the request finishes.
    FinalOnly,
}

/// Why a sample stopped early, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// One of the request's stop token ids (EOS is not reported).
    Token(u32),
    /// The stop string that matched.
    Text(String),
}

/// How a request's samples become text.
#[derive(Debug, Clone)]
pub struct TextSpec {
    pub decoder: Arc<TokenDecoder>,
    pub prompt_token_ids: Vec<u32>,
    pub stops: Vec<String>,
    /// Keep the text of a stop string, or of a stop token, that ended a sample.
    pub include_stop: bool,
    pub skip_special: bool,
    /// The stop tokens (EOS and the request's stop token ids): a sample that
    /// finishes with `Stop` on one shows no text for it unless `include_stop`.
    pub stop_token_ids: Vec<u32>,
}

/// One sample's stream.
#[derive(Debug)]
pub struct SampleStream {
    pub tokens: Vec<u32>,
    /// Tokens given to `text` (all of them without a decoder; a hidden stop
    /// token counts as given).
    pub fed: usize,
    pub text: Option<SeqDetokenizer>,
    pub sent_tokens: usize,
    pub cumulative_logprob: f64,
    pub finish: Option<FinishReason>,
    pub stop: Option<StopReason>,
    /// `(index of the first token, weights version)` for each run of tokens.
    pub versions: Vec<(u32, u32)>,
    /// The last token is a stop token that finished the sample, and its text
    /// is left out (see [`TextSpec::stop_token_ids`]).
    pub stop_token_hidden: bool,
}

impl SampleStream {
    fn new(text: Option<&TextSpec>) -> Self {
        SampleStream {
            tokens: Vec::new(),
            fed: 0,
            text: text.map(|spec| {
                SeqDetokenizer::new(
                    &spec.prompt_token_ids,
                    spec.stops.clone(),
                    spec.include_stop,
                    spec.skip_special,
                )
            }),
            sent_tokens: 0,
            cumulative_logprob: 0.0,
            finish: None,
            stop: None,
            versions: Vec::new(),
            stop_token_hidden: false,
        }
    }
}

/// One request's streams.
#[derive(Debug)]
pub struct RequestStreams {
    pub mode: OutputMode,
    /// Outputs carry the cumulative logprob (the request asked for logprobs).
    pub report_logprob: bool,
    text: Option<TextSpec>,
    /// By sample index; a sample appears with its first token.
    pub samples: Vec<Option<SampleStream>>,
    pub num_finished: usize,
    /// Ended from outside (abort, error): done even if samples never started.
    pub closed: bool,
    pub first_token_time: Option<f64>,
    pub last_token_time: Option<f64>,
    dirty: bool,
}

impl RequestStreams {
    /// Every sample finished, or the request was closed.
    pub fn done(&self) -> bool {
        self.closed || self.num_finished == self.samples.len()
    }
}

/// What one sample hands out in one output.
#[derive(Debug, PartialEq)]
pub struct SampleOutput<'a> {
    pub index: u32,
    pub text: &'a str,
    pub tokens: &'a [u32],
    /// Index of `tokens[0]` among the sample's tokens.
    pub token_start: usize,
    pub cumulative_logprob: f64,
    pub finish: Option<FinishReason>,
    pub stop: Option<&'a StopReason>,
    pub versions: &'a [(u32, u32)],
}

/// What one request hands out in one output.
#[derive(Debug, PartialEq)]
pub struct RequestOutputView<'a> {
    pub handle: u64,
    pub done: bool,
    pub first_token_time: Option<f64>,
    pub last_token_time: Option<f64>,
    pub samples: Vec<SampleOutput<'a>>,
    /// Whether `cumulative_logprob` is to be reported.
    pub report_logprob: bool,
}

/// A step's sampled tokens, one entry per `update` event.
#[derive(Debug, Clone, Copy)]
pub struct PushedTokens<'a> {
    pub handles: &'a [u64],
    pub sample_indices: &'a [u32],
    pub tokens: &'a [u32],
    /// 0 while running, else a [`FinishReason`] code.
    pub finish_codes: &'a [u8],
    /// The token is one of the request's stop token ids (its stop reason).
    pub stop_tokens: &'a [bool],
    pub logprobs: &'a [f32],
}

/// Every live request's output streams.
#[derive(Debug, Default)]
pub struct OutputStreams {
    requests: HashMap<u64, RequestStreams>,
    dirty: Vec<u64>,
    scratch: Scratch,
}

fn finish_from_code(code: u8) -> Result<Option<FinishReason>, String> {
    if code == 0 {
        return Ok(None);
    }
    FinishReason::ALL
        .iter()
        .copied()
        .find(|r| *r as u8 == code)
        .map(Some)
        .ok_or_else(|| format!("unknown finish code {code}"))
}

impl OutputStreams {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    pub fn get(&self, handle: u64) -> Option<&RequestStreams> {
        self.requests.get(&handle)
    }

    /// Start streaming a request of `n` samples. Err if the handle is live.
    pub fn add_request(
        &mut self,
        handle: u64,
        n: u32,
        mode: OutputMode,
        report_logprob: bool,
        text: Option<TextSpec>,
    ) -> Result<(), String> {
        if n == 0 {
            return Err("a request needs at least one sample".into());
        }
        if self.requests.contains_key(&handle) {
            return Err(format!(
                "request handle {handle} already has output streams"
            ));
        }
        if let Some(spec) = &text {
            if spec.stops.iter().any(String::is_empty) {
                return Err("stop strings must not be empty".into());
            }
        }
        let samples = (0..n).map(|_| None).collect();
        self.requests.insert(
            handle,
            RequestStreams {
                mode,
                report_logprob,
                text,
                samples,
                num_finished: 0,
                closed: false,
                first_token_time: None,
                last_token_time: None,
                dirty: false,
            },
        );
        Ok(())
    }

    fn mark_dirty(dirty: &mut Vec<u64>, handle: u64, request: &mut RequestStreams) {
        if !request.dirty {
            request.dirty = true;
            dirty.push(handle);
        }
    }

    /// Append a step's sampled tokens. `accepted[i]` tells whether entry `i`
    /// was taken: not for a request without streams, nor for a sample that
    /// already finished (a stop string found after the step was planned).
    pub fn push(
        &mut self,
        step: PushedTokens<'_>,
        now: f64,
        version: u32,
        accepted: &mut Vec<bool>,
    ) -> Result<(), String> {
        let n = step.handles.len();
        let lens = [
            step.sample_indices.len(),
            step.tokens.len(),
            step.finish_codes.len(),
            step.stop_tokens.len(),
            step.logprobs.len(),
        ];
        if lens.iter().any(|&len| len != n) {
            return Err(format!(
                "push needs one sample index, token, finish code, stop flag and logprob per \
                 handle: {n} handles, lengths {lens:?}"
            ));
        }
        let codes = step
            .finish_codes
            .iter()
            .map(|&c| finish_from_code(c))
            .collect::<Result<Vec<_>, _>>()?;
        accepted.clear();
        accepted.reserve(n);
        for (i, &code) in codes.iter().enumerate() {
            let Some(request) = self.requests.get_mut(&step.handles[i]) else {
                accepted.push(false);
                continue;
            };
            let index = step.sample_indices[i] as usize;
            let Some(entry) = request.samples.get_mut(index) else {
                return Err(format!(
                    "sample index {index} of request {} is out of range (n = {})",
                    step.handles[i],
                    request.samples.len()
                ));
            };
            let sample = entry.get_or_insert_with(|| SampleStream::new(request.text.as_ref()));
            if sample.finish.is_some() {
                accepted.push(false);
                continue;
            }
            accepted.push(true);
            let token = step.tokens[i];
            if sample.versions.last().is_none_or(|&(_, v)| v != version) {
                sample.versions.push((sample.tokens.len() as u32, version));
            }
            sample.tokens.push(token);
            if sample.text.is_none() {
                sample.fed = sample.tokens.len();
            }
            sample.cumulative_logprob += f64::from(step.logprobs[i]);
            if let Some(reason) = code {
                sample.finish = Some(reason);
                if step.stop_tokens[i] {
                    sample.stop = Some(StopReason::Token(token));
                }
                sample.stop_token_hidden = reason == FinishReason::Stop
                    && request
                        .text
                        .as_ref()
                        .is_some_and(|t| !t.include_stop && t.stop_token_ids.contains(&token));
                request.num_finished += 1;
            }
            request.first_token_time.get_or_insert(now);
            request.last_token_time = Some(now);
            Self::mark_dirty(&mut self.dirty, step.handles[i], request);
        }
        self.debug_check();
        Ok(())
    }

    /// Make the text of every pending token of the dirty requests, and of a
    /// finished sample the text held back (an incomplete last character).
    /// Returns `(handle, sample index)` of each sample a stop string finished
    /// that had not finished otherwise (the scheduler must be told). A stop
    /// string overrides a finish the same tokens gave (length, stop token):
    /// the tokens after it are dropped.
    pub fn detokenize(&mut self) -> Vec<(u64, u32)> {
        let mut stopped = Vec::new();
        for &handle in &self.dirty {
            let request = self
                .requests
                .get_mut(&handle)
                .expect("dirty requests are live");
            Self::detokenize_request(request, handle, &mut self.scratch, &mut stopped);
        }
        self.debug_check();
        stopped
    }

    fn detokenize_request(
        request: &mut RequestStreams,
        handle: u64,
        scratch: &mut Scratch,
        stopped: &mut Vec<(u64, u32)>,
    ) {
        let Some(spec) = &request.text else {
            return;
        };
        for (index, entry) in request.samples.iter_mut().enumerate() {
            let Some(sample) = entry else { continue };
            let Some(text) = sample.text.as_mut() else {
                continue;
            };
            if text.stop_reason().is_some() {
                continue; // stopped in an earlier call
            }
            // A hidden stop token is fed without its text.
            let shown = sample.tokens.len() - usize::from(sample.stop_token_hidden);
            if sample.fed < shown {
                let taken =
                    text.add_tokens(&spec.decoder, &sample.tokens[sample.fed..shown], scratch);
                sample.fed += taken;
            }
            if sample.finish.is_some() && text.stop_reason().is_none() {
                sample.fed = sample.tokens.len();
                text.finish(&spec.decoder, scratch);
            }
            let Some(stop) = text.stop_reason() else {
                continue;
            };
            if sample.fed < sample.tokens.len() {
                sample.stop_token_hidden = false; // dropped with the tokens after the stop
            }
            sample.tokens.truncate(sample.fed);
            sample
                .versions
                .retain(|&(start, _)| (start as usize) < sample.fed);
            if sample.finish.is_none() {
                request.num_finished += 1;
                stopped.push((handle, index as u32));
            }
            sample.finish = Some(FinishReason::Stop);
            sample.stop = Some(StopReason::Text(stop.to_owned()));
        }
    }

    /// End a request from outside (abort, error): every unfinished sample gets
    /// `reason` (samples that never started too: the last output has all `n`),
    /// pending text is made (a stop string it contains still wins), and the
    /// next output is its last. False if the handle has no streams.
    pub fn finish_request(&mut self, handle: u64, reason: FinishReason) -> bool {
        let Some(request) = self.requests.get_mut(&handle) else {
            return false;
        };
        for entry in request.samples.iter_mut() {
            let sample = entry.get_or_insert_with(|| SampleStream::new(request.text.as_ref()));
            if sample.finish.is_none() {
                sample.finish = Some(reason);
                request.num_finished += 1;
            }
        }
        Self::detokenize_request(request, handle, &mut self.scratch, &mut Vec::new());
        request.closed = true;
        Self::mark_dirty(&mut self.dirty, handle, request);
        self.debug_check();
        true
    }

    /// Hand out what is new for every request with new tokens or a new finish
    /// (none for a `FinalOnly` request before it is done). `visit` sees each
    /// request's output; requests that are done are dropped after it.
    pub fn take_outputs(&mut self, mut visit: impl FnMut(RequestOutputView<'_>)) {
        let dirty = std::mem::take(&mut self.dirty);
        for handle in dirty {
            let request = self
                .requests
                .get_mut(&handle)
                .expect("dirty requests are live");
            request.dirty = false;
            if request.mode == OutputMode::FinalOnly && !request.done() {
                continue;
            }
            let done = request.done();
            visit(Self::output(handle, request));
            if done {
                self.requests.remove(&handle);
            }
        }
        self.debug_check();
    }

    /// Hand out one request's output now (its last if it is done, and then
    /// drop it). None if the handle has no streams.
    pub fn take_request<R>(
        &mut self,
        handle: u64,
        visit: impl FnOnce(RequestOutputView<'_>) -> R,
    ) -> Option<R> {
        let request = self.requests.get_mut(&handle)?;
        if request.dirty {
            request.dirty = false;
            self.dirty.retain(|&h| h != handle);
        }
        let done = request.done();
        let result = visit(Self::output(handle, request));
        if done {
            self.requests.remove(&handle);
        }
        self.debug_check();
        Some(result)
    }

    /// Drop a request's streams without an output. False if it had none.
    pub fn remove(&mut self, handle: u64) -> bool {
        let removed = self.requests.remove(&handle).is_some();
        if removed {
            self.dirty.retain(|&h| h != handle);
        }
        removed
    }

    fn output(handle: u64, request: &mut RequestStreams) -> RequestOutputView<'_> {
        let done = request.done();
        let mode = request.mode;
        let mut samples = Vec::new();
        for (index, entry) in request.samples.iter_mut().enumerate() {
            let Some(sample) = entry else { continue };
            let finished = sample.finish.is_some() || done;
            let (text, token_start) = match mode {
                OutputMode::Delta => {
                    let start = sample.sent_tokens;
                    sample.sent_tokens = sample.fed;
                    let text = sample.text.as_mut().map_or("", |t| t.take_delta(finished));
                    (text, start)
                }
                OutputMode::Cumulative | OutputMode::FinalOnly => {
                    sample.sent_tokens = sample.fed;
                    (sample.text.as_ref().map_or("", |t| t.text()), 0)
                }
            };
            samples.push(SampleOutput {
                index: index as u32,
                text,
                tokens: &sample.tokens[token_start..sample.fed],
                token_start,
                cumulative_logprob: sample.cumulative_logprob,
                finish: sample.finish,
                stop: sample.stop.as_ref(),
                versions: &sample.versions,
            });
        }
        RequestOutputView {
            handle,
            done,
            first_token_time: request.first_token_time,
            last_token_time: request.last_token_time,
            samples,
            report_logprob: request.report_logprob,
        }
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            if let Err(err) = self.check_invariants() {
                panic!("output streams invariant broken: {err}");
            }
        }
    }

    /// Err naming the first broken invariant (see the module docs).
    pub fn check_invariants(&self) -> Result<(), String> {
        for (&handle, request) in &self.requests {
            let mut finished = 0;
            for sample in request.samples.iter().flatten() {
                if !(sample.sent_tokens <= sample.fed && sample.fed <= sample.tokens.len()) {
                    return Err(format!(
                        "request {handle}: sent {} / fed {} / tokens {}",
                        sample.sent_tokens,
                        sample.fed,
                        sample.tokens.len()
                    ));
                }
                let stopped = sample
                    .text
                    .as_ref()
                    .is_some_and(|t| t.stop_reason().is_some());
                if (stopped || sample.text.is_none()) && sample.fed != sample.tokens.len() {
                    return Err(format!("request {handle}: tokens past the text's end"));
                }
                if sample.stop_token_hidden && sample.finish.is_none() {
                    return Err(format!("request {handle}: a hidden stop token, unfinished"));
                }
                finished += usize::from(sample.finish.is_some());
            }
            if finished != request.num_finished {
                return Err(format!(
                    "request {handle}: {finished} finished samples, num_finished {}",
                    request.num_finished
                ));
            }
            let listed = self.dirty.iter().filter(|&&h| h == handle).count();
            if listed != usize::from(request.dirty) {
                return Err(format!("request {handle}: listed {listed} times as dirty"));
            }
        }
        if self.dirty.iter().any(|h| !self.requests.contains_key(h)) {
            return Err("a dirty handle has no streams".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "output_streams_tests.rs"]
mod tests;
