//! `Engine`: a loaded model with its tokenizer and the limits requests run under; scoring and raw feeding.

use std::path::Path;
use std::sync::Arc;

use super::plan::Generation;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::grammar::Grammars;
use crate::kernels::isa;
use crate::kv::{hash_file, DiskConfig, KvCache, KvKind, PrefixConfig, PrefixStore};
use crate::limits::{MAX_LOGPROBS, MAX_LOOPS};
use crate::loader::{self, ModelFile};
use crate::model::{AutoDepth, Compute, Config, LogitRows, Model, RowBlock, SeqChunk};
use crate::sampler::TokenLogprob;
use crate::tokenizer::Tokenizer;

pub struct Engine {
    pub model: Model,
    pub tokenizer: Arc<Tokenizer>,
    /// Compiles requests' grammars against this model's vocabulary.
    pub grammars: Grammars,
    /// "fp16" | "int8" | "int4" | "int2" | "mixed", from the file's tensor types.
    pub quant: String,
    /// Longest sequence (prompt + output) a request may use.
    pub max_seq_len: usize,
    /// "fp16", "int8", "int4" or "int4-h" (the API's names).
    pub kv_cache_mode: String,
    /// The file's chat template (Jinja), if it has one.
    pub chat_template: Option<String>,
    /// The sampling settings the file recommends (`tinyloop.generation.*`), by field name.
    pub generation: Vec<(String, f64)>,
    /// Finished sequences' KV, reused by requests whose prompts start the same way (off until configured).
    pub prefixes: PrefixStore,
    path: std::path::PathBuf,
}

/// The prompt cache's bounds as a caller states them; `Engine::set_prompt_cache` turns them into a store.
#[derive(Debug, Clone, Default)]
pub struct PromptCache {
    pub max_bytes: usize,
    pub max_entries: usize,
    /// A directory that keeps prefixes across restarts, and its bound in bytes.
    pub disk: Option<(std::path::PathBuf, u64)>,
}

/// KV-cache modes by the API's names; `default` is the "fp16" kind for the model (f32 for all-F32 weights).
pub fn kv_kind_for_mode(mode: &str, default: KvKind, head_dim: usize) -> Result<KvKind> {
    match mode {
        "fp16" => Ok(default),
        "int8" => Ok(KvKind::Int8),
        "int4" => Ok(KvKind::Int4),
        "int4-h" if head_dim.is_power_of_two() => Ok(KvKind::Int4H),
        "int4-h" => Err(Error::InvalidArgument(format!(
            "KV cache mode \"int4-h\" needs a power-of-two head_dim for its Hadamard rotation; \
             this model's is {head_dim}"
        ))),
        other => Err(Error::InvalidArgument(format!(
            "unknown KV cache mode {other:?}; one of \"fp16\", \"int8\", \"int4\", \"int4-h\""
        ))),
    }
}

impl Engine {
    pub fn load(path: &Path, max_seq_len: Option<usize>) -> Result<Self> {
        Self::load_with_kv(path, max_seq_len, "fp16")
    }

    /// "none" (a KV slot per loop and layer) or "last" (after the prompt, one per layer: the last loop's).
    pub fn set_kv_share(&mut self, share: &str) -> Result<()> {
        match share {
            "none" => self.model.set_kv_share(false),
            "last" => self.model.set_kv_share(true),
            other => {
                return Err(Error::InvalidArgument(format!("unknown kv_share {other:?}; one of \"none\", \"last\"")))
            }
        }
        Ok(())
    }

    pub fn load_with_kv(path: &Path, max_seq_len: Option<usize>, kv_cache_mode: &str) -> Result<Self> {
        Self::load_on(path, max_seq_len, kv_cache_mode, Compute::Host)
    }

    /// `load_with_kv`, computing where `compute` says (`Compute::parse` reads the device names). On a device only
    /// the "fp16" KV mode exists.
    pub fn load_on(path: &Path, max_seq_len: Option<usize>, kv_cache_mode: &str, compute: Compute) -> Result<Self> {
        isa::requested().map_err(Error::InvalidArgument)?;
        ensure_arg!(
            kv_cache_mode == "fp16" || !compute.on_device(),
            "KV cache mode {kv_cache_mode:?} is not available on device {:?} yet; use \"fp16\"",
            compute.name()
        );
        let ModelFile { config, vocab, tensors, quant, head_rows, chat_template, generation } = loader::load(path)?;
        let tokenizer = Arc::new(Tokenizer::from_vocab(&vocab).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            what: "tokenizer.ggml.tokens/merges".into(),
            reason: e.to_string(),
        })?);
        let max_seq_len = max_seq_len.unwrap_or(config.context_length);
        ensure_arg!(max_seq_len >= 1, "max_seq_len must be >= 1");
        ensure_arg!(
            max_seq_len <= config.context_length || !compute.on_device(),
            "max_seq_len {max_seq_len} beyond the model's context_length {} is not available on device {:?} yet",
            config.context_length,
            compute.name()
        );
        let mut model = Model::on(config, tensors, head_rows, compute)?;
        let kind = kv_kind_for_mode(kv_cache_mode, model.kv_kind(), model.cfg.head_dim)?;
        model.set_kv_kind(kind);
        let grammars = Grammars::new(tokenizer.clone(), model.cfg.vocab_size);
        let kv_cache_mode = kv_cache_mode.to_string();
        let (prefixes, path) = (PrefixStore::default(), path.to_path_buf());
        Ok(Self {
            model,
            tokenizer,
            grammars,
            quant,
            max_seq_len,
            kv_cache_mode,
            chat_template,
            generation,
            prefixes,
            path,
        })
    }

    /// Keep finished sequences' KV for reuse within these bounds (replacing any earlier store). With a directory,
    /// its files are keyed by this model file's content hash, KV format and shape, so a different model or KV mode
    /// never reads them.
    /// With `kv_share = "last"` nothing is kept: a reused prefix would hold only the last loop's K/V, which the rest
    /// of the prompt's prefill would then see instead of each loop's own, and reuse must never change output. Set
    /// the KV sharing first.
    pub fn set_prompt_cache(&mut self, mut cache: PromptCache) -> Result<()> {
        if self.model.kv_share() {
            cache = PromptCache::default();
        }
        let disk = match cache.disk {
            None => None,
            Some(_) if self.model.compute().on_device() => {
                return Err(Error::InvalidArgument(format!(
                    "the prompt cache's directory (prompt_cache_disk) is not available on device {:?} yet; \
                     the in-memory prompt cache is",
                    self.model.compute().name()
                )))
            }
            Some((dir, max_bytes)) => {
                let hash = hash_file(&self.path)
                    .map_err(|e| Error::Internal(format!("hashing {}: {e}", self.path.display())))?;
                let c = &self.model.cfg;
                let kind = self.model.kv_kind();
                let identity = format!(
                    "model={hash:016x};kv={};heads={}x{};slots={}+{}",
                    kind.name(),
                    c.n_kv_heads,
                    c.head_dim,
                    c.prelude_count,
                    c.block_count
                );
                let shape =
                    crate::kernels::AttnShape { n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
                Some(DiskConfig { dir, max_bytes, identity, kind, shape })
            }
        };
        self.prefixes =
            PrefixStore::new(PrefixConfig { max_bytes: cache.max_bytes, max_entries: cache.max_entries, disk });
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.model.cfg
    }

    /// Score `ids` in one pass, reading the head after each loop depth in `depths` (ascending, 1-based): for every
    /// depth, the log-probability of `ids[i+1]` given `ids[..=i]` and the argmax prediction, for i < len-1.
    pub fn score(&self, ids: &[u32], depths: &[usize]) -> Result<Vec<(Vec<f32>, Vec<u32>)>> {
        ensure_arg!(ids.len() >= 2, "scoring needs at least two tokens");
        ensure_arg!(ids.len() <= self.max_seq_len, "{} tokens exceed max_seq_len {}", ids.len(), self.max_seq_len);
        ensure_arg!(
            !depths.is_empty() && depths.windows(2).all(|w| w[0] < w[1]),
            "depths must be ascending and non-empty"
        );
        ensure_arg!(depths[0] >= 1 && depths[depths.len() - 1] <= MAX_LOOPS, "depths must be in 1..={MAX_LOOPS}");
        self.check_tokens(ids, "token id")?;
        let mut cache = self.model.new_cache(ids.len());
        let inputs = &ids[..ids.len() - 1];
        let targets = candle_core::Tensor::new(&ids[1..], &candle_core::Device::Cpu)?.unsqueeze(1)?;
        let mut h = self.model.embed(inputs)?;
        let mut done = 0;
        let mut out = Vec::with_capacity(depths.len());
        for &d in depths {
            let mut seqs = [SeqChunk { cache: &mut cache, pos: 0, tokens: inputs, tree: None, exits: None }];
            h = self.model.run(h, &mut seqs, done == 0, done..d)?;
            done = d;
            let logits = self.model.logits(&h)?;
            let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?;
            let picked = logp.gather(&targets, 1)?.squeeze(1)?.to_vec1::<f32>()?;
            let argmax = logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?;
            out.push((picked, argmax));
        }
        Ok(out)
    }

    /// `ids` read as a generation under adaptive depth reads them: the first token through every loop (a one-token
    /// prompt), each later one until `rule` stops it (`Model::run_auto`). Per token after the first, its
    /// log-probability and the loops its predecessor ran.
    pub fn score_auto(&self, ids: &[u32], loops: usize, rule: AutoDepth) -> Result<(Vec<f32>, Vec<usize>)> {
        ensure_arg!(ids.len() >= 2, "scoring needs at least two tokens");
        ensure_arg!(ids.len() <= self.max_seq_len, "{} tokens exceed max_seq_len {}", ids.len(), self.max_seq_len);
        Generation { loops: Some(loops), auto: Some(rule), ..Default::default() }.validate()?;
        self.check_tokens(ids, "token id")?;
        let mut cache = self.model.new_cache(ids.len());
        let mut seqs = [SeqChunk { cache: &mut cache, pos: 0, tokens: &ids[..1], tree: None, exits: None }];
        let mut logits = self.model.forward(&mut seqs, loops, LogitRows::Last)?;
        let (mut logps, mut depths) = (Vec::with_capacity(ids.len() - 1), Vec::with_capacity(ids.len() - 1));
        depths.push(loops);
        for t in 1..ids.len() {
            let logp = candle_nn::ops::log_softmax(&logits, candle_core::D::Minus1)?.flatten_all()?;
            logps.push(logp.get(ids[t] as usize)?.to_scalar::<f32>()?);
            if t + 1 == ids.len() {
                break;
            }
            let tokens = &ids[t..t + 1];
            let x = self.model.embed(tokens)?;
            let seq = SeqChunk { cache: &mut cache, pos: t, tokens, tree: None, exits: None };
            let mut blocks = [RowBlock { seq, x, loops: 0..loops }];
            self.model.run_auto(&mut blocks, &[rule])?;
            depths.push(blocks[0].loops.end);
            logits = self.model.logits(&blocks[0].x)?;
        }
        Ok((logps, depths))
    }

    /// The log-probability of each of `ids[1..]` given the ids before it at depth `loops`, with the `n` most likely
    /// tokens at each position (a prompt's log-probabilities, as a generated token's are recorded: `TokenLogprob`).
    pub fn prompt_logprobs(&self, ids: &[u32], loops: usize, n: usize) -> Result<Vec<TokenLogprob>> {
        ensure_arg!(ids.len() >= 2, "prompt log-probabilities need at least two tokens");
        ensure_arg!(ids.len() <= self.max_seq_len, "{} tokens exceed max_seq_len {}", ids.len(), self.max_seq_len);
        ensure_arg!((1..=MAX_LOOPS).contains(&loops), "loops must be in 1..={MAX_LOOPS}, got {loops}");
        ensure_arg!(n <= MAX_LOGPROBS, "logprobs must be in 0..={MAX_LOGPROBS}, got {n}");
        self.check_tokens(ids, "token id")?;
        let mut cache = self.model.new_cache(ids.len());
        let inputs = &ids[..ids.len() - 1];
        let mut seqs = [SeqChunk { cache: &mut cache, pos: 0, tokens: inputs, tree: None, exits: None }];
        let rows = self.model.forward(&mut seqs, loops, LogitRows::All)?.to_vec2::<f32>()?;
        Ok(rows.iter().zip(&ids[1..]).map(|(row, &next)| TokenLogprob::of(row, next, n)).collect())
    }

    /// Every id in `ids` is a token of the vocabulary (`what` names the ids in the error).
    pub fn check_tokens(&self, ids: &[u32], what: &str) -> Result<()> {
        let vocab = self.config().vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(Error::InvalidArgument(format!("{what} {bad} is outside the {vocab}-token vocabulary"))),
            None => Ok(()),
        }
    }

    /// Feed `ids` at positions `pos..` of `cache` through `loops` loops; the logits of every new row, row after row
    /// (the raw sequence API: `tinyloop.Sequence.feed`).
    pub fn feed(&self, cache: &mut KvCache, pos: usize, ids: &[u32], loops: usize) -> Result<Vec<f32>> {
        ensure_arg!((1..=MAX_LOOPS).contains(&loops), "loops must be in 1..={MAX_LOOPS}, got {loops}");
        ensure_arg!(!ids.is_empty(), "feed needs at least one token");
        self.check_tokens(ids, "token id")?;
        let mut seqs = [SeqChunk { cache, pos, tokens: ids, tree: None, exits: None }];
        let t = self.model.forward(&mut seqs, loops, LogitRows::All)?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }
}
