//! The GGUF container (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): header, metadata, tensor infos,
//! and one tensor's data on request.
//!
//! The file is untrusted. Every count and length it declares is checked against the bytes that remain before
//! anything is allocated or looped over, and offsets and sizes use checked arithmetic, so a corrupt file costs at
//! most memory in proportion to its size and time in proportion to its length. Arrays are held compactly: integers
//! as their stored bytes, strings as one `String` each, floats and bools not at all (no key the loader reads is one).
//! candle's reader keeps every array element as a 32-byte value (a 4 MB byte array becomes 128 MB) and divides by
//! `general.alignment` unchecked, which is why the loader does not use it.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

/// Failures here are reasons; the loader adds the path.
pub type Parse<T> = std::result::Result<T, String>;

const DEFAULT_ALIGNMENT: u64 = 32;
/// GGUF's bound on a key's length; tensor names are held to it too.
const MAX_NAME_LEN: u64 = 65_535;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Least bytes of one metadata entry (key length, an empty key, value type, a one-byte value) and of one tensor
/// info (name length, an empty name, dimension count, type, offset): the header's counts must fit the file.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// A metadata value. Every integer width is `Int`.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    String(String),
    Ints(IntArray),
    Strings(Vec<String>),
    /// An array of floats or bools, skipped: only its length is kept.
    Skipped(u64),
}

/// An integer array as stored (little-endian, `ty`'s width): a u8 array takes one byte per element.
#[derive(Debug, Clone, PartialEq)]
pub struct IntArray {
    ty: Ty,
    raw: Vec<u8>,
}

impl IntArray {
    pub fn count(&self) -> usize {
        self.raw.len() / self.ty.width() as usize
    }

    pub fn iter(&self) -> impl Iterator<Item = i128> + '_ {
        self.raw.chunks_exact(self.ty.width() as usize).map(|b| int_le(self.ty, b))
    }
}

/// GGUF value types, by their numbers in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl Ty {
    fn from_u32(t: u32) -> Option<Self> {
        use Ty::*;
        [U8, I8, U16, I16, U32, I32, F32, Bool, String, Array, U64, I64, F64].get(t as usize).copied()
    }

    /// Bytes of one value on disk; for a string or an array, the least it can take (its length prefix, and an
    /// array's element type).
    fn width(self) -> u64 {
        use Ty::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// Little-endian integer of type `ty` from exactly `ty.width()` bytes.
fn int_le(ty: Ty, b: &[u8]) -> i128 {
    let mut le = [0u8; 8];
    le[..b.len()].copy_from_slice(b);
    let u = u64::from_le_bytes(le);
    match ty {
        Ty::I8 => u as u8 as i8 as i128,
        Ty::I16 => u as u16 as i16 as i128,
        Ty::I32 => u as u32 as i32 as i128,
        Ty::I64 => u as i64 as i128,
        _ => u as i128,
    }
}

/// ggml's tensor type numbers, for the types candle can hold.
fn ggml_type(t: u32) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match t {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        9 => Q8_1,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        15 => Q8K,
        30 => BF16,
        _ => return None,
    })
}

/// The file, its length, and the read position, so that every read is checked against what remains.
pub struct Source<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read + Seek> Source<R> {
    pub fn new(mut inner: R) -> std::io::Result<Self> {
        let len = inner.seek(SeekFrom::End(0))?;
        inner.seek(SeekFrom::Start(0))?;
        Ok(Self { inner, pos: 0, len })
    }

    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    /// Fail unless `n` more bytes exist (`what` names them), before anything of that size is allocated.
    fn need(&self, n: u64, what: impl FnOnce() -> String) -> Parse<()> {
        if n > self.remaining() {
            return Err(format!(
                "{}: {n} bytes needed at offset {}, but only {} remain; is the file truncated?",
                what(),
                self.pos,
                self.remaining()
            ));
        }
        Ok(())
    }

    fn bytes(&mut self, n: u64, what: impl FnOnce() -> String) -> Parse<Vec<u8>> {
        self.need(n, what)?;
        let mut buf = vec![0u8; usize::try_from(n).map_err(|_| format!("{n} bytes do not fit in memory"))?];
        self.fill(&mut buf)?;
        Ok(buf)
    }

    /// Read exactly `buf.len()` bytes, already known to remain.
    fn fill(&mut self, buf: &mut [u8]) -> Parse<()> {
        self.inner.read_exact(buf).map_err(|e| format!("read error at offset {}: {e}", self.pos))?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn skip(&mut self, n: u64, what: impl FnOnce() -> String) -> Parse<()> {
        self.need(n, what)?;
        self.seek_to(self.pos + n)
    }

    fn seek_to(&mut self, pos: u64) -> Parse<()> {
        self.inner.seek(SeekFrom::Start(pos)).map_err(|e| format!("seek error at offset {pos}: {e}"))?;
        self.pos = pos;
        Ok(())
    }

    fn int(&mut self, ty: Ty, what: impl FnOnce() -> String) -> Parse<i128> {
        self.need(ty.width(), what)?;
        let mut le = [0u8; 8];
        let le = &mut le[..ty.width() as usize];
        self.fill(le)?;
        Ok(int_le(ty, le))
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Parse<u32> {
        Ok(self.int(Ty::U32, what)? as u32)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Parse<u64> {
        Ok(self.int(Ty::U64, what)? as u64)
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, max: u64, what: impl Fn() -> String) -> Parse<String> {
        let n = self.u64(&what)?;
        if n > max {
            return Err(format!("{}: length {n} is over the limit of {max}", what()));
        }
        String::from_utf8(self.bytes(n, &what)?).map_err(|_| format!("{}: not valid UTF-8", what()))
    }
}

/// Where a tensor's data lies, relative to the data section, and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dtype: GgmlDType,
    /// Row-major, outermost first (the file's `ne`, reversed).
    pub dims: Vec<usize>,
    pub offset: u64,
}

impl TensorInfo {
    /// Bytes of data the shape and type need; `None` when the element count overflows or a row is not whole blocks.
    pub fn byte_len(&self) -> Option<u64> {
        let elems = self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
        let block = self.dtype.block_size() as u64;
        let whole_rows = self.dims.last().is_none_or(|&row| (row as u64).is_multiple_of(block));
        if !whole_rows || !elems.is_multiple_of(block) {
            return None;
        }
        (elems / block).checked_mul(self.dtype.type_size() as u64)
    }
}

#[derive(Debug)]
pub struct Gguf {
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    /// Where the data section starts: after the tensor infos, rounded up to `general.alignment`.
    pub data_offset: u64,
}

/// Header, metadata and tensor infos; at most `max_tensors` tensors are accepted.
pub fn read<R: Read + Seek>(src: &mut Source<R>, max_tensors: u64) -> Parse<Gguf> {
    let (n_tensors, n_kv) = read_header(src, max_tensors)?;
    let mut metadata = HashMap::new();
    for _ in 0..n_kv {
        let key = src.string(MAX_NAME_LEN, || "a metadata key".to_string())?;
        let ty = src.u32(|| format!("key {key}: value type"))?;
        let value = read_value(src, ty, &key)?;
        if metadata.contains_key(&key) {
            return Err(format!("key {key} appears twice"));
        }
        metadata.insert(key, value);
    }
    let mut tensors = HashMap::new();
    for _ in 0..n_tensors {
        let (name, info) = read_tensor_info(src)?;
        if tensors.contains_key(&name) {
            return Err(format!("tensor {name} appears twice"));
        }
        tensors.insert(name, info);
    }
    let alignment = alignment(&metadata)?;
    let data_offset = src.pos.checked_next_multiple_of(alignment).ok_or("the data section's offset overflows")?;
    Ok(Gguf { metadata, tensors, data_offset })
}

fn read_header<R: Read + Seek>(src: &mut Source<R>, max_tensors: u64) -> Parse<(u64, u64)> {
    let magic = src.bytes(4, || "the magic number".to_string())?;
    if magic != b"GGUF" {
        return Err(format!("magic is {magic:02x?}, not \"GGUF\""));
    }
    let version = src.u32(|| "the version".to_string())?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (2 or 3)"));
    }
    let n_tensors = src.u64(|| "the tensor count".to_string())?;
    let n_kv = src.u64(|| "the metadata count".to_string())?;
    if n_tensors > max_tensors {
        return Err(format!("the header declares {n_tensors} tensors; at most {max_tensors} are accepted"));
    }
    let least = n_kv.saturating_mul(MIN_KV_BYTES).saturating_add(n_tensors.saturating_mul(MIN_TENSOR_INFO_BYTES));
    src.need(least, || format!("the header's {n_kv} metadata entries and {n_tensors} tensor infos"))?;
    Ok((n_tensors, n_kv))
}

fn read_value<R: Read + Seek>(src: &mut Source<R>, ty: u32, key: &str) -> Parse<Value> {
    let what = || format!("key {key}");
    let ty = Ty::from_u32(ty).ok_or_else(|| format!("key {key}: unknown value type {ty}"))?;
    Ok(match ty {
        Ty::F32 => Value::Float(f32::from_bits(src.u32(what)?) as f64),
        Ty::F64 => Value::Float(f64::from_bits(src.u64(what)?)),
        Ty::Bool => match src.int(Ty::U8, what)? {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(format!("key {key}: {b} is not a bool")),
        },
        Ty::String => Value::String(src.string(u64::MAX, what)?),
        Ty::Array => read_array(src, key)?,
        int => Value::Int(src.int(int, what)?),
    })
}

fn read_array<R: Read + Seek>(src: &mut Source<R>, key: &str) -> Parse<Value> {
    let what = || format!("key {key}");
    let ty = src.u32(what)?;
    let ty = Ty::from_u32(ty).ok_or_else(|| format!("key {key}: unknown array element type {ty}"))?;
    let n = src.u64(what)?;
    let least = n.saturating_mul(ty.width());
    src.need(least, || format!("key {key}: an array of {n} {ty:?}"))?;
    Ok(match ty {
        // Strings take at least 8 bytes each, so `n` is bounded by the file (checked above).
        Ty::String => {
            Value::Strings((0..n).map(|i| src.string(u64::MAX, || format!("key {key}[{i}]"))).collect::<Parse<_>>()?)
        }
        Ty::Array => return Err(format!("key {key}: arrays of arrays are not supported")),
        Ty::F32 | Ty::F64 | Ty::Bool => {
            src.skip(least, what)?;
            Value::Skipped(n)
        }
        int => Value::Ints(IntArray { ty: int, raw: src.bytes(least, what)? }),
    })
}

fn read_tensor_info<R: Read + Seek>(src: &mut Source<R>) -> Parse<(String, TensorInfo)> {
    let name = src.string(MAX_NAME_LEN, || "a tensor name".to_string())?;
    let what = || format!("tensor {name}");
    let n_dims = src.u32(what)?;
    if n_dims > MAX_DIMS {
        return Err(format!("tensor {name}: {n_dims} dimensions; GGUF allows at most {MAX_DIMS}"));
    }
    let mut dims = (0..n_dims)
        .map(|_| {
            src.u64(what)
                .and_then(|d| usize::try_from(d).map_err(|_| format!("tensor {name}: dimension {d} is too large")))
        })
        .collect::<Parse<Vec<usize>>>()?;
    dims.reverse();
    let t = src.u32(what)?;
    let dtype = ggml_type(t).ok_or_else(|| format!("tensor {name}: unknown tensor type {t}"))?;
    let offset = src.u64(what)?;
    Ok((name, TensorInfo { dtype, dims, offset }))
}

/// `general.alignment`: a power of two; 32 when absent.
fn alignment(metadata: &HashMap<String, Value>) -> Parse<u64> {
    match metadata.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::Int(a)) if *a > 0 && *a <= u32::MAX as i128 && (*a as u64).is_power_of_two() => Ok(*a as u64),
        Some(Value::Int(a)) => Err(format!("general.alignment {a} is not a power of two below 2^32")),
        Some(_) => Err("general.alignment is not an integer".to_string()),
    }
}

/// One tensor's data, read once its whole extent is known to lie inside the file.
pub fn read_tensor<R: Read + Seek>(src: &mut Source<R>, info: &TensorInfo, data_offset: u64) -> Parse<QTensor> {
    let n = info
        .byte_len()
        .ok_or_else(|| format!("shape {:?} of {:?} overflows or is not whole blocks", info.dims, info.dtype))?;
    let start = data_offset.checked_add(info.offset).filter(|&s| s <= src.len);
    let Some(start) = start else {
        return Err(format!(
            "data offset {} is past the end of the file ({} bytes); is the file truncated?",
            info.offset, src.len
        ));
    };
    src.seek_to(start)?;
    let raw = src.bytes(n, || format!("data of shape {:?} ({:?})", info.dims, info.dtype))?;
    qtensor_from_ggml(info.dtype, &raw, info.dims.clone(), &Device::Cpu).map_err(|e| e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Cursor;

    /// A GGUF v3 file, written byte by byte, so tests can state exactly what a field holds.
    #[derive(Default)]
    pub(crate) struct Writer {
        pub buf: Vec<u8>,
    }

    impl Writer {
        pub fn u32(&mut self, v: u32) -> &mut Self {
            self.buf.extend(v.to_le_bytes());
            self
        }

        pub fn u64(&mut self, v: u64) -> &mut Self {
            self.buf.extend(v.to_le_bytes());
            self
        }

        pub fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64);
            self.buf.extend(s.as_bytes());
            self
        }

        pub fn header(&mut self, n_tensors: u64, n_kv: u64) -> &mut Self {
            self.buf.extend(b"GGUF");
            self.u32(3).u64(n_tensors).u64(n_kv)
        }

        /// A key and its value type; the value follows.
        pub fn key(&mut self, key: &str, ty: u32) -> &mut Self {
            self.str(key).u32(ty)
        }

        pub fn tensor_info(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims.iter().rev() {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }

        pub fn pad_to(&mut self, align: usize) -> &mut Self {
            self.buf.resize(self.buf.len().next_multiple_of(align), 0);
            self
        }
    }

    fn parse(bytes: &[u8]) -> Parse<Gguf> {
        read(&mut Source::new(Cursor::new(bytes)).unwrap(), 1000)
    }

    #[test]
    fn reads_values_and_tensor_infos() {
        let mut w = Writer::default();
        w.header(1, 5).key("a", 4).u32(7).key("b", 8).str("hé");
        w.key("c", 9).u32(0).u64(3).buf.extend([1, 255, 3]);
        w.key("d", 9).u32(8).u64(2).str("x").str("");
        w.key("e", 9).u32(6).u64(2).u64(0); // two f32s: skipped
        w.tensor_info("t", &[2, 3], 0, 0).pad_to(32).buf.extend([0u8; 24]);
        let g = parse(&w.buf).unwrap();
        assert_eq!(g.metadata["a"], Value::Int(7));
        assert_eq!(g.metadata["b"], Value::String("hé".into()));
        let Value::Ints(c) = &g.metadata["c"] else { panic!("{:?}", g.metadata["c"]) };
        assert_eq!(c.iter().collect::<Vec<_>>(), [1, 255, 3]);
        assert_eq!(g.metadata["d"], Value::Strings(vec!["x".into(), String::new()]));
        assert_eq!(g.metadata["e"], Value::Skipped(2));
        let t = &g.tensors["t"];
        assert_eq!(
            (t.dims.as_slice(), t.byte_len(), g.data_offset as usize),
            (&[2usize, 3][..], Some(24), w.buf.len() - 24)
        );
        let mut src = Source::new(Cursor::new(&w.buf)).unwrap();
        assert_eq!(read_tensor(&mut src, t, g.data_offset).unwrap().shape().dims(), &[2, 3]);
    }

    #[test]
    fn byte_arrays_stay_one_byte_per_element() {
        let n = 1 << 20;
        let mut w = Writer::default();
        w.header(0, 1).key("big", 9).u32(0).u64(n);
        w.buf.resize(w.buf.len() + n as usize, 7);
        let Value::Ints(a) = &parse(&w.buf).unwrap().metadata["big"] else { panic!() };
        assert_eq!((a.count(), a.raw.capacity()), (n as usize, n as usize));
    }

    #[test]
    fn counts_and_lengths_past_the_end_are_refused_before_allocating() {
        let huge = [u64::MAX, 1 << 62, 1 << 40, 1000];
        for n in huge {
            let err = |w: &Writer| parse(&w.buf).err().unwrap_or_else(|| panic!("{n} accepted"));
            assert!(err(Writer::default().header(0, n)).contains("the header's"));
            assert!(err(Writer::default().header(n.min(999), 1)).contains("bytes needed"));
            assert!(err(Writer::default().header(0, 1).key("s", 8).u64(n).u64(0)).contains("bytes needed"));
            for elem in [0, 8, 10] {
                let e = err(Writer::default().header(0, 1).key("a", 9).u32(elem).u64(n).u64(0));
                assert!(e.contains("key a: an array of"), "{e}");
            }
            assert!(err(Writer::default().header(0, 1).key("k", 9).u32(8).u64(2).u64(n).u64(0)).contains("key k[0]"));
        }
        assert!(parse(Writer::default().header(1001, 0).buf.as_slice()).unwrap_err().contains("at most 1000"));
    }

    #[test]
    fn malformed_structure_is_an_error() {
        let cases: [(&[u8], &str); 3] =
            [(b"GGUF", "version"), (b"GGML\x03\0\0\0", "magic"), (b"GGUF\x01\0\0\0", "version 1")];
        for (bytes, want) in cases {
            assert!(parse(bytes).unwrap_err().contains(want), "{want}");
        }
        let mut w = Writer::default();
        assert!(parse(&w.header(0, 1).key("x", 13).u32(0).buf).unwrap_err().contains("unknown value type 13"));
        let mut w = Writer::default();
        assert!(parse(&w.header(0, 1).key("x", 7).buf.iter().chain(&[2]).copied().collect::<Vec<_>>())
            .unwrap_err()
            .contains("not a bool"));
        let mut w = Writer::default();
        assert!(parse(&w.header(0, 1).key("x", 9).u32(9).u64(1).u32(0).u64(0).buf)
            .unwrap_err()
            .contains("arrays of arrays"));
        let mut w = Writer::default();
        assert!(parse(&w.header(0, 2).key("x", 4).u32(1).key("x", 4).u32(2).buf)
            .unwrap_err()
            .contains("x appears twice"));
        let mut w = Writer::default();
        assert!(parse(&w.header(0, 1).key("x", 8).u64(2).buf.iter().chain(&[0xff, 0xfe]).copied().collect::<Vec<_>>())
            .unwrap_err()
            .contains("UTF-8"));
        let mut w = Writer::default();
        assert!(parse(&w.header(1, 0).tensor_info("t", &[1; 5], 0, 0).buf).unwrap_err().contains("5 dimensions"));
        let mut w = Writer::default();
        assert!(parse(&w.header(1, 0).tensor_info("t", &[1], 4, 0).buf).unwrap_err().contains("unknown tensor type 4"));
        let mut w = Writer::default();
        assert!(parse(&w.header(2, 0).tensor_info("t", &[1], 0, 0).tensor_info("t", &[1], 0, 0).buf)
            .unwrap_err()
            .contains("twice"));
    }

    #[test]
    fn alignment_must_be_a_power_of_two() {
        for (a, ok) in [(0u32, false), (3, false), (1, true), (64, true), (1 << 31, true)] {
            let mut w = Writer::default();
            w.header(0, 1).key("general.alignment", 4).u32(a);
            let r = parse(&w.buf);
            assert_eq!(r.is_ok(), ok, "{a}");
            if let Ok(g) = r {
                assert_eq!(g.data_offset, (w.buf.len() as u64).next_multiple_of(a as u64));
            }
        }
    }

    #[test]
    fn overflowing_shape_product_is_an_error_not_a_wrap() {
        let info = |dims: Vec<usize>, dtype| TensorInfo { dtype, dims, offset: 0 };
        assert_eq!(info(vec![1 << 32, 1 << 32], GgmlDType::F32).byte_len(), None);
        assert_eq!(info(vec![1 << 40, 1 << 40, 1 << 40], GgmlDType::F16).byte_len(), None);
        assert_eq!(info(vec![usize::MAX / 2, 3], GgmlDType::F32).byte_len(), None);
        // No overflow in the count, but in the bytes: 2^62 f32s.
        assert_eq!(info(vec![1 << 31, 1 << 31], GgmlDType::F32).byte_len(), None);
        assert_eq!(info(vec![4, 31], GgmlDType::Q8_0).byte_len(), None); // rows are not whole blocks
        assert_eq!(info(vec![4, 64], GgmlDType::Q8_0).byte_len(), Some(4 * 2 * 34));
        let mut src = Source::new(Cursor::new(vec![0u8; 64])).unwrap();
        assert!(read_tensor(&mut src, &info(vec![1 << 32, 1 << 32], GgmlDType::F32), 0)
            .unwrap_err()
            .contains("overflows"));
    }

    #[test]
    fn tensor_data_past_the_end_is_refused_before_allocating() {
        let mut src = Source::new(Cursor::new(vec![0u8; 64])).unwrap();
        let at = |dims: Vec<usize>, offset| TensorInfo { dtype: GgmlDType::F32, dims, offset };
        for (info, data_offset) in [
            (at(vec![1 << 30, 1 << 20], 0), 32),
            (at(vec![9], 0), 32),
            (at(vec![1], u64::MAX), 32),
            (at(vec![1], 8), u64::MAX),
        ] {
            let e = read_tensor(&mut src, &info, data_offset).unwrap_err();
            assert!(e.contains("truncated"), "{e}");
        }
        assert!(read_tensor(&mut src, &at(vec![8], 0), 32).is_ok());
    }
}
