//! Reads and validates a `.tinyloop` file (GGUF v3, layout in docs/format.md); `gguf` reads the container.
//! Every problem is a typed error naming the key or tensor; nothing here panics on bad input, and nothing is
//! allocated for a length or count the file declares before that length is known to fit in the file.

mod gguf;
mod pretokenizer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};

use crate::error::{Error, Result};
use crate::limits::{MAX_CONTEXT, MAX_DIM, MAX_FFN_DIM, MAX_HEADS, MAX_LAYERS, MAX_LOOPS, MAX_TENSORS, MAX_TOP_K};
use crate::model::{Config, HeadRows, RopeScaling};
use gguf::{Gguf, Source, Value};
pub use pretokenizer::PreTokenizer;

pub const ARCH: &str = "tinyloop";

/// The tokenizer keys (llama.cpp's names) as stored.
#[derive(Debug, Clone)]
pub struct VocabData {
    pub tokens: Vec<String>,
    pub token_types: Vec<i64>,
    pub merges: Vec<String>,
    pub pre: PreTokenizer,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    /// `tinyloop.end_token_ids`: further tokens that end generation as end-of-sequence does.
    pub end_ids: Vec<u32>,
    pub add_bos_token: bool,
}

impl VocabData {
    /// No tokens, GPT-2's pre-tokenizer, ids 0.
    pub fn empty() -> Self {
        Self {
            tokens: Vec::new(),
            token_types: Vec::new(),
            merges: Vec::new(),
            pre: PreTokenizer::Gpt2,
            bos_token_id: 0,
            eos_token_id: 0,
            end_ids: Vec::new(),
            add_bos_token: false,
        }
    }
}

pub struct ModelFile {
    pub config: Config,
    pub vocab: VocabData,
    pub tensors: HashMap<String, QTensor>,
    /// "fp16" | "int8" | "int4" | "int2", from the looped block's tensor types: the type holding most of its
    /// weights (a quantizer's fallback type for a few tensors, like Q2_K's for rows not a multiple of 256, does not
    /// change the label); "mixed" only when no type holds a majority.
    pub quant: String,
    /// `tinyloop.draft.token_ids` and `tinyloop.exit.token_ids`: the tokens speculative drafts may propose and
    /// the tokens adaptive depth's settling rule compares loops over (`model::row_head`), each if listed.
    pub head_rows: HeadRows,
    /// `tokenizer.chat_template`: the Jinja template a chat is rendered with (as Hugging Face writes it), if any.
    pub chat_template: Option<String>,
    /// `tinyloop.generation.*`: the sampling settings the file recommends, by field name.
    pub generation: Vec<(String, f64)>,
}

/// The sampling fields a file may recommend (`tinyloop.generation.<field>`), each with its range.
pub const GENERATION_FIELDS: [(&str, f64, f64); 6] = [
    ("temperature", 0.0, 2.0),
    ("top_p", 0.0, 1.0),
    ("top_k", 0.0, MAX_TOP_K as f64),
    ("repetition_penalty", 0.5, 2.0),
    ("presence_penalty", -2.0, 2.0),
    ("frequency_penalty", -2.0, 2.0),
];

fn read_generation(r: &Reader) -> Result<Vec<(String, f64)>> {
    let mut out = Vec::new();
    for key in r.metadata.keys().filter(|k| k.starts_with("tinyloop.generation.")) {
        let field = &key["tinyloop.generation.".len()..];
        let Some(&(_, lo, hi)) = GENERATION_FIELDS.iter().find(|(f, ..)| *f == field) else {
            let known: Vec<&str> = GENERATION_FIELDS.iter().map(|(f, ..)| *f).collect();
            return Err(r.err(key, format!("not a generation field (known: {})", known.join(", "))));
        };
        let v = r.float(key)?;
        if !(lo..=hi).contains(&v) {
            return Err(r.err(key, format!("{v} is outside {lo}..={hi}")));
        }
        out.push((field.to_string(), v));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

struct Reader<'a> {
    path: &'a Path,
    metadata: HashMap<String, Value>,
}

impl Reader<'_> {
    fn err(&self, what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Format { path: self.path.to_path_buf(), what: what.into(), reason: reason.into() }
    }

    fn get(&self, key: &str) -> Result<&Value> {
        self.metadata.get(key).ok_or_else(|| self.err(key, "required key is missing"))
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
            Value::Float(v) => Ok(*v),
            v => as_u64(v).map(|u| u as f64).ok_or_else(|| self.err(key, "expected a number")),
        }
    }

    fn string(&self, key: &str) -> Result<&str> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            _ => Err(self.err(key, "expected a string")),
        }
    }

    /// A string array, moved out of the metadata (the vocabulary is its largest part: no second copy).
    fn take_strings(&mut self, key: &str) -> Result<Vec<String>> {
        match self.metadata.remove(key) {
            Some(Value::Strings(items)) => Ok(items),
            Some(v) if is_empty_array(&v) => Ok(Vec::new()),
            Some(_) => Err(self.err(key, "expected an array of strings")),
            None => Err(self.err(key, "required key is missing")),
        }
    }

    /// Length of an array, so a caller can check it before the elements are decoded.
    fn array_len(&self, key: &str) -> Result<usize> {
        match self.get(key)? {
            Value::Ints(a) => Ok(a.count()),
            Value::Strings(s) => Ok(s.len()),
            Value::Skipped(n) => Ok(*n as usize),
            _ => Err(self.err(key, "expected an array")),
        }
    }

    /// A non-empty list of distinct token ids, each inside the vocabulary.
    fn token_ids(&self, key: &str, vocab_size: usize) -> Result<Vec<u32>> {
        // Distinct ids below the vocabulary size are at most that many: refuse a longer list before decoding it.
        let n = self.array_len(key)?;
        if n > vocab_size {
            return Err(self.err(key, format!("{n} ids for a {vocab_size}-token vocabulary")));
        }
        let ids = self.ints(key)?;
        let mut seen = std::collections::HashSet::new();
        for &t in &ids {
            if t < 0 || t as usize >= vocab_size {
                return Err(self.err(key, format!("token id {t} is outside the {vocab_size}-token vocabulary")));
            }
            if !seen.insert(t) {
                return Err(self.err(key, format!("token id {t} is listed twice")));
            }
        }
        if ids.is_empty() {
            return Err(self.err(key, "the list is empty"));
        }
        Ok(ids.into_iter().map(|t| t as u32).collect())
    }

    fn ints(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key)? {
            Value::Ints(a) => {
                a.iter().map(|i| i64::try_from(i).map_err(|_| self.err(key, format!("{i} is out of range")))).collect()
            }
            v if is_empty_array(v) => Ok(Vec::new()),
            _ => Err(self.err(key, "expected an array of integers")),
        }
    }
}

/// An empty array is one of strings and one of integers, whatever element type the writer gave it.
fn is_empty_array(v: &Value) -> bool {
    match v {
        Value::Ints(a) => a.count() == 0,
        Value::Strings(s) => s.is_empty(),
        Value::Skipped(n) => *n == 0,
        _ => false,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

fn read_config(r: &Reader) -> Result<Config> {
    let arch = r.string("general.architecture")?;
    if arch != ARCH {
        return Err(r.err("general.architecture", format!("is {arch:?}, expected {ARCH:?}")));
    }
    let k = |s: &str| format!("{ARCH}.{s}");
    let dim = r.usize_in(&k("embedding_length"), 1, MAX_DIM)?;
    let n_heads = r.usize_in(&k("attention.head_count"), 1, MAX_HEADS)?;
    let n_kv_heads = r.usize_in(&k("attention.head_count_kv"), 1, MAX_HEADS)?;
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
        context_length: r.usize_in(&k("context_length"), 1, MAX_CONTEXT)?,
        dim,
        ffn_dim: r.usize_in(&k("feed_forward_length"), 1, MAX_FFN_DIM)?,
        n_heads,
        n_kv_heads,
        head_dim: dim / n_heads,
        rms_eps,
        rope_theta: rope_theta as f32,
        block_count: r.usize_in(&k("block_count"), 1, MAX_LAYERS as u64)?,
        prelude_count: r.usize_in(&k("prelude_count"), 0, MAX_LAYERS as u64)?,
        default_loops: r.usize_in(&k("loops.default"), 1, MAX_LOOPS as u64)?,
        max_trained_loops: r.usize_in(&k("loops.max_trained"), 1, MAX_LOOPS as u64)?,
        vocab_size: 0, // set from the tokenizer below
        file_type: r.uint("general.file_type")? as u32,
        attn_bias: false,  // set from the tensors below
        post_norms: false, // set from the tensors below
        exit_gate: false,  // set from the tensors below
        exit_threshold: read_exit_threshold(r)?,
        loop_norm: match r.metadata.get(LOOP_NORM) {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(r.err(LOOP_NORM, "expected a bool")),
        },
        rope_scaling: read_rope_scaling(r)?,
    })
}

/// `tinyloop.exit_threshold`, if the file has it: a finite number >= 0.
fn read_exit_threshold(r: &Reader) -> Result<Option<f32>> {
    if !r.metadata.contains_key(EXIT_THRESHOLD) {
        return Ok(None);
    }
    match r.float(EXIT_THRESHOLD)? {
        t if t.is_finite() && t >= 0.0 => Ok(Some(t as f32)),
        t => Err(r.err(EXIT_THRESHOLD, format!("{t} must be a finite number >= 0"))),
    }
}

/// `tinyloop.rope.scaling.type` and its parameters, if the file has them.
fn read_rope_scaling(r: &Reader) -> Result<Option<RopeScaling>> {
    let key = |s: &str| format!("{ARCH}.rope.scaling.{s}");
    let ty = key("type");
    if !r.metadata.contains_key(&ty) {
        return Ok(None);
    }
    let positive = |name: &str| -> Result<f64> {
        let v = r.float(&key(name))?;
        match v > 0.0 && v.is_finite() {
            true => Ok(v),
            false => Err(r.err(key(name), format!("{v} must be finite and > 0"))),
        }
    };
    match r.string(&ty)? {
        "linear" => Ok(Some(RopeScaling::Linear { factor: positive("factor")? })),
        "llama3" => {
            let (low_freq_factor, high_freq_factor) = (positive("low_freq_factor")?, positive("high_freq_factor")?);
            if high_freq_factor <= low_freq_factor {
                return Err(r.err(key("high_freq_factor"), "must be above low_freq_factor"));
            }
            Ok(Some(RopeScaling::Llama3 {
                factor: positive("factor")?,
                low_freq_factor,
                high_freq_factor,
                original_context: positive("original_context_length")?,
            }))
        }
        other => Err(r.err(ty, format!("is {other:?}; supported: linear, llama3"))),
    }
}

fn read_vocab(r: &mut Reader) -> Result<VocabData> {
    let model = r.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(r.err("tokenizer.ggml.model", format!("is {model:?}; only \"gpt2\" byte-level BPE is supported")));
    }
    let name = r.string("tokenizer.ggml.pre")?;
    let pre = PreTokenizer::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = PreTokenizer::NAMES.iter().map(|(n, _)| *n).collect();
        r.err("tokenizer.ggml.pre", format!("is {name:?}; supported: {}", known.join(", ")))
    })?;
    let tokens = r.take_strings("tokenizer.ggml.tokens")?;
    let n_types = r.array_len("tokenizer.ggml.token_type")?;
    if n_types != tokens.len() {
        return Err(r.err("tokenizer.ggml.token_type", format!("{n_types} entries for {} tokens", tokens.len())));
    }
    let token_types = r.ints("tokenizer.ggml.token_type")?;
    let merges = r.take_strings("tokenizer.ggml.merges")?;
    let n = tokens.len() as u64;
    let id = |key: &str| -> Result<u32> {
        let v = r.uint(key)?;
        if v >= n {
            return Err(r.err(key, format!("token id {v} is outside the {n}-token vocabulary")));
        }
        Ok(v as u32)
    };
    let end_ids = match r.metadata.contains_key(END_IDS) {
        true => r.token_ids(END_IDS, tokens.len())?,
        false => Vec::new(),
    };
    let add_bos_token = match r.metadata.get(ADD_BOS) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(r.err(ADD_BOS, "expected a bool")),
    };
    Ok(VocabData {
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: id("tokenizer.ggml.eos_token_id")?,
        tokens,
        token_types,
        merges,
        pre,
        end_ids,
        add_bos_token,
    })
}

const END_IDS: &str = "tinyloop.end_token_ids";
const LOOP_NORM: &str = "tinyloop.loop_norm";
const EXIT_THRESHOLD: &str = "tinyloop.exit_threshold";
const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

const CHAT_TEMPLATE: &str = "tokenizer.chat_template";
const DRAFT_IDS: &str = "tinyloop.draft.token_ids";
const EXIT_IDS: &str = "tinyloop.exit.token_ids";

/// The optional token lists of row heads: distinct token ids, each inside the vocabulary.
fn read_head_rows(r: &Reader, vocab_size: usize) -> Result<HeadRows> {
    let ids = |key| match r.metadata.contains_key(key) {
        true => r.token_ids(key, vocab_size).map(Some),
        false => Ok(None),
    };
    Ok(HeadRows { draft: ids(DRAFT_IDS)?, exit: ids(EXIT_IDS)? })
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
    if cfg.exit_gate {
        out.insert("exit_gate.weight".to_string(), vec![1, d]);
        out.insert("exit_gate.bias".to_string(), vec![1]);
    }
    for (prefix, count) in [("pre", cfg.prelude_count), ("blk", cfg.block_count)] {
        for i in 0..count {
            for (part, shape) in &layer {
                out.insert(format!("{prefix}.{i}.{part}.weight"), shape.clone());
            }
            if cfg.attn_bias {
                for (part, rows) in [("attn_q", d), ("attn_k", kv), ("attn_v", kv)] {
                    out.insert(format!("{prefix}.{i}.{part}.bias"), vec![rows]);
                }
            }
            if cfg.post_norms {
                for part in ["attn_post_norm", "ffn_post_norm"] {
                    out.insert(format!("{prefix}.{i}.{part}.weight"), vec![d]);
                }
            }
        }
    }
    out
}

fn allowed(dtype: GgmlDType, rank: usize) -> bool {
    use GgmlDType::*;
    match rank {
        1 => matches!(dtype, F32 | F16),
        _ => matches!(dtype, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q2K),
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
    load_from(path, BufReader::new(file))
}

/// `load` on any seekable source; `path` names it in errors.
fn load_from<R: Read + Seek>(path: &Path, reader: R) -> Result<ModelFile> {
    let not_gguf = |reason: String| Error::NotGguf { path: path.to_path_buf(), reason };
    let mut src = Source::new(reader).map_err(|e| not_gguf(e.to_string()))?;
    let Gguf { metadata, tensors: infos, data_offset } = gguf::read(&mut src, MAX_TENSORS).map_err(not_gguf)?;
    let mut r = Reader { path, metadata };
    let mut config = read_config(&r)?;
    let vocab = read_vocab(&mut r)?;
    config.vocab_size = vocab.tokens.len();

    let tied = !infos.contains_key("output.weight");
    config.attn_bias = infos.contains_key("blk.0.attn_q.bias");
    config.post_norms = infos.contains_key("blk.0.attn_post_norm.weight");
    config.exit_gate = infos.contains_key("exit_gate.weight");
    let expected = expected_tensors(&config, tied);
    if let Some(extra) = infos.keys().filter(|n| !expected.contains_key(*n)).min() {
        return Err(r.err(format!("tensor {extra}"), "not part of a tinyloop model with this config"));
    }
    let mut tensors = HashMap::new();
    let mut block_types = Vec::new();
    for (name, shape) in &expected {
        let info = infos.get(name).ok_or_else(|| r.err(format!("tensor {name}"), "missing"))?;
        check_tensor(&r, name, info, shape)?;
        let t = gguf::read_tensor(&mut src, info, data_offset).map_err(|e| r.err(format!("tensor {name}"), e))?;
        if name.starts_with("blk.") && shape.len() == 2 {
            block_types.push((info.dtype, shape.iter().product::<usize>()));
        }
        tensors.insert(name.clone(), t);
    }
    let quant = majority_label(&block_types);
    let head_rows = read_head_rows(&r, config.vocab_size)?;
    let chat_template = match r.metadata.contains_key(CHAT_TEMPLATE) {
        true => Some(r.string(CHAT_TEMPLATE)?.to_string()),
        false => None,
    };
    let generation = read_generation(&r)?;
    Ok(ModelFile { config, vocab, tensors, quant, head_rows, chat_template, generation })
}

/// A tensor the config implies has that shape, a type allowed for its rank, and rows of whole blocks.
fn check_tensor(r: &Reader, name: &str, info: &gguf::TensorInfo, shape: &[usize]) -> Result<()> {
    let got = info.dims.as_slice();
    if got != shape {
        let reason = if name == "token_embd.weight" && got.len() == 2 && got[1] == shape[1] {
            format!("has {} rows but the vocabulary has {} tokens", got[0], shape[0])
        } else {
            format!("shape {got:?}, expected {shape:?}")
        };
        return Err(r.err(format!("tensor {name}"), reason));
    }
    if !allowed(info.dtype, shape.len()) {
        return Err(r.err(format!("tensor {name}"), format!("unsupported type {:?}", info.dtype)));
    }
    let (block, row) = (info.dtype.block_size(), shape.last().copied().unwrap_or(1));
    if row % block != 0 {
        return Err(r.err(
            format!("tensor {name}"),
            format!("rows of {row} values are not a multiple of {:?}'s block of {block}", info.dtype),
        ));
    }
    Ok(())
}

/// The label of the type holding most of the looped block's weights; "mixed" when none holds a majority.
fn majority_label(block_types: &[(GgmlDType, usize)]) -> String {
    let mut by_label: BTreeMap<&str, usize> = BTreeMap::new();
    for (t, n) in block_types {
        *by_label.entry(quant_label(*t)).or_default() += n;
    }
    let total: usize = by_label.values().sum();
    by_label.iter().find(|(_, &n)| 2 * n > total).map_or("mixed", |(l, _)| *l).to_string()
}

#[cfg(test)]
mod tests {
    use super::gguf::tests::Writer;
    use super::*;
    use std::io::Cursor;

    enum V<'a> {
        U32(u32),
        F32(f32),
        Str(&'a str),
        Strs(&'a [&'a str]),
        I32s(&'a [i32]),
    }

    fn put(w: &mut Writer, key: &str, v: &V) {
        match v {
            V::U32(x) => w.key(key, 4).u32(*x),
            V::F32(x) => w.key(key, 6).u32(x.to_bits()),
            V::Str(s) => w.key(key, 8).str(s),
            V::Strs(items) => items.iter().fold(w.key(key, 9).u32(8).u64(items.len() as u64), |w, s| w.str(s)),
            V::I32s(items) => items.iter().fold(w.key(key, 9).u32(5).u64(items.len() as u64), |w, &i| w.u32(i as u32)),
        };
    }

    fn config(dim: usize, ffn_dim: usize) -> Config {
        Config {
            name: "m".into(),
            context_length: 16,
            dim,
            ffn_dim,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: dim,
            rms_eps: 1e-5,
            rope_theta: 1e4,
            block_count: 1,
            prelude_count: 0,
            default_loops: 1,
            max_trained_loops: 1,
            vocab_size: 1,
            file_type: 0,
            attn_bias: false,
            post_norms: false,
            exit_gate: false,
            exit_threshold: None,
            loop_norm: false,
            rope_scaling: None,
        }
    }

    /// A one-token, one-layer F32 model of width `dim`; without `data` the file ends where the tensor data would
    /// start, so every tensor it declares lies past its end.
    fn model(dim: usize, ffn_dim: usize, data: bool) -> Vec<u8> {
        let u = |x: usize| V::U32(x as u32);
        let kvs = [
            ("general.architecture", V::Str(ARCH)),
            ("general.name", V::Str("m")),
            ("general.file_type", u(0)),
            ("tinyloop.context_length", u(16)),
            ("tinyloop.embedding_length", u(dim)),
            ("tinyloop.feed_forward_length", u(ffn_dim)),
            ("tinyloop.attention.head_count", u(1)),
            ("tinyloop.attention.head_count_kv", u(1)),
            ("tinyloop.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("tinyloop.rope.freq_base", V::F32(1e4)),
            ("tinyloop.block_count", u(1)),
            ("tinyloop.prelude_count", u(0)),
            ("tinyloop.loops.default", u(1)),
            ("tinyloop.loops.max_trained", u(1)),
            ("tokenizer.ggml.model", V::Str("gpt2")),
            ("tokenizer.ggml.pre", V::Str("gpt-2")),
            ("tokenizer.ggml.tokens", V::Strs(&["a"])),
            ("tokenizer.ggml.token_type", V::I32s(&[1])),
            ("tokenizer.ggml.merges", V::Strs(&[])),
            ("tokenizer.ggml.bos_token_id", u(0)),
            ("tokenizer.ggml.eos_token_id", u(0)),
            ("tinyloop.draft.token_ids", V::I32s(&[0])),
        ];
        let tensors = expected_tensors(&config(dim, ffn_dim), true);
        let mut w = Writer::default();
        w.header(tensors.len() as u64, kvs.len() as u64);
        for (key, v) in &kvs {
            put(&mut w, key, v);
        }
        let (mut offset, mut end) = (0u64, 0u64);
        for (name, shape) in &tensors {
            w.tensor_info(name, &shape.iter().map(|&d| d as u64).collect::<Vec<_>>(), 0, offset);
            end = offset + shape.iter().product::<usize>() as u64 * 4;
            offset = end.next_multiple_of(32);
        }
        w.pad_to(32);
        if data {
            w.buf.resize(w.buf.len() + end as usize, 0); // the last tensor unpadded: every byte is needed
        }
        w.buf
    }

    fn load_bytes(bytes: &[u8]) -> Result<ModelFile> {
        load_from(Path::new("m.tinyloop"), Cursor::new(bytes))
    }

    fn load_err(bytes: &[u8]) -> String {
        match load_bytes(bytes) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    }

    /// Overwrite the 8 bytes `skip` bytes after the first occurrence of `needle`.
    fn patch_u64(bytes: &mut [u8], needle: &[u8], skip: usize, value: u64) {
        let at = bytes.windows(needle.len()).position(|w| w == needle).expect("needle") + needle.len() + skip;
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    #[test]
    fn minimal_model_loads() {
        let m = load_bytes(&model(2, 1, true)).unwrap();
        assert_eq!((m.config.dim, m.config.vocab_size, m.tensors.len(), m.quant.as_str()), (2, 1, 11, "fp16"));
        assert_eq!(m.head_rows, HeadRows { draft: Some(vec![0]), exit: None });
    }

    #[test]
    fn declared_tensor_bigger_than_the_file_is_refused_before_reading() {
        // dim 65536 and ffn 2^18 are within bounds: blk.0.attn_k alone declares 16 GiB in a 2 KB file.
        let bytes = model(1 << 16, 1 << 18, false);
        assert!(bytes.len() < 4096);
        let e = load_err(&bytes);
        assert!(
            e.contains("tensor blk.0.attn_k.weight: data of shape [65536, 65536] (F32): 17179869184 bytes needed"),
            "{e}"
        );
        assert!(e.contains("truncated"), "{e}");
        // Data cut anywhere: the tensor it cuts is named.
        let full = model(2, 1, true);
        let e = load_err(&full[..full.len() - 1]);
        assert!(e.contains("tensor token_embd.weight") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn string_or_array_length_larger_than_the_file_is_refused() {
        for huge in [u64::MAX, 1 << 40, 1 << 20] {
            let mut bytes = model(2, 1, true);
            patch_u64(&mut bytes, b"general.name", 4, huge); // the string's length
            let e = load_err(&bytes);
            assert!(e.contains("not a GGUF file: key general.name: "), "{e}");
            let mut bytes = model(2, 1, true);
            patch_u64(&mut bytes, b"tokenizer.ggml.tokens", 8, huge); // the array's count
            let e = load_err(&bytes);
            assert!(e.contains("key tokenizer.ggml.tokens: an array of"), "{e}");
            let mut bytes = model(2, 1, true);
            patch_u64(&mut bytes, b"GGUF", 4 + 8, huge); // the metadata count
            assert!(load_err(&bytes).contains("the header's"));
        }
    }

    #[test]
    fn overflowing_shape_product_is_a_shape_error() {
        for dims in [[1u64 << 32, 1 << 32], [1 << 62, 4], [u64::MAX, u64::MAX]] {
            let mut bytes = model(2, 1, true);
            // blk.0.attn_q.weight's info: name, then the dimension count, then its two dims.
            patch_u64(&mut bytes, b"blk.0.attn_q.weight", 4, dims[0]);
            patch_u64(&mut bytes, b"blk.0.attn_q.weight", 12, dims[1]);
            let e = load_err(&bytes);
            assert!(e.contains("tensor blk.0.attn_q.weight: shape ["), "{e}");
            assert!(e.contains("expected [2, 2]"), "{e}");
        }
    }

    #[test]
    fn array_longer_than_the_vocabulary_is_refused_before_decoding() {
        let mut w = Writer::default();
        w.key("tokenizer.ggml.token_type", 9).u32(0).u64(1 << 20);
        w.buf.resize(w.buf.len() + (1 << 20), 1);
        let mut bytes = model(2, 1, true);
        let at = bytes.windows(25).position(|x| x == b"tokenizer.ggml.token_type").unwrap() - 8;
        let end = at + 8 + 25 + 4 + 4 + 8 + 4;
        bytes.splice(at..end, w.buf);
        assert!(load_err(&bytes).contains("tokenizer.ggml.token_type: 1048576 entries for 1 tokens"));
    }

    #[test]
    fn every_truncation_and_bit_flip_is_an_error_or_a_model() {
        let bytes = model(2, 1, true);
        for n in 0..bytes.len() {
            assert!(load_bytes(&bytes[..n]).is_err(), "prefix {n}");
        }
        let mut flipped = bytes.clone();
        for bit in 0..bytes.len() * 8 {
            flipped[bit / 8] ^= 1 << (bit % 8);
            let _ = load_bytes(&flipped);
            flipped[bit / 8] ^= 1 << (bit % 8);
        }
    }
}
