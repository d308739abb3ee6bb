//! Reads and validates a `.tinyloop` file (GGUF v3, layout in docs/format.md) with candle's GGUF reader.
//! Every problem is a typed error naming the key or tensor; nothing here panics on bad input.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::error::{Error, Result};

pub const ARCH: &str = "tinyloop";
pub const MAX_LOOPS: usize = 64;

/// The model's shape, from the `tinyloop.*` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub name: String,
    pub context_length: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    /// k: layers in the looped block.
    pub block_count: usize,
    pub prelude_count: usize,
    pub default_loops: usize,
    pub max_trained_loops: usize,
    pub vocab_size: usize,
    pub file_type: u32,
}

/// The tokenizer keys (llama.cpp's names) as stored.
#[derive(Debug, Clone)]
pub struct VocabData {
    pub tokens: Vec<String>,
    pub token_types: Vec<i64>,
    pub merges: Vec<String>,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
}

pub struct ModelFile {
    pub config: Config,
    pub vocab: VocabData,
    pub tensors: HashMap<String, QTensor>,
    /// "fp16" | "int8" | "int4" | "int2", from the looped block's tensor types: the type holding most of its
    /// weights (a quantizer's fallback type for a few tensors, like Q2_K's for rows not a multiple of 256, does not
    /// change the label); "mixed" only when no type holds a majority.
    pub quant: String,
    /// `tinyloop.draft.token_ids`: the tokens speculative drafts may propose (rust/draft_head.rs), if listed.
    pub draft_ids: Option<Vec<u32>>,
}

struct Reader<'a> {
    path: &'a Path,
    content: &'a Content,
}

impl Reader<'_> {
    fn err(&self, what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Format { path: self.path.to_path_buf(), what: what.into(), reason: reason.into() }
    }

    fn get(&self, key: &str) -> Result<&Value> {
        self.content.metadata.get(key).ok_or_else(|| self.err(key, "required key is missing"))
    }

    fn uint(&self, key: &str) -> Result<u64> {
        as_u64(self.get(key)?).ok_or_else(|| self.err(key, "expected a non-negative integer"))
    }

    fn usize_in(&self, key: &str, lo: u64, hi: u64) -> Result<usize> {
        let v = self.uint(key)?;
        if v < lo || v > hi {
            return Err(self.err(key, format!("value {v} is outside {lo}..={hi}")));
        }
        Ok(v as usize)
    }

    fn float(&self, key: &str) -> Result<f64> {
        match self.get(key)? {
            Value::F32(v) => Ok(*v as f64),
            Value::F64(v) => Ok(*v),
            v => as_u64(v).map(|u| u as f64).ok_or_else(|| self.err(key, "expected a number")),
        }
    }

    fn string(&self, key: &str) -> Result<&str> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            _ => Err(self.err(key, "expected a string")),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let Value::Array(items) = self.get(key)? else { return Err(self.err(key, "expected an array")) };
        items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(self.err(key, "expected an array of strings")),
            })
            .collect()
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>> {
        let Value::Array(items) = self.get(key)? else { return Err(self.err(key, "expected an array")) };
        items.iter().map(|v| as_i64(v).ok_or_else(|| self.err(key, "expected an array of integers"))).collect()
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    as_i64(v).and_then(|i| u64::try_from(i).ok()).or(match v {
        Value::U64(u) => Some(*u),
        _ => None,
    })
}

fn as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::I64(x) => *x,
        Value::U64(x) => i64::try_from(*x).ok()?,
        _ => return None,
    })
}

fn read_config(r: &Reader) -> Result<Config> {
    let arch = r.string("general.architecture")?;
    if arch != ARCH {
        return Err(r.err("general.architecture", format!("is {arch:?}, expected {ARCH:?}")));
    }
    let k = |s: &str| format!("{ARCH}.{s}");
    let dim = r.usize_in(&k("embedding_length"), 1, 1 << 16)?;
    let n_heads = r.usize_in(&k("attention.head_count"), 1, 1024)?;
    let n_kv_heads = r.usize_in(&k("attention.head_count_kv"), 1, 1024)?;
    if dim % n_heads != 0 || (dim / n_heads) % 2 != 0 {
        return Err(r.err(k("attention.head_count"), format!("{dim} / {n_heads} heads is not an even head size")));
    }
    if n_heads % n_kv_heads != 0 {
        return Err(r.err(k("attention.head_count_kv"), format!("{n_kv_heads} does not divide {n_heads} heads")));
    }
    let rms_eps = r.float(&k("attention.layer_norm_rms_epsilon"))?;
    let rope_theta = r.float(&k("rope.freq_base"))?;
    if !(rms_eps > 0.0 && rms_eps < 1.0) {
        return Err(r.err(k("attention.layer_norm_rms_epsilon"), format!("{rms_eps} is not in (0, 1)")));
    }
    if !(rope_theta > 1.0 && rope_theta.is_finite()) {
        return Err(r.err(k("rope.freq_base"), format!("{rope_theta} must be finite and > 1")));
    }
    let name = r.string("general.name")?.to_string();
    Ok(Config {
        name,
        context_length: r.usize_in(&k("context_length"), 1, 1 << 20)?,
        dim,
        ffn_dim: r.usize_in(&k("feed_forward_length"), 1, 1 << 18)?,
        n_heads,
        n_kv_heads,
        head_dim: dim / n_heads,
        rms_eps,
        rope_theta: rope_theta as f32,
        block_count: r.usize_in(&k("block_count"), 1, 256)?,
        prelude_count: r.usize_in(&k("prelude_count"), 0, 256)?,
        default_loops: r.usize_in(&k("loops.default"), 1, MAX_LOOPS as u64)?,
        max_trained_loops: r.usize_in(&k("loops.max_trained"), 1, MAX_LOOPS as u64)?,
        vocab_size: 0, // set from the tokenizer below
        file_type: r.uint("general.file_type")? as u32,
    })
}

fn read_vocab(r: &Reader) -> Result<VocabData> {
    let model = r.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(r.err("tokenizer.ggml.model", format!("is {model:?}; only \"gpt2\" byte-level BPE is supported")));
    }
    let pre = r.string("tokenizer.ggml.pre")?;
    if pre != "gpt-2" {
        return Err(r.err("tokenizer.ggml.pre", format!("is {pre:?}; only \"gpt-2\" is supported")));
    }
    let tokens = r.strings("tokenizer.ggml.tokens")?;
    let token_types = r.ints("tokenizer.ggml.token_type")?;
    if token_types.len() != tokens.len() {
        return Err(r.err("tokenizer.ggml.token_type", format!("{} entries for {} tokens", token_types.len(), tokens.len())));
    }
    let merges = r.strings("tokenizer.ggml.merges")?;
    let n = tokens.len() as u64;
    let id = |key: &str| -> Result<u32> {
        let v = r.uint(key)?;
        if v >= n {
            return Err(r.err(key, format!("token id {v} is outside the {n}-token vocabulary")));
        }
        Ok(v as u32)
    };
    Ok(VocabData { bos_token_id: id("tokenizer.ggml.bos_token_id")?, eos_token_id: id("tokenizer.ggml.eos_token_id")?, tokens, token_types, merges })
}

/// The optional draft vocabulary: distinct token ids, each inside the vocabulary.
fn read_draft_ids(r: &Reader, vocab_size: usize) -> Result<Option<Vec<u32>>> {
    const KEY: &str = "tinyloop.draft.token_ids";
    if !r.content.metadata.contains_key(KEY) {
        return Ok(None);
    }
    let ids = r.ints(KEY)?;
    let mut seen = std::collections::HashSet::new();
    for &t in &ids {
        if t < 0 || t as usize >= vocab_size {
            return Err(r.err(KEY, format!("token id {t} is outside the {vocab_size}-token vocabulary")));
        }
        if !seen.insert(t) {
            return Err(r.err(KEY, format!("token id {t} is listed twice")));
        }
    }
    if ids.is_empty() {
        return Err(r.err(KEY, "the list is empty"));
    }
    Ok(Some(ids.into_iter().map(|t| t as u32).collect()))
}

/// Every tensor the config implies, with candle's (row-major, outermost first) shape.
pub fn expected_tensors(cfg: &Config, tied_head: bool) -> BTreeMap<String, Vec<usize>> {
    let (d, f, kv) = (cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim);
    let layer: [(&str, Vec<usize>); 9] = [
        ("attn_norm", vec![d]),
        ("attn_q", vec![d, d]),
        ("attn_k", vec![kv, d]),
        ("attn_v", vec![kv, d]),
        ("attn_output", vec![d, d]),
        ("ffn_norm", vec![d]),
        ("ffn_gate", vec![f, d]),
        ("ffn_up", vec![f, d]),
        ("ffn_down", vec![d, f]),
    ];
    let mut out = BTreeMap::new();
    out.insert("token_embd.weight".to_string(), vec![cfg.vocab_size, d]);
    out.insert("output_norm.weight".to_string(), vec![d]);
    if !tied_head {
        out.insert("output.weight".to_string(), vec![cfg.vocab_size, d]);
    }
    for (prefix, count) in [("pre", cfg.prelude_count), ("blk", cfg.block_count)] {
        for i in 0..count {
            for (part, shape) in &layer {
                out.insert(format!("{prefix}.{i}.{part}.weight"), shape.clone());
            }
        }
    }
    out
}

fn allowed(dtype: GgmlDType, rank: usize) -> bool {
    use GgmlDType::*;
    match rank {
        1 => matches!(dtype, F32 | F16),
        _ => matches!(dtype, F32 | F16 | Q8_0 | Q4_0 | Q4_1 | Q2K),
    }
}

pub fn quant_label(dtype: GgmlDType) -> &'static str {
    use GgmlDType::*;
    match dtype {
        F32 | F16 | BF16 => "fp16",
        Q8_0 | Q8_1 => "int8",
        Q4_0 | Q4_1 => "int4",
        Q2K => "int2",
        _ => "other",
    }
}

/// Load and validate a model file.
pub fn load(path: &Path) -> Result<ModelFile> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(path.to_path_buf()),
        _ => Error::NotGguf { path: path.to_path_buf(), reason: e.to_string() },
    })?;
    let mut reader = BufReader::new(file);
    let content = Content::read(&mut reader)
        .map_err(|e| Error::NotGguf { path: path.to_path_buf(), reason: e.to_string() })?;
    let r = Reader { path, content: &content };
    let mut config = read_config(&r)?;
    let vocab = read_vocab(&r)?;
    config.vocab_size = vocab.tokens.len();

    let tied = !content.tensor_infos.contains_key("output.weight");
    let expected = expected_tensors(&config, tied);
    if let Some(extra) = content.tensor_infos.keys().filter(|n| !expected.contains_key(*n)).min() {
        return Err(r.err(format!("tensor {extra}"), "not part of a tinyloop model with this config"));
    }
    let mut tensors = HashMap::new();
    let mut block_types = Vec::new();
    for (name, shape) in &expected {
        let info = content.tensor_infos.get(name).ok_or_else(|| r.err(format!("tensor {name}"), "missing"))?;
        let got = info.shape.dims();
        if got != shape.as_slice() {
            let reason = if name == "token_embd.weight" && got.len() == 2 && got[1] == shape[1] {
                format!("has {} rows but the vocabulary has {} tokens", got[0], shape[0])
            } else {
                format!("shape {got:?}, expected {shape:?}")
            };
            return Err(r.err(format!("tensor {name}"), reason));
        }
        if !allowed(info.ggml_dtype, shape.len()) {
            return Err(r.err(format!("tensor {name}"), format!("unsupported type {:?}", info.ggml_dtype)));
        }
        let block = info.ggml_dtype.block_size();
        if shape[shape.len() - 1] % block != 0 {
            return Err(r.err(format!("tensor {name}"), format!("rows of {} values are not a multiple of {:?}'s block of {block}", shape[shape.len() - 1], info.ggml_dtype)));
        }
        let t = info
            .read(&mut reader, content.tensor_data_offset, &Device::Cpu)
            .map_err(|e| r.err(format!("tensor {name}"), format!("cannot read data ({e}); is the file truncated?")))?;
        if name.starts_with("blk.") && shape.len() == 2 {
            block_types.push((info.ggml_dtype, shape.iter().product::<usize>()));
        }
        tensors.insert(name.clone(), t);
    }
    let mut by_label: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for (t, n) in &block_types {
        *by_label.entry(quant_label(*t)).or_default() += n;
    }
    let total: usize = by_label.values().sum();
    let quant = by_label.iter().find(|(_, &n)| 2 * n > total).map_or("mixed", |(l, _)| *l).to_string();
    let draft_ids = read_draft_ids(&r, config.vocab_size)?;
    Ok(ModelFile { config, vocab, tensors, quant, draft_ids })
}
