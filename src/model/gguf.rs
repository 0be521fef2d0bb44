//! GGUF reader and importer: turns a llama.cpp GGUF file (v2/v3) into an HF model directory
//! (`config.json`, `model.safetensors` in f32, `tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja`, `generation_config.json`) that the rest of the engine loads like any
//! other checkpoint (DESIGN.md §5).
//!
//! What it does, and nothing more:
//! - parses the header, every metadata value type (arrays included), the tensor infos, the
//!   alignment (`general.alignment`, default 32) and the data offset, over a memory map;
//! - dequantizes F32, F16, BF16, Q4_0, Q4_1 and Q8_0 to f32 with ggml's block layouts and ggml's
//!   own float32 arithmetic (so the result is bit-identical to `gguf-py`/transformers);
//! - maps llama.cpp tensor names to HF Llama names and undoes llama.cpp's Q/K row interleave;
//! - rebuilds a byte-level BPE `tokenizer.json` from `tokenizer.ggml.*` (model `gpt2`).
//!
//! Only the `llama` architecture and the `gpt2` tokenizer model are supported; anything else is a
//! clear error, raised before a single output file is written.
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What [`import_gguf`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportSummary {
    /// Tensors written to `model.safetensors`.
    pub tensors: usize,
    /// Total number of parameters (f32 values) written.
    pub params: usize,
    /// The GGUF's `general.architecture`.
    pub arch: String,
}

impl fmt::Display for ImportSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} tensors, {} parameters, architecture {}",
            self.tensors, self.params, self.arch
        )
    }
}

/// Architectures [`import_gguf`] can convert.
pub const SUPPORTED_ARCHS: &[&str] = &["llama"];

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

// ---------------------------------------------------------------------------------------------
// Metadata values
// ---------------------------------------------------------------------------------------------

/// One GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as a u64 if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as an i64 if it is an integer of any width that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v as i64),
            GgufValue::U16(v) => Some(v as i64),
            GgufValue::U32(v) => Some(v as i64),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }
    /// The value as f64 if it is a float (f32 values are widened exactly) or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
    fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::F32(_) => "float32",
            GgufValue::Bool(_) => "bool",
            GgufValue::Str(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F64(_) => "float64",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ggml tensor types
// ---------------------------------------------------------------------------------------------

/// The ggml tensor types this reader dequantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

impl GgmlType {
    /// The supported type with this ggml number, if any.
    pub fn from_u32(t: u32) -> Option<GgmlType> {
        Some(match t {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }
    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q8_0 => 2 + 32,
        }
    }
}

/// ggml's name for a type number, for error messages.
fn ggml_type_name(t: u32) -> &'static str {
    const NAMES: &[&str] = &[
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2 (removed)",
        "Q4_3 (removed)",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4 (removed)",
        "Q4_0_4_8 (removed)",
        "Q4_0_8_8 (removed)",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4 (removed)",
        "IQ4_NL_4_8 (removed)",
        "IQ4_NL_8_8 (removed)",
        "MXFP4",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown")
}

const SUPPORTED_TYPES_MSG: &str =
    "supported: F32 (0), F16 (1), Q4_0 (2), Q4_1 (3), Q8_0 (8), BF16 (30)";

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantize `out.len()` elements of type `ty` from `data` (exactly the tensor's bytes).
///
/// The arithmetic is ggml's: f16 scales widened to f32, then `d*q` (Q8_0), `d*(q-8)` (Q4_0) or
/// `d*q + m` (Q4_1) in f32, one rounding per operation (no fused multiply-add).
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let n = out.len();
    let be = ty.block_elems();
    if n % be != 0 {
        bail!("{n} elements is not a multiple of the {ty:?} block size {be}");
    }
    let need = n / be * ty.block_bytes();
    if data.len() != need {
        bail!(
            "{ty:?} data is {} bytes, expected {need} for {n} elements",
            data.len()
        );
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
                let d = f16_at(b, 0);
                let qs = &b[2..18];
                for j in 0..16 {
                    o[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    o[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qs = &b[4..20];
                for j in 0..16 {
                    o[j] = (qs[j] & 0x0F) as f32 * d + m;
                    o[j + 16] = (qs[j] >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..32 {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The file
// ---------------------------------------------------------------------------------------------

/// One tensor's entry in the GGUF tensor-info table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// The raw ggml type number.
    pub ggml_type: u32,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> Option<usize> {
        self.dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
    }
    /// The row-major (PyTorch/HF) shape: GGUF dims reversed.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Bytes {
    Map(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file over its (memory-mapped) bytes.
pub struct GgufFile {
    source: String,
    bytes: Bytes,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, GgufValue)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    source: &'a str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn fmt::Display) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(end) => {
                let s = &self.b[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(anyhow!(
                "{}: truncated GGUF file: need {n} bytes for {what} at offset {}, but the file is {} bytes",
                self.source,
                self.pos,
                self.b.len()
            )),
        }
    }
    fn u8(&mut self, what: &dyn fmt::Display) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &dyn fmt::Display) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &dyn fmt::Display) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn fmt::Display) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
    /// A count that is to be followed by at least `min_each` bytes per item.
    fn count(&mut self, min_each: usize, what: &dyn fmt::Display) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(min_each) <= self.remaining());
        fits.ok_or_else(|| {
            anyhow!(
                "{}: truncated or corrupt GGUF file: {what} at offset {at} says {n} items, \
                 more than the {} bytes left can hold",
                self.source,
                self.remaining()
            )
        })
    }
    fn string(&mut self, what: &dyn fmt::Display) -> Result<String> {
        let len = self.count(1, what)?;
        let at = self.pos;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|e| {
            anyhow!(
                "{}: {what} at offset {at} is not valid UTF-8: {e}",
                self.source
            )
        })
    }
    fn value(&mut self, ty: u32, what: &dyn fmt::Display, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.u8(what)?),
            1 => GgufValue::I8(self.u8(what)? as i8),
            2 => GgufValue::U16(self.u16(what)?),
            3 => GgufValue::I16(self.u16(what)? as i16),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(self.u32(what)? as i32),
            6 => GgufValue::F32(f32::from_bits(self.u32(what)?)),
            7 => GgufValue::Bool(self.u8(what)? != 0),
            8 => GgufValue::Str(self.string(what)?),
            9 => {
                if depth > 8 {
                    bail!("{}: {what}: arrays nested more than 8 deep", self.source);
                }
                let at = self.pos;
                let ety = self.u32(what)?;
                let min_each = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => bail!(
                        "{}: {what} at offset {at}: unknown array element type {ety} (valid: 0..=12)",
                        self.source
                    ),
                };
                let n = self.count(min_each, what)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(ety, what, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(self.u64(what)? as i64),
            12 => GgufValue::F64(f64::from_bits(self.u64(what)?)),
            _ => bail!(
                "{}: {what} at offset {}: unknown metadata value type {ty} (valid: 0..=12)",
                self.source,
                self.pos.saturating_sub(4)
            ),
        })
    }
}

impl GgufFile {
    /// Memory-map and parse a GGUF file.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let source = path.display().to_string();
        let file = File::open(path).with_context(|| format!("{source}: cannot open GGUF file"))?;
        let len = file
            .metadata()
            .with_context(|| format!("{source}: cannot stat"))?
            .len();
        if len == 0 {
            bail!("{source}: truncated GGUF file: the file is empty");
        }
        // SAFETY: the map is read-only; the usual caveat (another process truncating the file
        // while we read it) applies to every mmap-based model loader.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("{source}: cannot mmap"))?;
        Self::parse(source, Bytes::Map(map))
    }

    /// Parse a GGUF image held in memory; `source` names it in error messages.
    pub fn from_bytes(bytes: Vec<u8>, source: &str) -> Result<GgufFile> {
        Self::parse(source.to_string(), Bytes::Owned(bytes))
    }

    fn parse(source: String, bytes: Bytes) -> Result<GgufFile> {
        let b: &[u8] = &bytes;
        if b.len() < 4 {
            bail!(
                "{source}: truncated GGUF file: {} bytes, too short for the magic",
                b.len()
            );
        }
        if &b[..4] != GGUF_MAGIC {
            bail!(
                "{source}: not a GGUF file: bad magic {:02x?} ({:?}), expected \"GGUF\"",
                &b[..4],
                String::from_utf8_lossy(&b[..4])
            );
        }
        let mut c = Cursor {
            b,
            pos: 4,
            source: &source,
        };
        let version = c.u32(&"the version")?;
        if version != 2 && version != 3 {
            if version & 0xFFFF == 0 && version.swap_bytes() <= 3 {
                bail!(
                    "{source}: big-endian GGUF (version {}) is not supported",
                    version.swap_bytes()
                );
            }
            bail!("{source}: unsupported GGUF version {version} (supported: 2, 3)");
        }
        let n_tensors = c.count(24, &"the tensor count")?;
        let n_kv = c.count(13, &"the metadata count")?;
        let mut metadata = Vec::with_capacity(n_kv);
        let mut index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            let key = c.string(&format_args!("metadata key #{i}"))?;
            let what = format!("metadata value `{key}`");
            let ty = c.u32(&what)?;
            let v = c.value(ty, &what, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                bail!("{source}: duplicate metadata key `{key}`");
            }
            metadata.push((key, v));
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut names = BTreeSet::new();
        for i in 0..n_tensors {
            let name = c.string(&format_args!("the name of tensor #{i}"))?;
            let what = format!("the info of tensor `{name}`");
            let at = c.pos;
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > 8 {
                bail!("{source}: tensor `{name}` (offset {at}) has {n_dims} dimensions (expected 1..=4)");
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let ggml_type = c.u32(&what)?;
            let offset = c.u64(&what)?;
            if !names.insert(name.clone()) {
                bail!("{source}: duplicate tensor name `{name}`");
            }
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    bail!("{source}: general.alignment must be a positive power of two, got {v:?}")
                }
            },
        };
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let f = GgufFile {
            source,
            bytes,
            version,
            metadata,
            index,
            tensors,
            alignment,
            data_offset,
        };
        // Every tensor of a known type must lie inside the file.
        for t in &f.tensors {
            if let Some(ty) = GgmlType::from_u32(t.ggml_type) {
                f.tensor_range(t, ty)?;
            }
        }
        Ok(f)
    }

    /// The file name used in messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn tensor_type(&self, t: &GgufTensorInfo) -> Result<GgmlType> {
        GgmlType::from_u32(t.ggml_type).ok_or_else(|| {
            anyhow!(
                "{}: tensor `{}` has unsupported ggml type {} ({}); {SUPPORTED_TYPES_MSG}",
                self.source,
                t.name,
                t.ggml_type,
                ggml_type_name(t.ggml_type)
            )
        })
    }

    fn tensor_range(&self, t: &GgufTensorInfo, ty: GgmlType) -> Result<std::ops::Range<usize>> {
        let n = t.n_elements().ok_or_else(|| {
            anyhow!(
                "{}: tensor `{}` dims {:?} overflow",
                self.source,
                t.name,
                t.dims
            )
        })?;
        let be = ty.block_elems();
        if t.dims[0] % be as u64 != 0 {
            bail!(
                "{}: tensor `{}` ({ty:?}) has row length {} that is not a multiple of the block size {be}",
                self.source,
                t.name,
                t.dims[0]
            );
        }
        let nbytes = n / be * ty.block_bytes();
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(nbytes as u64));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => Ok(s as usize..e as usize),
            _ => bail!(
                "{}: truncated GGUF file: tensor `{}` needs bytes {}..{} (data section at {} + offset {} + {nbytes} bytes), \
                 but the file is {} bytes",
                self.source,
                t.name,
                self.data_offset as u128 + t.offset as u128,
                self.data_offset as u128 + t.offset as u128 + nbytes as u128,
                self.data_offset,
                t.offset,
                self.bytes.len()
            ),
        }
    }

    /// The tensor's raw bytes and its (supported) type.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> Result<(GgmlType, &[u8])> {
        let ty = self.tensor_type(t)?;
        let r = self.tensor_range(t, ty)?;
        Ok((ty, &self.bytes[r]))
    }

    /// The tensor dequantized to f32, in GGUF (= row-major HF) element order.
    pub fn tensor_f32(&self, t: &GgufTensorInfo) -> Result<Vec<f32>> {
        let (ty, raw) = self.tensor_bytes(t)?;
        let mut out = vec![0f32; t.n_elements().unwrap_or(0)];
        dequantize(ty, raw, &mut out)
            .with_context(|| format!("{}: tensor `{}`", self.source, t.name))?;
        Ok(out)
    }
}

// ---------------------------------------------------------------------------------------------
// Llama mapping
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Permute {
    None,
    /// Undo llama.cpp's interleave with this many heads.
    Q,
    K,
}

/// Map a llama.cpp tensor name to its HF Llama name.
fn hf_llama_name(name: &str) -> Option<(String, Permute)> {
    match name {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), Permute::None)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), Permute::None)),
        "output.weight" => return Some(("lm_head.weight".into(), Permute::None)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.split_once('.')?;
    if suffix != "weight" {
        return None;
    }
    let (hf, p) = match part {
        "attn_norm" => ("input_layernorm", Permute::None),
        "attn_q" => ("self_attn.q_proj", Permute::Q),
        "attn_k" => ("self_attn.k_proj", Permute::K),
        "attn_v" => ("self_attn.v_proj", Permute::None),
        "attn_output" => ("self_attn.o_proj", Permute::None),
        "ffn_norm" => ("post_attention_layernorm", Permute::None),
        "ffn_gate" => ("mlp.gate_proj", Permute::None),
        "ffn_up" => ("mlp.up_proj", Permute::None),
        "ffn_down" => ("mlp.down_proj", Permute::None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}.weight"), p))
}

/// Undo llama.cpp's Q/K row interleave of a row-major `[n_heads * head_dim, cols]` matrix.
///
/// llama.cpp's converter stores, within each head, HF row `a * head_dim/2 + j` at row `2j + a`
/// (it interleaves the two rotary halves). So the HF rows are the stored rows taken in the order
/// `0, 2, 4, …, 1, 3, 5, …`: `hf_row[i] = stored_row[perm[i]]`.
pub fn unpermute_qk_rows(stored: &[f32], n_heads: usize, cols: usize) -> Result<Vec<f32>> {
    if n_heads == 0 || cols == 0 || stored.len() % (n_heads * cols) != 0 {
        bail!(
            "cannot split {} values into {n_heads} heads of rows of {cols}",
            stored.len()
        );
    }
    let rows = stored.len() / cols;
    let hd = rows / n_heads;
    if hd % 2 != 0 {
        bail!("head_dim {hd} is odd; cannot undo the rotary interleave");
    }
    let half = hd / 2;
    let mut out = vec![0f32; stored.len()];
    for h in 0..n_heads {
        for i in 0..hd {
            let src = if i < half { 2 * i } else { 2 * (i - half) + 1 };
            let d = (h * hd + i) * cols;
            let s = (h * hd + src) * cols;
            out[d..d + cols].copy_from_slice(&stored[s..s + cols]);
        }
    }
    Ok(out)
}

struct LlamaHparams {
    hidden: usize,
    layers: usize,
    ffn: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    eps: f64,
    rope_theta: f64,
    ctx: usize,
    vocab: usize,
}

fn get_usize(g: &GgufFile, key: &str) -> Result<Option<usize>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| {
                anyhow!(
                    "{}: metadata `{key}` should be an unsigned integer, got {v:?}",
                    g.source
                )
            }),
    }
}

fn req_usize(g: &GgufFile, key: &str) -> Result<usize> {
    get_usize(g, key)?.ok_or_else(|| anyhow!("{}: required metadata `{key}` is missing", g.source))
}

fn get_f64(g: &GgufFile, key: &str) -> Result<Option<f64>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            anyhow!(
                "{}: metadata `{key}` should be a number, got {v:?}",
                g.source
            )
        }),
    }
}

fn get_str<'a>(g: &'a GgufFile, key: &str) -> Result<Option<&'a str>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            anyhow!(
                "{}: metadata `{key}` should be a string, got {}",
                g.source,
                v.type_name()
            )
        }),
    }
}

fn llama_hparams(g: &GgufFile, arch: &str, n_tokens: usize) -> Result<LlamaHparams> {
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = req_usize(g, &k("embedding_length"))?;
    let layers = req_usize(g, &k("block_count"))?;
    let ffn = req_usize(g, &k("feed_forward_length"))?;
    let n_head = req_usize(g, &k("attention.head_count"))?;
    let n_head_kv = get_usize(g, &k("attention.head_count_kv"))?.unwrap_or(n_head);
    if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        bail!(
            "{}: head_count {n_head} is not a positive multiple of head_count_kv {n_head_kv}",
            g.source
        );
    }
    let head_dim = match get_usize(g, &k("attention.key_length"))? {
        Some(d) => d,
        None => {
            if hidden % n_head != 0 {
                bail!(
                    "{}: embedding_length {hidden} is not divisible by head_count {n_head}",
                    g.source
                );
            }
            hidden / n_head
        }
    };
    if let Some(vd) = get_usize(g, &k("attention.value_length"))? {
        if vd != head_dim {
            bail!(
                "{}: attention.value_length {vd} differs from key_length {head_dim}: unsupported",
                g.source
            );
        }
    }
    if let Some(rd) = get_usize(g, &k("rope.dimension_count"))? {
        if rd != head_dim {
            bail!("{}: partial rotary (rope.dimension_count {rd} != head_dim {head_dim}) is not supported", g.source);
        }
    }
    if let Some(st) = get_str(g, &k("rope.scaling.type"))? {
        if st != "none" {
            bail!(
                "{}: rope scaling `{st}` is not supported (only unscaled rope)",
                g.source
            );
        }
    }
    let eps = get_f64(g, &k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| {
        anyhow!(
            "{}: required metadata `{}` is missing",
            g.source,
            k("attention.layer_norm_rms_epsilon")
        )
    })?;
    let rope_theta = get_f64(g, &k("rope.freq_base"))?.unwrap_or(10000.0);
    let ctx = get_usize(g, &k("context_length"))?.unwrap_or(2048);
    let vocab = get_usize(g, &k("vocab_size"))?.unwrap_or(n_tokens);
    Ok(LlamaHparams {
        hidden,
        layers,
        ffn,
        n_head,
        n_head_kv,
        head_dim,
        eps,
        rope_theta,
        ctx,
        vocab,
    })
}

// ---------------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------------

struct TokenizerFiles {
    tokenizer_json: Value,
    tokens: Vec<String>,
}

fn string_array(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    let v = g
        .get(key)
        .ok_or_else(|| anyhow!("{}: required metadata `{key}` is missing", g.source))?;
    let a = v
        .as_array()
        .ok_or_else(|| anyhow!("{}: `{key}` should be an array of strings", g.source))?;
    a.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_str().map(str::to_string).ok_or_else(|| {
                anyhow!(
                    "{}: `{key}`[{i}] should be a string, got {}",
                    g.source,
                    x.type_name()
                )
            })
        })
        .collect()
}

fn build_tokenizer(g: &GgufFile) -> Result<TokenizerFiles> {
    let model = get_str(g, "tokenizer.ggml.model")?.ok_or_else(|| {
        anyhow!(
            "{}: required metadata `tokenizer.ggml.model` is missing",
            g.source
        )
    })?;
    if model != "gpt2" {
        bail!(
            "{}: tokenizer model `{model}` is not supported (supported: gpt2, i.e. byte-level BPE)",
            g.source
        );
    }
    let tokens = string_array(g, "tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => {
            let a = v.as_array().ok_or_else(|| {
                anyhow!(
                    "{}: `tokenizer.ggml.token_type` should be an array",
                    g.source
                )
            })?;
            a.iter()
                .map(|x| {
                    x.as_i64().ok_or_else(|| {
                        anyhow!(
                            "{}: `tokenizer.ggml.token_type` should hold integers",
                            g.source
                        )
                    })
                })
                .collect::<Result<_>>()?
        }
    };
    if types.len() != tokens.len() {
        bail!(
            "{}: {} token types for {} tokens",
            g.source,
            types.len(),
            tokens.len()
        );
    }
    let merges_raw = string_array(g, "tokenizer.ggml.merges")?;
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        let mut parts = m.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                merges.push(json!([a, b]))
            }
            _ => bail!(
                "{}: merge #{i} {m:?} is not two tokens separated by a single space",
                g.source
            ),
        }
    }
    let mut vocab = Map::new();
    for (id, t) in tokens.iter().enumerate() {
        // A duplicated token string keeps its first id (HF's vocab is a map).
        vocab.entry(t.clone()).or_insert(json!(id));
    }
    let mut added = Vec::new();
    for (id, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        // llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id,
                "content": t,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": ty == 3,
            }));
        }
    }
    // Post-processor: `$A` (and `$A $B`), framed by bos/eos when the GGUF asks for them.
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let add_eos = g
        .get("tokenizer.ggml.add_eos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let special_tok = |key: &str| -> Result<(usize, String)> {
        let id = get_usize(g, key)?.ok_or_else(|| {
            anyhow!(
                "{}: `{key}` is needed (add_*_token is true) but missing",
                g.source
            )
        })?;
        let t = tokens
            .get(id)
            .ok_or_else(|| anyhow!("{}: `{key}` {id} is outside the vocabulary", g.source))?;
        Ok((id, t.clone()))
    };
    let bos = if add_bos {
        Some(special_tok("tokenizer.ggml.bos_token_id")?)
    } else {
        None
    };
    let eos = if add_eos {
        Some(special_tok("tokenizer.ggml.eos_token_id")?)
    } else {
        None
    };
    let mut specials = Map::new();
    for (id, t) in bos.iter().chain(eos.iter()) {
        specials.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    let frame = |seq: &str, type_id: u32| -> Vec<Value> {
        let mut v = Vec::new();
        if let Some((_, t)) = &bos {
            v.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
        v.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
        if let Some((_, t)) = &eos {
            v.push(json!({"SpecialToken": {"id": t, "type_id": type_id}}));
        }
        v
    };
    let single = frame("A", 0);
    let pair: Vec<Value> = frame("A", 0).into_iter().chain(frame("B", 1)).collect();
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });
    Ok(TokenizerFiles {
        tokenizer_json,
        tokens,
    })
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Create `path` atomically: `write` fills a temp file in the same directory, which is synced and
/// renamed over `path`; on failure the temp file is removed.
fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = tmp_path(path);
    let r = write(&tmp).and_then(|_| {
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("cannot sync {}", tmp.display()))?;
        fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
    });
    if r.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    r
}

fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f =
            File::create(tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        Ok(())
    })
}

fn write_json_atomic(path: &Path, v: &Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    write_bytes_atomic(path, s.as_bytes())
}

/// transformers' `VERY_LARGE_INTEGER` (`int(1e30)`), written as an exact integer like HF does.
const MODEL_MAX_LENGTH_PLACEHOLDER: &str = "@@infomem:model_max_length@@";
const VERY_LARGE_INTEGER: &str = "1000000000000000019884624838656";

/// Read a GGUF file (v2/v3) and write an HF model directory: config.json, model.safetensors (f32),
/// tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json.
///
/// Everything is validated (architecture, tokenizer, tensor names, types, shapes) before the first
/// file is written. Each file is written atomically; `model.safetensors` is written last but one
/// and `config.json` last, and a `config.json` (and `.import-ok` marker) left by an earlier import
/// is removed first, so an interrupted import never leaves a directory that looks complete.
pub fn import_gguf(gguf: &Path, out_dir: &Path) -> Result<ImportSummary> {
    let g = GgufFile::open(gguf)?;
    let src = g.source.clone();

    let arch = get_str(&g, "general.architecture")?
        .ok_or_else(|| anyhow!("{src}: required metadata `general.architecture` is missing"))?
        .to_string();
    if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
        bail!(
            "{src}: unsupported architecture `{arch}` (supported: {})",
            SUPPORTED_ARCHS.join(", ")
        );
    }

    let tok = build_tokenizer(&g)?;
    let hp = llama_hparams(&g, &arch, tok.tokens.len())?;
    if hp.vocab != tok.tokens.len() {
        bail!(
            "{src}: {arch}.vocab_size {} differs from the {} tokens of the tokenizer",
            hp.vocab,
            tok.tokens.len()
        );
    }

    // Map and check every tensor before writing anything.
    let q_rows = hp.n_head * hp.head_dim;
    let kv_rows = hp.n_head_kv * hp.head_dim;
    let mut plan: Vec<(&GgufTensorInfo, String, Permute)> = Vec::with_capacity(g.tensors.len());
    for t in &g.tensors {
        let (hf, p) = hf_llama_name(&t.name).ok_or_else(|| {
            anyhow!(
                "{src}: tensor `{}` has no HF Llama equivalent (unexpected for `{arch}`)",
                t.name
            )
        })?;
        g.tensor_type(t)?;
        plan.push((t, hf, p));
    }
    let have: HashMap<&str, &GgufTensorInfo> =
        plan.iter().map(|(t, hf, _)| (hf.as_str(), *t)).collect();
    let mut expect: Vec<(String, Vec<usize>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![hp.vocab, hp.hidden],
        ),
        ("model.norm.weight".into(), vec![hp.hidden]),
    ];
    for l in 0..hp.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        expect.push((p("input_layernorm"), vec![hp.hidden]));
        expect.push((p("self_attn.q_proj"), vec![q_rows, hp.hidden]));
        expect.push((p("self_attn.k_proj"), vec![kv_rows, hp.hidden]));
        expect.push((p("self_attn.v_proj"), vec![kv_rows, hp.hidden]));
        expect.push((p("self_attn.o_proj"), vec![hp.hidden, q_rows]));
        expect.push((p("post_attention_layernorm"), vec![hp.hidden]));
        expect.push((p("mlp.gate_proj"), vec![hp.ffn, hp.hidden]));
        expect.push((p("mlp.up_proj"), vec![hp.ffn, hp.hidden]));
        expect.push((p("mlp.down_proj"), vec![hp.hidden, hp.ffn]));
    }
    let tied = !have.contains_key("lm_head.weight");
    if !tied {
        expect.push(("lm_head.weight".into(), vec![hp.vocab, hp.hidden]));
    }
    for (name, shape) in &expect {
        let t = have
            .get(name.as_str())
            .ok_or_else(|| anyhow!("{src}: tensor for `{name}` is missing"))?;
        if &t.hf_shape() != shape {
            bail!(
                "{src}: tensor `{}` ({name}) has HF shape {:?}, expected {shape:?}",
                t.name,
                t.hf_shape()
            );
        }
    }
    if expect.len() != plan.len() {
        let known: BTreeSet<&str> = expect.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&str> = plan
            .iter()
            .filter(|(_, hf, _)| !known.contains(hf.as_str()))
            .map(|(t, _, _)| t.name.as_str())
            .collect();
        bail!(
            "{src}: unexpected tensors for {} layers: {extra:?}",
            hp.layers
        );
    }

    // Token ids for the configs.
    let id_of = |key: &str| -> Result<Option<usize>> {
        let id = get_usize(&g, key)?;
        if let Some(id) = id {
            if id >= tok.tokens.len() {
                bail!(
                    "{src}: `{key}` = {id} is outside the vocabulary of {}",
                    tok.tokens.len()
                );
            }
        }
        Ok(id)
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let pad = id_of("tokenizer.ggml.padding_token_id")?;
    let unk = id_of("tokenizer.ggml.unknown_token_id")?;
    let chat_template = get_str(&g, "tokenizer.chat_template")?;

    // Output directory: make sure it can't look complete while we write.
    fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create output directory {}", out_dir.display()))?;
    for stale in ["config.json", ".import-ok"] {
        let p = out_dir.join(stale);
        if p.exists() {
            fs::remove_file(&p).with_context(|| format!("cannot remove stale {}", p.display()))?;
        }
    }

    // Tokenizer files.
    write_json_atomic(&out_dir.join("tokenizer.json"), &tok.tokenizer_json)?;
    let mut tc = Map::new();
    tc.insert("backend".into(), json!("tokenizers"));
    tc.insert("tokenizer_class".into(), json!("TokenizersBackend"));
    tc.insert(
        "model_max_length".into(),
        json!(MODEL_MAX_LENGTH_PLACEHOLDER),
    );
    for (k, id) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("pad_token", pad),
        ("unk_token", unk),
    ] {
        if let Some(id) = id {
            tc.insert(k.into(), json!(tok.tokens[id]));
        }
    }
    let tc_text = serde_json::to_string_pretty(&Value::Object(tc))?.replace(
        &format!("\"{MODEL_MAX_LENGTH_PLACEHOLDER}\""),
        VERY_LARGE_INTEGER,
    ) + "\n";
    write_bytes_atomic(&out_dir.join("tokenizer_config.json"), tc_text.as_bytes())?;
    let ct_path = out_dir.join("chat_template.jinja");
    match chat_template {
        Some(t) => write_bytes_atomic(&ct_path, t.as_bytes())?,
        None => {
            if ct_path.exists() {
                fs::remove_file(&ct_path)
                    .with_context(|| format!("cannot remove stale {}", ct_path.display()))?;
            }
        }
    }
    let mut gc = Map::new();
    for (k, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("pad_token_id", pad),
    ] {
        if let Some(id) = id {
            gc.insert(k.into(), json!(id));
        }
    }
    write_json_atomic(&out_dir.join("generation_config.json"), &Value::Object(gc))?;

    // Weights: dequantize (in parallel), un-permute Q/K, write f32 safetensors.
    let (n_head, n_head_kv) = (hp.n_head, hp.n_head_kv);
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = plan
        .par_iter()
        .map(|(t, hf, p)| {
            let mut data = g.tensor_f32(t)?;
            let shape = t.hf_shape();
            let cols = shape.last().copied().unwrap_or(1);
            match p {
                Permute::None => {}
                Permute::Q => {
                    data = unpermute_qk_rows(&data, n_head, cols)
                        .with_context(|| format!("{src}: `{}`", t.name))?
                }
                Permute::K => {
                    data = unpermute_qk_rows(&data, n_head_kv, cols)
                        .with_context(|| format!("{src}: `{}`", t.name))?
                }
            }
            Ok((hf.clone(), shape, data))
        })
        .collect::<Result<_>>()?;
    let params: usize = tensors.iter().map(|(_, _, d)| d.len()).sum();
    let views = tensors
        .iter()
        .map(|(name, shape, data)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                bytemuck::cast_slice(data),
            )
            .map(|v| (name.clone(), v))
            .map_err(|e| anyhow!("tensor {name}: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let st_path = out_dir.join("model.safetensors");
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    write_atomic_with(&st_path, |tmp| {
        safetensors::tensor::serialize_to_file(views, Some(meta), tmp)
            .map_err(|e| anyhow!("cannot write {}: {e}", tmp.display()))
    })?;
    drop(tensors);

    // config.json last: its presence marks a complete directory.
    let mut cfg = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "hidden_size": hp.hidden,
        "intermediate_size": hp.ffn,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "num_hidden_layers": hp.layers,
        "rms_norm_eps": hp.eps,
        "rope_theta": hp.rope_theta,
        "rope_parameters": {"rope_theta": hp.rope_theta, "rope_type": "default"},
        "max_position_embeddings": hp.ctx,
        "vocab_size": hp.vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "dtype": "float32",
    });
    let obj = cfg.as_object_mut().unwrap();
    for (k, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("pad_token_id", pad),
        ("unk_token_id", unk),
    ] {
        if let Some(id) = id {
            obj.insert(k.into(), json!(id));
        }
    }
    if let Some(name) = get_str(&g, "general.name")? {
        obj.insert("_model_name_or_path".into(), json!(name));
    }
    write_json_atomic(&out_dir.join("config.json"), &cfg)?;

    Ok(ImportSummary {
        tensors: plan.len(),
        params,
        arch,
    })
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    // ---- a tiny GGUF writer ------------------------------------------------------------------

    fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }

    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::Str(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    fn put_val(b: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => b.push(*x),
            GgufValue::I8(x) => b.push(*x as u8),
            GgufValue::U16(x) => b.extend(x.to_le_bytes()),
            GgufValue::I16(x) => b.extend(x.to_le_bytes()),
            GgufValue::U32(x) => b.extend(x.to_le_bytes()),
            GgufValue::I32(x) => b.extend(x.to_le_bytes()),
            GgufValue::F32(x) => b.extend(x.to_le_bytes()),
            GgufValue::Bool(x) => b.push(*x as u8),
            GgufValue::Str(s) => put_str(b, s),
            GgufValue::Array(a) => {
                let et = a.first().map(type_id).unwrap_or(4);
                b.extend(et.to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    put_val(b, x);
                }
            }
            GgufValue::U64(x) => b.extend(x.to_le_bytes()),
            GgufValue::I64(x) => b.extend(x.to_le_bytes()),
            GgufValue::F64(x) => b.extend(x.to_le_bytes()),
        }
    }

    struct T {
        name: String,
        dims: Vec<u64>,
        ty: u32,
        data: Vec<u8>,
    }

    fn build(
        version: u32,
        kvs: &[(String, GgufValue)],
        tensors: &[T],
        alignment: usize,
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(version.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut b, k);
            b.extend(type_id(v).to_le_bytes());
            put_val(&mut b, v);
        }
        let mut offs = Vec::new();
        let mut off = 0usize;
        for t in tensors {
            offs.push(off);
            off = (off + t.data.len()).div_ceil(alignment) * alignment;
        }
        for (t, o) in tensors.iter().zip(&offs) {
            put_str(&mut b, &t.name);
            b.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(t.ty.to_le_bytes());
            b.extend((*o as u64).to_le_bytes());
        }
        b.resize(b.len().div_ceil(alignment) * alignment, 0);
        let base = b.len();
        for (t, o) in tensors.iter().zip(&offs) {
            b.resize(base + o, 0);
            b.extend(&t.data);
        }
        b
    }

    fn s(x: &str) -> GgufValue {
        GgufValue::Str(x.into())
    }
    fn kv(k: &str, v: GgufValue) -> (String, GgufValue) {
        (k.into(), v)
    }
    fn h(x: f32) -> [u8; 2] {
        half::f16::from_f32(x).to_bits().to_le_bytes()
    }

    /// Q4_1 blocks: per block (d, m, 32 nibbles in value order).
    fn q4_1(blocks: &[(f32, f32, [u8; 32])]) -> Vec<u8> {
        let mut b = Vec::new();
        for (d, m, q) in blocks {
            b.extend(h(*d));
            b.extend(h(*m));
            for j in 0..16 {
                b.push(q[j] | (q[j + 16] << 4));
            }
        }
        b
    }
    fn q8_0(blocks: &[(f32, [i8; 32])]) -> Vec<u8> {
        let mut b = Vec::new();
        for (d, q) in blocks {
            b.extend(h(*d));
            b.extend(q.iter().map(|&x| x as u8));
        }
        b
    }
    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("infomem-gguf-test-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    // ---- dequantization ------------------------------------------------------------------------

    #[test]
    fn dequant_q4_1_layout() {
        let mut q = [0u8; 32];
        for (j, x) in q.iter_mut().enumerate() {
            *x = ((j * 7) % 16) as u8;
        }
        let raw = q4_1(&[(0.5, -1.25, q)]);
        // Nibble placement: byte j holds value j (low) and value j+16 (high).
        assert_eq!(raw[4], q[0] | (q[16] << 4));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &raw, &mut out).unwrap();
        for j in 0..32 {
            assert_eq!(out[j], q[j] as f32 * 0.5 - 1.25, "j={j}");
        }
    }

    #[test]
    fn dequant_q8_0_q4_0_f16_bf16() {
        let mut q = [0i8; 32];
        for (j, x) in q.iter_mut().enumerate() {
            *x = (j as i32 * 9 - 128) as i8;
        }
        let raw = q8_0(&[(0.25, q), (-2.0, q)]);
        let mut out = [0f32; 64];
        dequantize(GgmlType::Q8_0, &raw, &mut out).unwrap();
        for j in 0..32 {
            assert_eq!(out[j], q[j] as f32 * 0.25);
            assert_eq!(out[32 + j], q[j] as f32 * -2.0);
        }

        let mut raw = h(0.5).to_vec();
        for j in 0..16u8 {
            raw.push(j | ((15 - j) << 4));
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &raw, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }

        let vals = [1.5f32, -0.125, 65504.0];
        let raw: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        let mut out = [0f32; 3];
        dequantize(GgmlType::F16, &raw, &mut out).unwrap();
        assert_eq!(out, vals);
        let raw: Vec<u8> = vals
            .iter()
            .flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        dequantize(GgmlType::BF16, &raw, &mut out).unwrap();
        assert_eq!(out, [1.5, -0.125, 65280.0]);

        // Wrong byte count is an error, not a panic.
        assert!(dequantize(GgmlType::Q8_0, &raw, &mut [0f32; 32]).is_err());
    }

    // ---- Q/K un-permutation --------------------------------------------------------------------

    /// llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py):
    /// `w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)`.
    fn llama_cpp_permute(hf: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
        let rows = hf.len() / cols;
        let hd = rows / n_head;
        let half = hd / 2;
        let mut out = vec![0f32; hf.len()];
        for hh in 0..n_head {
            for j in 0..half {
                for a in 0..2 {
                    let dst = hh * hd + 2 * j + a; // stored [h, j, a]
                    let src = hh * hd + a * half + j; // hf [h, a, j]
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_takes_evens_then_odds() {
        // 2 heads of head_dim 6, 1 column: stored row r holds value r.
        let stored: Vec<f32> = (0..12).map(|r| r as f32).collect();
        let hf = unpermute_qk_rows(&stored, 2, 1).unwrap();
        assert_eq!(hf, vec![0., 2., 4., 1., 3., 5., 6., 8., 10., 7., 9., 11.]);
        // And it inverts llama.cpp's permutation on a wider matrix.
        let orig: Vec<f32> = (0..3 * 8 * 5).map(|x| x as f32 * 0.5 - 3.0).collect();
        let st = llama_cpp_permute(&orig, 3, 5);
        assert_ne!(st, orig);
        assert_eq!(unpermute_qk_rows(&st, 3, 5).unwrap(), orig);
        assert!(unpermute_qk_rows(&stored, 4, 1).is_err()); // head_dim 3 is odd
    }

    // ---- parsing ---------------------------------------------------------------------------------

    #[test]
    fn parses_all_value_types_and_alignment() {
        let kvs = vec![
            kv("general.architecture", s("llama")),
            kv("general.alignment", GgufValue::U32(64)),
            kv("a.u8", GgufValue::U8(200)),
            kv("a.i8", GgufValue::I8(-5)),
            kv("a.u16", GgufValue::U16(60000)),
            kv("a.i16", GgufValue::I16(-30000)),
            kv("a.i32", GgufValue::I32(-7)),
            kv("a.f32", GgufValue::F32(1.5)),
            kv("a.bool", GgufValue::Bool(true)),
            kv("a.u64", GgufValue::U64(1 << 40)),
            kv("a.i64", GgufValue::I64(-(1 << 40))),
            kv("a.f64", GgufValue::F64(-2.25)),
            kv("a.arr", GgufValue::Array(vec![s("x"), s(""), s("ü z")])),
            kv(
                "a.nested",
                GgufValue::Array(vec![GgufValue::Array(vec![
                    GgufValue::I32(1),
                    GgufValue::I32(2),
                ])]),
            ),
        ];
        let t = vec![
            T {
                name: "x".into(),
                dims: vec![3],
                ty: 0,
                data: f32s(&[1., 2., 3.]),
            },
            T {
                name: "y".into(),
                dims: vec![2, 2],
                ty: 0,
                data: f32s(&[4., 5., 6., 7.]),
            },
        ];
        for version in [2, 3] {
            let g = GgufFile::from_bytes(build(version, &kvs, &t, 64), "mem.gguf").unwrap();
            assert_eq!(g.version, version);
            assert_eq!(g.alignment, 64);
            assert_eq!(g.data_offset % 64, 0);
            for (k, v) in &kvs {
                assert_eq!(g.get(k), Some(v), "{k}");
            }
            assert_eq!(g.tensors[1].offset, 64);
            assert_eq!(
                g.tensor_f32(g.tensor("y").unwrap()).unwrap(),
                vec![4., 5., 6., 7.]
            );
            assert_eq!(g.tensor("y").unwrap().hf_shape(), vec![2, 2]);
        }
        // Default alignment is 32.
        let g = GgufFile::from_bytes(build(3, &kvs[2..4], &t, 32), "mem.gguf").unwrap();
        assert_eq!(g.alignment, 32);
        assert_eq!(
            g.tensor_f32(g.tensor("y").unwrap()).unwrap(),
            vec![4., 5., 6., 7.]
        );
    }

    fn err_of(bytes: Vec<u8>) -> String {
        match GgufFile::from_bytes(bytes, "bad.gguf") {
            Ok(_) => panic!("expected an error"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn error_paths() {
        let kvs = vec![
            kv("general.architecture", s("llama")),
            kv("k", GgufValue::Array(vec![s("a"), s("b")])),
        ];
        let t = vec![T {
            name: "w".into(),
            dims: vec![32, 2],
            ty: 8,
            data: q8_0(&[(1.0, [1; 32]), (1.0, [2; 32])]),
        }];
        let good = build(3, &kvs, &t, 32);
        GgufFile::from_bytes(good.clone(), "ok.gguf").unwrap();

        let mut bad = good.clone();
        bad[..4].copy_from_slice(b"GGML");
        let e = err_of(bad);
        assert!(e.contains("bad.gguf") && e.contains("bad magic"), "{e}");

        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&1u32.to_le_bytes());
        let e = err_of(bad);
        assert!(e.contains("unsupported GGUF version 1"), "{e}");

        // Every truncation is a clean error naming the file.
        for cut in 0..good.len() {
            let e = err_of(good[..cut].to_vec());
            assert!(
                e.contains("bad.gguf") && e.contains("truncated"),
                "cut {cut}: {e}"
            );
        }

        // Unknown / unsupported tensor types name the tensor and the type number.
        let t2 = vec![T {
            name: "blk.0.attn_q.weight".into(),
            dims: vec![32],
            ty: 99,
            data: vec![0; 64],
        }];
        let g = GgufFile::from_bytes(build(3, &kvs, &t2, 32), "odd.gguf").unwrap();
        let e = format!("{:#}", g.tensor_f32(&g.tensors[0]).unwrap_err());
        assert!(
            e.contains("odd.gguf") && e.contains("blk.0.attn_q.weight") && e.contains("99"),
            "{e}"
        );
        let t3 = vec![T {
            name: "k4".into(),
            dims: vec![256],
            ty: 12,
            data: vec![0; 144],
        }];
        let g = GgufFile::from_bytes(build(3, &kvs, &t3, 32), "odd.gguf").unwrap();
        let e = format!("{:#}", g.tensor_f32(&g.tensors[0]).unwrap_err());
        assert!(
            e.contains("`k4`") && e.contains("12 (Q4_K)") && e.contains("supported:"),
            "{e}"
        );

        // Import refuses an unknown architecture before writing anything.
        let dir = tmpdir("arch");
        let p = dir.join("m.gguf");
        fs::write(
            &p,
            build(3, &[kv("general.architecture", s("mamba"))], &[], 32),
        )
        .unwrap();
        let e = format!("{:#}", import_gguf(&p, &dir.join("out")).unwrap_err());
        assert!(
            e.contains("m.gguf") && e.contains("mamba") && e.contains("supported: llama"),
            "{e}"
        );
        assert!(!dir.join("out").exists());
        // And reports a missing file clearly.
        let e = format!(
            "{:#}",
            import_gguf(&dir.join("nope.gguf"), &dir.join("out")).unwrap_err()
        );
        assert!(e.contains("nope.gguf"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    // ---- a whole tiny model ----------------------------------------------------------------------

    /// A 1-layer llama: hidden 32, 4 heads of 8, 2 kv heads, ffn 64, vocab 32 (byte-level tokens).
    fn tiny_llama(ty_unknown: Option<u32>) -> (Vec<u8>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (hidden, ffn, vocab) = (32usize, 64usize, 32usize);
        let mut tokens: Vec<String> = vec![
            "<|endoftext|>".into(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
            "<tool>".into(),
        ];
        for c in "abcdefghijklmnopqrstuvwxyz".chars().take(vocab - 6) {
            tokens.push(c.to_string());
        }
        tokens.push("Ġ".into());
        tokens.push("ab".into());
        assert_eq!(tokens.len(), vocab);
        let types: Vec<GgufValue> = (0..vocab)
            .map(|i| {
                GgufValue::I32(if i < 3 {
                    3
                } else if i == 3 {
                    4
                } else {
                    1
                })
            })
            .collect();
        let kvs = vec![
            kv("general.architecture", s("llama")),
            kv("general.name", s("tiny")),
            kv("llama.block_count", GgufValue::U32(1)),
            kv("llama.context_length", GgufValue::U32(128)),
            kv("llama.embedding_length", GgufValue::U32(hidden as u32)),
            kv("llama.feed_forward_length", GgufValue::U32(ffn as u32)),
            kv("llama.attention.head_count", GgufValue::U32(4)),
            kv("llama.attention.head_count_kv", GgufValue::U32(2)),
            kv("llama.rope.freq_base", GgufValue::F32(10000.0)),
            kv(
                "llama.attention.layer_norm_rms_epsilon",
                GgufValue::F32(1e-5),
            ),
            kv("llama.vocab_size", GgufValue::U32(vocab as u32)),
            kv("tokenizer.ggml.model", s("gpt2")),
            kv(
                "tokenizer.ggml.tokens",
                GgufValue::Array(tokens.iter().map(|t| s(t)).collect()),
            ),
            kv("tokenizer.ggml.token_type", GgufValue::Array(types)),
            kv("tokenizer.ggml.merges", GgufValue::Array(vec![s("a b")])),
            kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
            kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
            kv("tokenizer.ggml.padding_token_id", GgufValue::U32(2)),
            kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0)),
            kv(
                "tokenizer.chat_template",
                s("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"),
            ),
        ];
        let blocks_q41 = |rows: usize, seed: u32| -> (Vec<u8>, Vec<f32>) {
            let mut bl = Vec::new();
            let mut vals = Vec::new();
            for r in 0..rows {
                let d = 0.015625 * (1 + (r as u32 + seed) % 5) as f32;
                let m = -0.0625 * ((r as u32 * 3 + seed) % 7) as f32;
                let mut q = [0u8; 32];
                for (j, x) in q.iter_mut().enumerate() {
                    *x = ((j as u32 * 5 + r as u32 * 3 + seed) % 16) as u8;
                }
                let dd = half::f16::from_f32(d).to_f32();
                let mm = half::f16::from_f32(m).to_f32();
                vals.extend(q.iter().map(|&x| x as f32 * dd + mm));
                bl.push((d, m, q));
            }
            (q4_1(&bl), vals)
        };
        let (q_raw, q_vals) = blocks_q41(32, 1); // [32 rows, 32 cols]
        let (k_raw, k_vals) = blocks_q41(16, 2); // [16 rows, 32 cols]
        let mut emb_blocks = Vec::new();
        let mut emb_vals = Vec::new();
        for r in 0..vocab {
            let mut q = [0i8; 32];
            for (j, x) in q.iter_mut().enumerate() {
                *x = ((j as i32 * 11 + r as i32 * 13) % 255 - 127) as i8;
            }
            let d = 0.01 * (r + 1) as f32;
            let dd = half::f16::from_f32(d).to_f32();
            emb_vals.extend(q.iter().map(|&x| x as f32 * dd));
            emb_blocks.push((d, q));
        }
        let f = |n: usize, base: f32| {
            f32s(&(0..n).map(|i| base + i as f32 * 0.001).collect::<Vec<_>>())
        };
        let mut t = vec![
            T {
                name: "token_embd.weight".into(),
                dims: vec![hidden as u64, vocab as u64],
                ty: 8,
                data: q8_0(&emb_blocks),
            },
            T {
                name: "blk.0.attn_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 1.0),
            },
            T {
                name: "blk.0.attn_q.weight".into(),
                dims: vec![hidden as u64, 32],
                ty: 3,
                data: q_raw,
            },
            T {
                name: "blk.0.attn_k.weight".into(),
                dims: vec![hidden as u64, 16],
                ty: 3,
                data: k_raw,
            },
            T {
                name: "blk.0.attn_v.weight".into(),
                dims: vec![hidden as u64, 16],
                ty: 0,
                data: f(16 * hidden, 0.1),
            },
            T {
                name: "blk.0.attn_output.weight".into(),
                dims: vec![32, hidden as u64],
                ty: 0,
                data: f(32 * hidden, 0.2),
            },
            T {
                name: "blk.0.ffn_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 0.9),
            },
            T {
                name: "blk.0.ffn_gate.weight".into(),
                dims: vec![hidden as u64, ffn as u64],
                ty: 0,
                data: f(ffn * hidden, 0.3),
            },
            T {
                name: "blk.0.ffn_up.weight".into(),
                dims: vec![hidden as u64, ffn as u64],
                ty: 0,
                data: f(ffn * hidden, 0.4),
            },
            T {
                name: "blk.0.ffn_down.weight".into(),
                dims: vec![ffn as u64, hidden as u64],
                ty: 0,
                data: f(ffn * hidden, 0.5),
            },
            T {
                name: "output_norm.weight".into(),
                dims: vec![hidden as u64],
                ty: 0,
                data: f(hidden, 1.1),
            },
        ];
        if let Some(ty) = ty_unknown {
            t[5].ty = ty;
        }
        (build(3, &kvs, &t, 32), emb_vals, q_vals, k_vals)
    }

    #[test]
    fn imports_a_tiny_llama() {
        let dir = tmpdir("tiny");
        let p = dir.join("tiny.gguf");
        let (bytes, emb, q_stored, k_stored) = tiny_llama(None);
        fs::write(&p, bytes).unwrap();
        let out = dir.join("hf");
        let sum = import_gguf(&p, &out).unwrap();
        assert_eq!(sum.arch, "llama");
        assert_eq!(sum.tensors, 11);
        assert_eq!(
            sum.params,
            32 * 32 + 32 * 3 + 32 * 32 + 16 * 32 * 2 + 32 * 32 + 64 * 32 * 3
        );

        let st_bytes = fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
        let get = |n: &str| -> (Vec<usize>, Vec<f32>) {
            let t = st.tensor(n).unwrap();
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            (
                t.shape().to_vec(),
                t.data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            )
        };
        let (sh, e) = get("model.embed_tokens.weight");
        assert_eq!(sh, vec![32, 32]);
        assert_eq!(e, emb);
        let (sh, q) = get("model.layers.0.self_attn.q_proj.weight");
        assert_eq!(sh, vec![32, 32]);
        // 4 heads of 8 rows: HF row 1 of head 0 is stored row 2, HF row 4 is stored row 1.
        assert_eq!(q[32..64], q_stored[64..96]);
        assert_eq!(q[4 * 32..5 * 32], q_stored[32..64]);
        assert_eq!(q, unpermute_qk_rows(&q_stored, 4, 32).unwrap());
        let (sh, k) = get("model.layers.0.self_attn.k_proj.weight");
        assert_eq!(sh, vec![16, 32]);
        assert_eq!(k, unpermute_qk_rows(&k_stored, 2, 32).unwrap());
        assert_ne!(k, k_stored);
        let (sh, _) = get("model.layers.0.mlp.down_proj.weight");
        assert_eq!(sh, vec![32, 64]);
        let (sh, n) = get("model.norm.weight");
        assert_eq!(sh, vec![32]);
        assert_eq!(n[1], 1.1 + 0.001);
        assert!(st.tensor("lm_head.weight").is_err());

        let cfg: Value =
            serde_json::from_slice(&fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["model_type"], "llama");
        assert_eq!(cfg["head_dim"], 8);
        assert_eq!(cfg["num_key_value_heads"], 2);
        assert_eq!(cfg["tie_word_embeddings"], true);
        assert_eq!(cfg["rms_norm_eps"].as_f64().unwrap(), 1e-5f32 as f64);
        assert_eq!(cfg["rope_parameters"]["rope_theta"], 10000.0);
        assert_eq!(cfg["pad_token_id"], 2);
        let gc: Value =
            serde_json::from_slice(&fs::read(out.join("generation_config.json")).unwrap()).unwrap();
        assert_eq!(
            gc,
            json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
        );
        let tc_text = fs::read_to_string(out.join("tokenizer_config.json")).unwrap();
        assert!(
            tc_text.contains("\"model_max_length\": 1000000000000000019884624838656"),
            "{tc_text}"
        );
        let tc: Value = serde_json::from_str(&tc_text).unwrap();
        assert_eq!(tc["bos_token"], "<|im_start|>");
        assert_eq!(tc["unk_token"], "<|endoftext|>");
        assert_eq!(
            fs::read_to_string(out.join("chat_template.jinja")).unwrap(),
            "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        );

        let tk = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        let enc = tk.encode("<|im_start|>ab c<tool>", false).unwrap();
        // "ab" merges; " c" is "Ġ" + "c"; specials are matched whole.
        assert_eq!(enc.get_ids(), &[1, 31, 30, 6, 3]);
        let tj: Value =
            serde_json::from_slice(&fs::read(out.join("tokenizer.json")).unwrap()).unwrap();
        assert_eq!(tj["added_tokens"][3]["special"], false);
        assert_eq!(tj["added_tokens"][2]["special"], true);

        // No temp files left behind.
        for e in fs::read_dir(&out).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!n.contains(".tmp-"), "{n}");
        }

        // A failing re-import (unsupported tensor type) is refused before anything is written: the
        // previous complete import stays as it was.
        let (bytes, ..) = tiny_llama(Some(13));
        fs::write(&p, bytes).unwrap();
        let e = format!("{:#}", import_gguf(&p, &out).unwrap_err());
        assert!(
            e.contains("blk.0.attn_output.weight") && e.contains("13 (Q5_K)"),
            "{e}"
        );
        assert!(out.join("config.json").exists());
        let _ = fs::remove_dir_all(&dir);
    }
}
