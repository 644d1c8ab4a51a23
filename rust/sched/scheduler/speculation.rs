//! Speculative decoding: a decoding sequence runs its next token plus up to
//! `k` drafted ones in one step, and keeps the drafts the model agrees with.
//!
//! Phase 2 (`budget.rs`) asks [`Scheduler::draft`] for a decoding sequence's
//! drafts (`DraftMethod::Ngram`: [`ngram_drafter`], its own text;
//! `DraftMethod::Suffix`: [`crate::sched::suffix_drafter::SuffixIndex`], recent
//! sequences' text, where a
//! drafting sequence's stream is brought up to date first); the row then carries
//! `1 + d` query tokens, its committed last token followed by the drafts, and
//! `build_plan` emits one sampled row per position: sampled row `i` (offset
//! `i`, logits index `first + i`, the same seat) gives the token after
//! position `start + i`. The runner samples every row as it would without
//! speculation, the seat's generated-token index advanced by the offset (so
//! seeded samples draw the same keys), and records only the rows this file
//! accepts.
//!
//! Verification (`update`, [`Scheduler::settle_verified`]): row `0`'s token
//! is always kept; row `i > 0` is kept when row `i - 1`'s token equals draft
//! `i - 1` (then that draft's KV, written this step, is the sequence's) and
//! no earlier token finished the sequence. The first token that differs
//! from its draft is the model's own choice at that position. Since the
//! drafts are deterministic, keeping a draft exactly when the target's sample
//! equals it is rejection sampling with acceptance `p(draft)`: the kept
//! tokens have the distribution they have without speculation, and greedy
//! outputs are identical. The slots of rejected drafts go back
//! (`KvCacheManager::truncate`); they were never cached (`build_plan` caches
//! committed tokens only), and never reach the events `update` returns.
//!
//! A drafter outside the core (`DraftMethod::DraftModel`: a smaller model
//! the engine runs) asks [`Scheduler::draft_requests`] which sequences will
//! draft at the next `schedule` and how many tokens each may, runs its model,
//! and hands the tokens in with [`Scheduler::propose_drafts`]; `draft` then
//! takes them as it takes the n-gram drafter's. A proposal holds only for the
//! tokens it was made from: `schedule` drops every proposal, used or not.
//!
//! When it applies: the config's `num_speculative_tokens > 0`, a policy other
//! than `static`, no sliding window, nobody waiting (under load the step is
//! full anyway: speculation shrinks to zero), at most `max_running`
//! sequences running, and for the sequence: decoding, no grammar, its request
//! allows it (`Scheduler::disable_speculation`: the engine turns it off for
//! penalties, whose counts would need the drafts), and it has generated a
//! token (the row completing a prompt may fork its samples). The drafts count against
//! the token budget, the sampled rows stay within `max_sampled_rows()`
//! (`max_num_seqs`, or `1 + num_speculative_tokens` if larger), and a
//! sequence drafts `spec_k` tokens: `num_speculative_tokens` after a step that
//! accepted every draft, one more than it accepted otherwise.
//!
//! Drafters that miss stay out of the way. A draft of which nothing was kept
//! costs a verification step (several times a decode step on a CPU) for one
//! token, so after `m` such drafts in a row a sequence decodes `2^(m-1) - 1`
//! steps without drafting (at most [`MAX_COOLDOWN`]): one miss costs
//! nothing, and a drafter that is nearly always wrong drafts once in 32
//! steps. Misses in a row are also counted across sequences (any kept draft
//! resets the count), and a sequence's count starts from it, so a new
//! request of a drafter that misses everywhere (a draft model unlike its
//! target) is cooled down after its first miss. Once that count reaches
//! [`COLD_DRAFTER_MISSES`], a miss also stops every sequence drafting for
//! [`MAX_COOLDOWN`] plans, and while it stays there one sequence at a time
//! drafts (a probe: a draft model's first draft of a sequence computes its
//! whole prompt). Many sequences drafting in turn would otherwise leave few
//! steps without a draft, and a step with drafts runs alone instead of
//! several decode steps to a device call.
//!
//! Invariants: a sequence holds a non-empty `draft` only between the plan
//! that verifies it and that plan's `update`; its sampled rows are
//! consecutive, offsets `0..=draft.len()`; after `update` its table holds
//! exactly `num_computed` tokens again and `num_computed == tokens.len() - 1`.

use super::Scheduler;
use crate::error::{KvError, KvResult};
use crate::sched::ngram_drafter;
use crate::sched::request::SeqState;

/// Most decode steps a sequence skips drafting after drafts that missed.
pub const MAX_COOLDOWN: u32 = 31;
/// Misses in a row, across sequences, after which a miss pauses all drafting.
pub const COLD_DRAFTER_MISSES: u32 = 6;

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftMethod {
    /// The sequence's own text ([`ngram_drafter`]).
    Ngram,
    /// Recent sequences' text, its own included
    /// ([`crate::sched::suffix_drafter::SuffixIndex`]).
    Suffix,
    /// Tokens a drafter outside the core proposed ([`Scheduler::propose_drafts`]).
    DraftModel,
}

impl DraftMethod {
    pub fn parse(name: &str) -> KvResult<Self> {
        match name {
            "ngram" => Ok(Self::Ngram),
            "suffix" => Ok(Self::Suffix),
            "draft_model" => Ok(Self::DraftModel),
            _ => Err(KvError::InvalidArgument(format!(
                "speculative method must be 'ngram', 'suffix' or 'draft_model', got {name:?}"
            ))),
        }
    }
}

/// Speculative decoding settings (vLLM's `--speculative-config` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: DraftMethod,
    /// Most drafted tokens per sequence and step; 0 turns speculation off.
    pub num_speculative_tokens: usize,
    /// Shortest and longest suffix the n-gram drafter matches.
    pub prompt_lookup_min: usize,
    pub prompt_lookup_max: usize,
    /// Sequences draft only while at most this many run.
    pub max_running: usize,
    /// Tokens of recent streams the suffix drafter keeps.
    pub suffix_capacity: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            method: DraftMethod::Ngram,
            num_speculative_tokens: 0,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            max_running: 8,
            suffix_capacity: 1 << 18,
        }
    }
}

/// Drafts an outside drafter proposed for a sequence of `tokens_len` tokens.
#[derive(Debug, Clone)]
pub(super) struct Proposal {
    seq: u32,
    tokens_len: usize,
    drafts: Vec<u32>,
}

impl Scheduler {
    /// Sampled rows drafts may add to the step being scheduled (0 when
    /// speculation does not apply to it).
    pub(super) fn draft_room(&self) -> usize {
        let spec = &self.config.speculative;
        let applies = spec.num_speculative_tokens > 0
            && self.config.policy != super::Policy::Static
            && self.config.sliding_window.is_none()
            && self.waiting.is_empty()
            && self.running.len() <= spec.max_running
            && self.drafter_cooldown == 0;
        if !applies {
            return 0;
        }
        let room = self
            .config
            .max_sampled_rows()
            .saturating_sub(self.running.len() + self.pending_fork_seats);
        if self.drafter_misses >= COLD_DRAFTER_MISSES {
            // A drafter that keeps missing probes with one sequence at a time.
            return room.min(spec.num_speculative_tokens);
        }
        room
    }

    /// The most tokens `seq`, which decodes its next token, may draft with
    /// `budget` tokens and `room` sampled rows left (0: it does not draft).
    fn draft_limit(&self, seq: u32, budget: usize, room: usize) -> usize {
        let s = self.seq(seq);
        let request = self.request_of(seq);
        let produced = s.tokens.len() - request.prompt_len;
        // The last drafted position still leaves its sample room to be generated.
        let left = (request.params.max_tokens as usize)
            .saturating_sub(produced + 1)
            .min(self.config.max_model_len.saturating_sub(s.tokens.len() + 1));
        // Past the prompt only: the row completing a prompt may fork (n > 1),
        // and children must not inherit drafted slots.
        if produced == 0 || s.grammar.is_some() || !request.speculate || s.spec_cooldown > 0 {
            return 0;
        }
        (s.spec_k as usize).min(budget).min(room).min(left)
    }

    /// Draft up to `room` tokens (and at most `budget`) for `seq`, which
    /// decodes its next token this step: stored in its `draft`, their count
    /// returned.
    pub(super) fn draft(&mut self, seq: u32, budget: usize, room: usize) -> usize {
        let spec = self.config.speculative;
        if self.seq(seq).spec_cooldown > 0 {
            self.seq_mut(seq).spec_cooldown -= 1;
            return 0;
        }
        let k = self.draft_limit(seq, budget, room);
        if k == 0 {
            return 0;
        }
        let mut draft = std::mem::take(&mut self.seq_mut(seq).draft);
        if let Some(index) = self.suffix.as_mut() {
            let s = self.seqs[seq as usize].as_mut().expect("live");
            let stream = *s.stream.get_or_insert_with(|| index.open());
            // Its text since it last drafted (all of it the first time).
            let held = index.stream_len(stream).unwrap_or(s.tokens.len());
            index.extend(stream, &s.tokens[held.min(s.tokens.len())..]);
            index.propose(&s.tokens, k, &mut draft);
        } else if spec.method == DraftMethod::DraftModel {
            let tokens_len = self.seq(seq).tokens.len();
            if let Some(p) = self
                .proposed
                .iter()
                .find(|p| p.seq == seq && p.tokens_len == tokens_len)
            {
                draft.extend_from_slice(&p.drafts[..p.drafts.len().min(k)]);
            }
        } else {
            let s = self.seq(seq);
            ngram_drafter::propose(
                &s.tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
                k,
                &mut draft,
            );
        }
        let drafted = draft.len();
        self.seq_mut(seq).draft = draft;
        drafted
    }

    /// With `DraftMethod::DraftModel`: the sequences that will draft at the
    /// next `schedule` if given tokens, as `(handle, sample index, most
    /// tokens)`, in the order `schedule` visits them (the token budget may
    /// still cut the last ones short). Empty for other methods or when
    /// speculation does not apply.
    pub fn draft_requests(&self) -> Vec<(u64, u32, usize)> {
        if self.config.speculative.method != DraftMethod::DraftModel {
            return Vec::new();
        }
        let mut room = self.draft_room();
        let mut wanted = Vec::new();
        for &seq in &self.running {
            let s = self.seq(seq);
            if room == 0 {
                break;
            }
            if s.tokens.len() - s.num_computed != 1 {
                continue; // not decoding
            }
            let k = self.draft_limit(seq, usize::MAX, room);
            if k > 0 {
                let request = self.request_of(seq);
                let index = request
                    .seqs
                    .iter()
                    .position(|&x| x == seq)
                    .expect("its seq");
                wanted.push((request.handle, index as u32, k));
                room -= k;
            }
        }
        wanted
    }

    /// Tokens an outside drafter proposes to follow sample `sample_index` of
    /// request `handle` as it stands now (see [`Self::draft_requests`]); the
    /// next `schedule` drafts at most its limit of them. Errors for an
    /// unknown sample or a method other than `DraftModel`.
    pub fn propose_drafts(
        &mut self,
        handle: u64,
        sample_index: u32,
        drafts: &[u32],
    ) -> KvResult<()> {
        if self.config.speculative.method != DraftMethod::DraftModel {
            return Err(KvError::InvalidArgument(
                "propose_drafts needs the 'draft_model' speculative method".into(),
            ));
        }
        let seq = self
            .by_handle
            .get(&handle)
            .and_then(|&index| self.requests[index as usize].as_ref())
            .and_then(|request| request.seqs.get(sample_index as usize).copied())
            .filter(|&seq| self.seqs[seq as usize].is_some())
            .ok_or_else(|| {
                KvError::InvalidArgument(format!(
                    "no live sample {sample_index} of request handle {handle}"
                ))
            })?;
        let tokens_len = self.seq(seq).tokens.len();
        self.proposed.retain(|p| p.seq != seq);
        self.proposed.push(Proposal {
            seq,
            tokens_len,
            drafts: drafts.to_vec(),
        });
        Ok(())
    }

    /// After `update` kept `accepted` of the `drafted` tokens of `seq`: if
    /// it still runs, their KV is the sequence's, the rest of its table goes
    /// back, full blocks are cached, and its next draft length adapts (a
    /// sequence that finished on one of its tokens has released everything).
    pub(super) fn settle_verified(
        &mut self,
        seq: u32,
        accepted: usize,
        drafted: usize,
    ) -> KvResult<()> {
        self.stats.num_draft_tokens += drafted as u64;
        self.stats.num_accepted_tokens += accepted as u64;
        self.stats.num_drafts += 1;
        let Some(s) = self.seqs[seq as usize].as_mut() else {
            return Ok(()); // its request finished and left
        };
        s.draft.clear();
        if s.state != SeqState::Running {
            return Ok(());
        }
        let bs = self.config.block_size;
        let k_max = self.config.speculative.num_speculative_tokens as u32;
        s.spec_k = if accepted == drafted {
            k_max
        } else {
            (accepted as u32 + 1).min(k_max)
        };
        if accepted == 0 {
            self.drafter_misses = (self.drafter_misses + 1).min(COLD_DRAFTER_MISSES);
            if self.drafter_misses == COLD_DRAFTER_MISSES {
                self.drafter_cooldown = MAX_COOLDOWN;
            }
            s.spec_misses = (s.spec_misses.max(self.drafter_misses - 1) + 1).min(6);
            s.spec_cooldown = ((1u32 << (s.spec_misses - 1)) - 1).min(MAX_COOLDOWN);
        } else {
            self.drafter_misses = 0;
            s.spec_misses = 0;
        }
        let kv = s.kv.expect("running sequences hold KV");
        let before = s.num_computed;
        let after = before + accepted;
        s.num_computed = after;
        self.kv.truncate(kv, after)?;
        self.kv.record_written(kv, before, after)?;
        if self.config.enable_prefix_caching && before / bs != after / bs {
            let tokens = &self.seqs[seq as usize].as_ref().expect("live").tokens;
            self.kv.cache_blocks(kv, &tokens[..after])?;
        }
        Ok(())
    }
}
