//! Structured outputs: token masks that keep a sequence inside a JSON
//! schema, a regular expression, a choice list or a Lark grammar, computed
//! by llguidance's Earley parser over a token trie.
//!
//! - [`GrammarVocab`]: the model's vocabulary as token byte strings plus its
//!   EOS ids, turned into llguidance's token trie and parser factory once per
//!   model. Compiling a [`GuidedSpec`] against it yields a [`Grammar`].
//! - [`Grammar`]: a compiled, never advanced parser; cheap to clone.
//!   [`Grammar::matcher`] starts one sequence's [`GrammarMatcher`].
//! - [`GrammarMatcher`]: one sequence's parse state: advanced by every token
//!   the sequence accepts, asked for the mask of the next token.
//! - [`fill_bitmasks`]: the masks of a step's sampled rows in one call.
//!
//! Invariants:
//! 1. A matcher has consumed exactly the tokens its sequence generated, in
//!    order ([`GrammarMatcher::num_consumed`] equals the output length).
//!    The scheduler keeps this: it advances the matcher for every token it
//!    appends; a preempted sequence keeps its tokens and its matcher (the
//!    recompute re-creates KV only); a forked sample gets a clone of its
//!    parent's matcher. No rollback exists or is needed.
//! 2. Mask layout: one `u32` word per 32 token ids, `words(vocab)` words per
//!    row; token `t` is allowed iff bit `t % 32` of word `t / 32` is set.
//!    Ids past the tokenizer (embedding padding) are never allowed.
//! 3. A matcher whose grammar is complete (nothing may follow) allows only
//!    the EOS tokens; one in an error state allows only EOS too, so the row
//!    is never fully masked.
//! 4. Compilation is bounded by llguidance's [`ParserLimits`] (lexer fuel,
//!    grammar size); callers that need a wall-clock bound compile off the
//!    engine thread.

use std::fmt;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{Matcher, ParserFactory, TokenParser};
use rayon::prelude::*;
use serde_json::Value;

use crate::error::{KvError, KvResult};

/// Rows fewer than this compute their masks on the calling thread.
const PARALLEL_MIN_ROWS: usize = 4;

/// `u32` words of one mask row for a vocabulary of `vocab_size` ids.
pub fn words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// What a request constrains its output to (vLLM's guided-decoding kinds).
#[derive(Debug, Clone, PartialEq)]
pub enum GuidedSpec {
    /// A JSON schema (as JSON text).
    Json(String),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax.
    Grammar(String),
}

impl GuidedSpec {
    /// The field name a user sets for this kind (vLLM's names).
    pub fn kind(&self) -> &'static str {
        match self {
            GuidedSpec::Json(_) => "json",
            GuidedSpec::JsonObject => "json_object",
            GuidedSpec::Regex(_) => "regex",
            GuidedSpec::Choice(_) => "choice",
            GuidedSpec::Grammar(_) => "grammar",
        }
    }

    /// Build from a kind name and its text (`choice`: a JSON list of strings).
    pub fn parse(kind: &str, value: &str) -> KvResult<Self> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        match kind {
            "json" => Ok(GuidedSpec::Json(value.to_owned())),
            "json_object" => Ok(GuidedSpec::JsonObject),
            "regex" => Ok(GuidedSpec::Regex(value.to_owned())),
            "grammar" => Ok(GuidedSpec::Grammar(value.to_owned())),
            "choice" => match serde_json::from_str::<Vec<String>>(value) {
                Ok(list) => Ok(GuidedSpec::Choice(list)),
                Err(err) => invalid(format!("choice must be a list of strings: {err}")),
            },
            other => invalid(format!(
                "unknown guided decoding kind {other:?}: expected json, json_object, regex, \
                 choice or grammar"
            )),
        }
    }

    fn to_grammar(&self) -> KvResult<TopLevelGrammar> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        Ok(match self {
            GuidedSpec::Json(text) => {
                let schema: Value = match serde_json::from_str(text) {
                    Ok(v) => v,
                    Err(err) => return invalid(format!("json: the schema is not JSON: {err}")),
                };
                if !schema.is_object() && !schema.is_boolean() {
                    return invalid("json: a schema must be a JSON object or boolean".into());
                }
                TopLevelGrammar::from_json_schema(with_compact_layout(schema))
            }
            GuidedSpec::JsonObject => TopLevelGrammar::from_json_schema(with_compact_layout(
                serde_json::json!({"type": "object"}),
            )),
            GuidedSpec::Regex(rx) => {
                if let Err(err) = regex_syntax::Parser::new().parse(rx) {
                    return invalid(format!("regex: {err}"));
                }
                TopLevelGrammar::from_regex(rx)
            }
            GuidedSpec::Choice(list) => {
                if list.is_empty() {
                    return invalid("choice must list at least one string".into());
                }
                if list.iter().any(String::is_empty) {
                    return invalid("choice must not contain an empty string".into());
                }
                let alternatives: Vec<String> =
                    list.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            GuidedSpec::Grammar(lark) => {
                if lark.trim().is_empty() {
                    return invalid("grammar is empty".into());
                }
                TopLevelGrammar::from_lark(lark.clone())
            }
        })
    }
}

/// JSON in one line with `", "` and `": "` separators, no free whitespace:
/// output length stays bounded by the schema (a model cannot pad forever).
/// A schema's own `x-guidance` options win.
fn with_compact_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// The model's vocabulary as llguidance sees it; built once per model.
pub struct GrammarVocab {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    eos_token_ids: Arc<[u32]>,
}

impl GrammarVocab {
    /// `tokens[id]` holds the bytes token `id` stands for; special tokens
    /// start with `0xFF` (`TokTrie::SPECIAL_TOKEN_MARKER`) and empty entries
    /// (ids past the tokenizer) are never allowed. `eos_token_ids` are the
    /// tokens that end a sequence; at least one is required.
    pub fn new(tokens: Vec<Vec<u8>>, eos_token_ids: &[u32]) -> KvResult<Self> {
        let invalid = |msg: String| Err(KvError::InvalidArgument(msg));
        let vocab_size = tokens.len();
        if vocab_size == 0 {
            return invalid("the vocabulary is empty".into());
        }
        let Some(&first_eos) = eos_token_ids.first() else {
            return invalid("structured outputs need at least one EOS token id".into());
        };
        if let Some(bad) = eos_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            return invalid(format!(
                "EOS token id {bad} is outside the vocabulary of {vocab_size} tokens"
            ));
        }
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &tokens).with_eos_tokens(eos_token_ids);
        let env = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&(env as _))
            .map_err(|e| KvError::InvalidArgument(format!("cannot index the vocabulary: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size,
            eos_token_ids: eos_token_ids.into(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Mask words per row (see the module invariants).
    pub fn words(&self) -> usize {
        words(self.vocab_size)
    }

    /// Compile a spec; the error names the field and what is wrong.
    pub fn compile(&self, spec: &GuidedSpec) -> KvResult<Grammar> {
        let grammar = spec.to_grammar()?;
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            KvError::InvalidArgument(format!("{}: cannot compile: {e}", spec.kind()))
        })?;
        let grammar = Grammar {
            parser,
            vocab_size: self.vocab_size,
            eos_token_ids: self.eos_token_ids.clone(),
        };
        // Reject grammars that fail on their very first mask (e.g. an
        // unsatisfiable schema) at compile time, not mid-generation.
        let mut probe = grammar.matcher();
        let mut words = vec![0u32; self.words()];
        probe.fill_mask(&mut words).map_err(|e| {
            KvError::InvalidArgument(format!("{}: cannot compile: {e}", spec.kind()))
        })?;
        Ok(grammar)
    }
}

/// A compiled grammar in its start state.
#[derive(Clone)]
pub struct Grammar {
    parser: TokenParser,
    vocab_size: usize,
    eos_token_ids: Arc<[u32]>,
}

impl Grammar {
    /// A fresh matcher with its own lexer caches (no lock shared with other
    /// requests of the same grammar).
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            matcher: Matcher::new(Ok(self.parser.deep_clone())),
            num_consumed: 0,
            vocab_size: self.vocab_size,
            eos_token_ids: self.eos_token_ids.clone(),
        }
    }
}

impl fmt::Debug for Grammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grammar")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

/// One sequence's position in its grammar.
#[derive(Clone)]
pub struct GrammarMatcher {
    matcher: Matcher,
    num_consumed: usize,
    vocab_size: usize,
    eos_token_ids: Arc<[u32]>,
}

impl fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("num_consumed", &self.num_consumed)
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.matcher.get_error())
            .finish()
    }
}

impl GrammarMatcher {
    /// Advance by one accepted token. An error means the token was not
    /// allowed (the mask was not applied) or the parser failed; the matcher
    /// then stays in its error state.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        self.num_consumed += 1;
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| e.to_string())
    }

    /// Tokens consumed so far (invariant 1).
    pub fn num_consumed(&self) -> usize {
        self.num_consumed
    }

    /// The grammar is complete and nothing may follow, or it failed.
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }

    /// Write the next token's mask into `out` (`words(vocab)` words).
    /// On a parser error `out` allows only EOS (invariant 3) and the error
    /// is returned.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<(), String> {
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) => {
                let src = mask.as_slice();
                let n = src.len().min(out.len());
                out[..n].copy_from_slice(&src[..n]);
                out[n..].fill(0);
                Ok(())
            }
            Err(err) => {
                out.fill(0);
                for &eos in self.eos_token_ids.iter() {
                    set_bit(out, eos);
                }
                Err(err.to_string())
            }
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

fn set_bit(words: &mut [u32], token: u32) {
    if let Some(word) = words.get_mut(token as usize / 32) {
        *word |= 1 << (token % 32);
    }
}

/// Fill `out` (`rows.len()` rows of `words` words) with the masks of a
/// step's sampled rows: a row with a matcher gets its mask, a row without
/// one allows every token. Rows are computed in parallel when there are
/// enough. Returns the number of constrained rows.
pub fn fill_bitmasks(
    rows: Vec<Option<&mut GrammarMatcher>>,
    out: &mut [u32],
    words: usize,
) -> usize {
    assert_eq!(out.len(), rows.len() * words, "mask buffer size");
    let constrained = rows.iter().filter(|r| r.is_some()).count();
    let fill = |(row, dest): (Option<&mut GrammarMatcher>, &mut [u32])| match row {
        // An error already left an EOS-only mask; the scheduler reports it
        // when the sequence's next token fails to advance the matcher.
        Some(matcher) => drop(matcher.fill_mask(dest)),
        None => dest.fill(u32::MAX),
    };
    if constrained >= PARALLEL_MIN_ROWS {
        rows.into_par_iter()
            .zip(out.par_chunks_mut(words))
            .for_each(fill);
    } else {
        rows.into_iter().zip(out.chunks_mut(words)).for_each(fill);
    }
    constrained
}
