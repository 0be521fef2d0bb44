//! Test builders shared by the GGUF unit tests: a tiny GGUF writer (the inverse of the reader) and
//! encoders for f16, Q4_1, Q8_0 and f32 data.
use super::reader::GgufValue;
use std::fs;
use std::path::PathBuf;

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

pub(super) struct T {
    pub(super) name: String,
    pub(super) dims: Vec<u64>,
    pub(super) ty: u32,
    pub(super) data: Vec<u8>,
}

pub(super) fn build(
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

pub(super) fn s(x: &str) -> GgufValue {
    GgufValue::Str(x.into())
}
pub(super) fn kv(k: &str, v: GgufValue) -> (String, GgufValue) {
    (k.into(), v)
}
pub(super) fn h(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_bits().to_le_bytes()
}

/// Q4_1 blocks: per block (d, m, 32 nibbles in value order).
pub(super) fn q4_1(blocks: &[(f32, f32, [u8; 32])]) -> Vec<u8> {
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
pub(super) fn q8_0(blocks: &[(f32, [i8; 32])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (d, q) in blocks {
        b.extend(h(*d));
        b.extend(q.iter().map(|&x| x as u8));
    }
    b
}
pub(super) fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn tmpdir(tag: &str) -> PathBuf {
    let d =
        std::env::temp_dir().join(format!("infomem-gguf-test-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}
