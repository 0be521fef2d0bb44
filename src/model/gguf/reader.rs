//! The GGUF reader: header, every metadata value type (arrays included), the tensor-info table,
//! the alignment (`general.alignment`, default 32) and the data offset, parsed over a memory map
//! into a [`GgufFile`]; plus the typed metadata lookups the rest of the importer uses. Every
//! truncation or corruption is an error naming the file and the offset, never a panic.
use super::dequant::{dequantize, ggml_type_name, GgmlType, SUPPORTED_TYPES_MSG};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::path::Path;

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
    pub(super) fn type_name(&self) -> &'static str {
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
    pub(super) source: String,
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
        // a directory would fail later as "cannot mmap: No such device", and opening a FIFO
        // would wait for a writer forever
        let kind = std::fs::metadata(path).with_context(|| format!("{source}: cannot open GGUF file"))?.file_type();
        if kind.is_dir() {
            bail!("{source}: is a directory; --gguf takes a .gguf file");
        }
        if !kind.is_file() {
            bail!("{source}: is not a regular file (a device, pipe or socket); --gguf takes a .gguf file");
        }
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

    pub(super) fn tensor_type(&self, t: &GgufTensorInfo) -> Result<GgmlType> {
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
// Typed metadata lookups (errors name the file and the key)
// ---------------------------------------------------------------------------------------------

pub(super) fn get_usize(g: &GgufFile, key: &str) -> Result<Option<usize>> {
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

pub(super) fn req_usize(g: &GgufFile, key: &str) -> Result<usize> {
    get_usize(g, key)?.ok_or_else(|| anyhow!("{}: required metadata `{key}` is missing", g.source))
}

pub(super) fn get_f64(g: &GgufFile, key: &str) -> Result<Option<f64>> {
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

pub(super) fn get_str<'a>(g: &'a GgufFile, key: &str) -> Result<Option<&'a str>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::import_gguf;
    use crate::model::gguf::test_builders::{build, f32s, kv, q8_0, s, tmpdir, T};
    use std::fs;

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
}
