//! Named tensors in a batch: dtype, shape, strides and byte offset of each, and the per-slot
//! tensor table in the control segment that carries them to consumers.
//!
//! A batch holds up to [`MAX_TENSORS`] named tensors of up to [`MAX_DIMS`] dimensions. Their
//! offsets are a pure function of the declared tensors, in order: each starts at the end of
//! the previous one rounded up to [`TENSOR_ALIGN`] (256 bytes). So the same declaration always
//! gives the same addresses, and a tensor made from slot k has the same address every time
//! slot k comes round.
//!
//! The table lives in host shared memory beside the slot's descriptor, never in the slot's
//! (possibly GPU) memory: a consumer reads it without touching the GPU. Everything read from
//! it is validated ([`TensorTable::read`]) before use.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Most tensors one batch carries.
pub const MAX_TENSORS: usize = 8;
/// Most dimensions of one tensor.
pub const MAX_DIMS: usize = 8;
/// Longest tensor name, in bytes of UTF-8.
pub const NAME_BYTES: usize = 32;
/// Alignment of every tensor's offset in its slot.
pub const TENSOR_ALIGN: u64 = 256;
/// The name of the one tensor a batch without a table reads as.
pub const DEFAULT_NAME: &str = "data";

/// Element type class, with DLPack's type codes as values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DTypeKind {
    /// Signed integer.
    Int = 0,
    /// Unsigned integer.
    UInt = 1,
    /// IEEE floating point.
    Float = 2,
    /// bfloat16.
    BFloat = 4,
    /// Complex (two floats).
    Complex = 5,
    /// Boolean, one byte each.
    Bool = 6,
}

/// An element type: class and width. Only the combinations in [`DType::ALL`] exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DType {
    /// The class.
    pub kind: DTypeKind,
    /// Bits per element.
    pub bits: u8,
}

macro_rules! dtypes {
    ($($c:ident = $k:ident, $b:literal, $n:literal;)*) => {
        impl DType {
            $(
                #[doc = concat!("`", $n, "`.")]
                pub const $c: DType = DType { kind: DTypeKind::$k, bits: $b };
            )*
            /// Every supported element type.
            pub const ALL: &'static [DType] = &[$(DType::$c),*];
            /// The name NumPy and PyTorch use (`float32`, `bfloat16`, `bool`, ...).
            pub fn name(self) -> &'static str {
                $(if self == DType::$c { return $n; })*
                "invalid"
            }
        }
    };
}

dtypes! {
    BOOL = Bool, 8, "bool";
    U8 = UInt, 8, "uint8";
    U16 = UInt, 16, "uint16";
    U32 = UInt, 32, "uint32";
    U64 = UInt, 64, "uint64";
    I8 = Int, 8, "int8";
    I16 = Int, 16, "int16";
    I32 = Int, 32, "int32";
    I64 = Int, 64, "int64";
    F16 = Float, 16, "float16";
    BF16 = BFloat, 16, "bfloat16";
    F32 = Float, 32, "float32";
    F64 = Float, 64, "float64";
    C64 = Complex, 64, "complex64";
    C128 = Complex, 128, "complex128";
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        self.bits as u64 / 8
    }

    /// Looks a type up by its name (see [`DType::name`]).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }

    /// The table's encoding: DLPack code, bits and lanes (always 1) in one word.
    pub fn to_code(self) -> u32 {
        self.kind as u32 | (self.bits as u32) << 8 | 1 << 16
    }

    /// Decodes [`DType::to_code`]; `None` for anything that is not a supported type.
    pub fn from_code(code: u32) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.to_code() == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's name: 1 to [`NAME_BYTES`] bytes of UTF-8, no NUL. Stored inline (no allocation).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TensorName {
    bytes: [u8; NAME_BYTES],
    len: u8,
}

impl TensorName {
    /// Checks and stores a name.
    pub fn new(name: &str) -> Result<Self, String> {
        if name.is_empty() || name.len() > NAME_BYTES || name.contains('\0') {
            return Err(format!(
                "tensor name {name:?} must be 1 to {NAME_BYTES} bytes of UTF-8 without NUL"
            ));
        }
        let mut bytes = [0u8; NAME_BYTES];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        Ok(Self {
            bytes,
            len: name.len() as u8,
        })
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        // Only ever built from a &str (new) or checked UTF-8 (from_words).
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("?")
    }

    fn to_words(self) -> [u64; NAME_BYTES / 8] {
        std::array::from_fn(|i| {
            u64::from_le_bytes(self.bytes[i * 8..i * 8 + 8].try_into().unwrap())
        })
    }

    fn from_words(words: [u64; NAME_BYTES / 8]) -> Result<Self, String> {
        let mut bytes = [0u8; NAME_BYTES];
        for (i, w) in words.iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        let len = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
        if bytes[len..].iter().any(|&b| b != 0) {
            return Err("a tensor name has bytes after its NUL".into());
        }
        let s = std::str::from_utf8(&bytes[..len])
            .map_err(|_| "a tensor name is not UTF-8".to_string())?;
        Self::new(s)
    }
}

impl fmt::Debug for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for TensorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One tensor of a batch: where it is in the slot and how to read it. Strides are in
/// elements, as in DLPack and PyTorch (NumPy's are in bytes). `Copy`, no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name.
    pub name: TensorName,
    /// Element type.
    pub dtype: DType,
    ndim: u8,
    shape: [u64; MAX_DIMS],
    strides: [u64; MAX_DIMS],
    /// Byte offset of element 0 in the slot (a multiple of [`TENSOR_ALIGN`]).
    pub offset: u64,
}

/// Row-major (C-order) strides, in elements, of `shape`.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1));
    }
    s
}

impl TensorInfo {
    /// Checks a declaration and places it at `offset`. Errors say what is wrong with it.
    pub fn new(
        name: &str,
        dtype: DType,
        shape: &[u64],
        strides: Option<&[u64]>,
        offset: u64,
    ) -> Result<Self, String> {
        let name = TensorName::new(name)?;
        if shape.len() > MAX_DIMS {
            return Err(format!(
                "tensor {name} has {} dimensions; at most {MAX_DIMS} are supported",
                shape.len()
            ));
        }
        let default;
        let strides = match strides {
            Some(s) => s,
            None => {
                default = contiguous_strides(shape);
                &default
            }
        };
        if strides.len() != shape.len() {
            return Err(format!(
                "tensor {name}: {} strides given for {} dimensions",
                strides.len(),
                shape.len()
            ));
        }
        if offset % TENSOR_ALIGN != 0 {
            return Err(format!(
                "tensor {name}: offset {offset} is not a multiple of {TENSOR_ALIGN}"
            ));
        }
        let mut t = TensorInfo {
            name,
            dtype,
            ndim: shape.len() as u8,
            shape: [0; MAX_DIMS],
            strides: [0; MAX_DIMS],
            offset,
        };
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..shape.len()].copy_from_slice(strides);
        t.extent_bytes()?;
        Ok(t)
    }

    /// The implicit tensor of a batch that carries no table: `len` bytes as one 1-D `uint8`
    /// tensor named [`DEFAULT_NAME`].
    pub fn bytes(len: u64) -> Self {
        let mut shape = [0; MAX_DIMS];
        let mut strides = [0; MAX_DIMS];
        shape[0] = len;
        strides[0] = 1;
        TensorInfo {
            name: TensorName::new(DEFAULT_NAME).expect("valid name"),
            dtype: DType::U8,
            ndim: 1,
            shape,
            strides,
            offset: 0,
        }
    }

    /// Dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.shape[..self.ndim as usize]
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[u64] {
        &self.strides[..self.ndim as usize]
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape().iter().product()
    }

    /// Bytes from element 0 to the end of the last element (0 for an empty tensor). Errors
    /// if that overflows.
    pub fn extent_bytes(&self) -> Result<u64, String> {
        if self.shape().contains(&0) {
            return Ok(0);
        }
        let mut last = 0u64;
        for (&n, &s) in self.shape().iter().zip(self.strides()) {
            last = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| format!("tensor {} is too large", self.name))?;
        }
        last.checked_add(1)
            .and_then(|e| e.checked_mul(self.dtype.size()))
            .ok_or_else(|| format!("tensor {} is too large", self.name))
    }

    /// Byte offset just past the tensor's last element (saturating: a tensor built with an
    /// absurd offset never wraps round to a small end).
    pub fn end(&self) -> u64 {
        self.offset
            .saturating_add(self.extent_bytes().unwrap_or(u64::MAX))
    }

    /// True when the strides are the row-major ones of the shape.
    pub fn is_contiguous(&self) -> bool {
        self.strides() == contiguous_strides(self.shape()).as_slice() || self.shape().contains(&0)
    }
}

/// Places tensors one after another: each starts at the previous one's end rounded up to
/// [`TENSOR_ALIGN`]. Declaring the same tensors in the same order always gives the same
/// offsets.
#[derive(Clone, Debug, Default)]
pub struct TensorPlan {
    tensors: Vec<TensorInfo>,
    end: u64,
}

impl TensorPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tensor after the ones declared so far, checking that it fits in `capacity`
    /// bytes and that its name is new.
    pub fn push(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        strides: Option<&[u64]>,
        capacity: u64,
    ) -> Result<&TensorInfo, String> {
        if self.tensors.len() >= MAX_TENSORS {
            return Err(format!("a batch holds at most {MAX_TENSORS} tensors"));
        }
        if self.get(name).is_some() {
            return Err(format!("tensor {name:?} is already declared in this slot"));
        }
        let offset = self.end.next_multiple_of(TENSOR_ALIGN);
        let t = TensorInfo::new(name, dtype, shape, strides, offset)?;
        let end = offset + t.extent_bytes()?;
        if end > capacity {
            return Err(format!(
                "tensor {name} ({dtype}, shape {:?}) needs bytes {offset}..{end}, beyond the slot capacity of {capacity} bytes",
                t.shape()
            ));
        }
        self.end = end;
        self.tensors.push(t);
        Ok(self.tensors.last().expect("just pushed"))
    }

    /// The tensors declared so far, in order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A declared tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name.as_str() == name)
    }

    /// Byte offset just past the last tensor: the batch length these tensors need.
    pub fn len(&self) -> u64 {
        self.end
    }

    /// True when no tensor is declared.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Forgets every tensor (the slot is reused for another batch).
    pub fn clear(&mut self) {
        self.tensors.clear();
        self.end = 0;
    }
}

/// One entry of the table in shared memory (176 bytes).
#[repr(C)]
pub struct TensorEntry {
    /// Name, UTF-8, NUL-padded.
    pub name: [AtomicU64; NAME_BYTES / 8],
    /// [`DType::to_code`].
    pub dtype: AtomicU32,
    /// Number of dimensions.
    pub ndim: AtomicU32,
    /// Byte offset in the slot.
    pub offset: AtomicU64,
    /// Dimensions (the first `ndim` are used, the rest zero).
    pub shape: [AtomicU64; MAX_DIMS],
    /// Strides in elements (the first `ndim` are used, the rest zero).
    pub strides: [AtomicU64; MAX_DIMS],
}

/// A slot's tensor table, written by the producer before it publishes the slot's batch and
/// read by consumers after they acquire it. 1536 bytes, all atomics.
#[repr(C, align(128))]
pub struct TensorTable {
    /// Number of entries in use (0: the batch reads as one `uint8` tensor of its length).
    pub count: AtomicU32,
    /// Reserved, zero.
    pub reserved: AtomicU32,
    _pad: AtomicU64,
    /// The entries.
    pub entries: [TensorEntry; MAX_TENSORS],
}

const _: () = {
    assert!(size_of::<TensorEntry>() == 176);
    assert!(std::mem::offset_of!(TensorEntry, dtype) == 32);
    assert!(std::mem::offset_of!(TensorEntry, offset) == 40);
    assert!(std::mem::offset_of!(TensorEntry, shape) == 48);
    assert!(std::mem::offset_of!(TensorEntry, strides) == 112);
    assert!(std::mem::offset_of!(TensorTable, entries) == 16);
    assert!(size_of::<TensorTable>() == 1536);
};

impl TensorTable {
    /// Stores `tensors` (producer side, before the publishing release store).
    pub fn write(&self, tensors: &[TensorInfo]) {
        assert!(tensors.len() <= MAX_TENSORS);
        for (e, t) in self.entries.iter().zip(tensors) {
            for (w, v) in e.name.iter().zip(t.name.to_words()) {
                w.store(v, Ordering::Relaxed);
            }
            e.dtype.store(t.dtype.to_code(), Ordering::Relaxed);
            e.ndim.store(t.ndim as u32, Ordering::Relaxed);
            e.offset.store(t.offset, Ordering::Relaxed);
            for i in 0..MAX_DIMS {
                e.shape[i].store(t.shape[i], Ordering::Relaxed);
                e.strides[i].store(t.strides[i], Ordering::Relaxed);
            }
        }
        self.count.store(tensors.len() as u32, Ordering::Relaxed);
    }

    /// Reads and validates the table of a batch of `len` bytes (consumer side, after the
    /// acquire load that made the batch visible). Every tensor must lie within the batch,
    /// have a known type, at most [`MAX_DIMS`] dimensions, an aligned offset and a unique
    /// name. An empty table gives the implicit byte tensor.
    pub fn read(&self, len: u64, out: &mut Vec<TensorInfo>) -> Result<(), String> {
        out.clear();
        let count = self.count.load(Ordering::Relaxed) as usize;
        if count == 0 {
            out.push(TensorInfo::bytes(len));
            return Ok(());
        }
        if count > MAX_TENSORS {
            return Err(format!(
                "tensor table says {count} tensors (at most {MAX_TENSORS})"
            ));
        }
        for (i, e) in self.entries[..count].iter().enumerate() {
            let name =
                TensorName::from_words(std::array::from_fn(|j| e.name[j].load(Ordering::Relaxed)))
                    .map_err(|m| format!("tensor {i}: {m}"))?;
            let code = e.dtype.load(Ordering::Relaxed);
            let dtype = DType::from_code(code)
                .ok_or_else(|| format!("tensor {name}: unknown dtype code {code:#x}"))?;
            let ndim = e.ndim.load(Ordering::Relaxed) as usize;
            if ndim > MAX_DIMS {
                return Err(format!(
                    "tensor {name}: {ndim} dimensions (at most {MAX_DIMS})"
                ));
            }
            let shape: [u64; MAX_DIMS] =
                std::array::from_fn(|j| e.shape[j].load(Ordering::Relaxed));
            let strides: [u64; MAX_DIMS] =
                std::array::from_fn(|j| e.strides[j].load(Ordering::Relaxed));
            let offset = e.offset.load(Ordering::Relaxed);
            let t = TensorInfo::new(
                name.as_str(),
                dtype,
                &shape[..ndim],
                Some(&strides[..ndim]),
                offset,
            )
            .map_err(|m| format!("tensor {i}: {m}"))?;
            let extent = t.extent_bytes()?;
            if offset.checked_add(extent).is_none_or(|end| end > len) {
                return Err(format!(
                    "tensor {name} spans bytes {offset}..+{extent}, beyond the batch's {len} bytes"
                ));
            }
            if out.iter().any(|o| o.name == t.name) {
                return Err(format!("tensor name {name} appears twice"));
            }
            out.push(t);
        }
        Ok(())
    }

    /// As [`TensorTable::read`], into a value a batch keeps: a batch without a table (the
    /// usual case on the byte path) gets its implicit tensor inline, with no allocation.
    pub(crate) fn read_tensors(&self, len: u64) -> Result<Tensors, String> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return Ok(Tensors::Bytes([TensorInfo::bytes(len)]));
        }
        let mut out = Vec::new();
        self.read(len, &mut out)?;
        Ok(Tensors::Table(out))
    }
}

/// A received batch's tensors: the implicit byte tensor, or the validated table.
#[derive(Debug)]
pub(crate) enum Tensors {
    Bytes([TensorInfo; 1]),
    Table(Vec<TensorInfo>),
}

impl Tensors {
    pub(crate) fn as_slice(&self) -> &[TensorInfo] {
        match self {
            Tensors::Bytes(one) => one,
            Tensors::Table(all) => all,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn dtype_codes_and_names_round_trip() {
        for &d in DType::ALL {
            assert_eq!(DType::from_code(d.to_code()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert!(d.size() >= 1);
        }
        assert_eq!(DType::from_code(DType::F32.to_code() | 2 << 16), None);
        assert_eq!(DType::from_name("float8"), None);
    }

    #[test]
    fn plan_places_tensors_aligned_and_deterministically() {
        let cap = 1 << 20;
        let mut p = TensorPlan::new();
        p.push("images", DType::U8, &[2, 3, 5, 7], None, cap)
            .unwrap();
        p.push("labels", DType::I64, &[2], None, cap).unwrap();
        let t = p.tensors();
        assert_eq!(t[0].offset, 0);
        assert_eq!(t[0].extent_bytes().unwrap(), 210);
        assert_eq!(t[1].offset, 256);
        assert_eq!(p.len(), 256 + 16);
        let mut q = TensorPlan::new();
        q.push("images", DType::U8, &[2, 3, 5, 7], None, cap)
            .unwrap();
        q.push("labels", DType::I64, &[2], None, cap).unwrap();
        assert_eq!(p.tensors(), q.tensors());
    }

    #[test]
    fn plan_refuses_what_does_not_fit() {
        let mut p = TensorPlan::new();
        assert!(p.push("x", DType::F32, &[1024], None, 4096).is_ok());
        let e = p.push("y", DType::F32, &[1], None, 4096).unwrap_err();
        assert!(e.contains("beyond the slot capacity"), "{e}");
        assert!(
            p.push("x", DType::U8, &[1], None, 1 << 20)
                .unwrap_err()
                .contains("already")
        );
        assert!(p.push("", DType::U8, &[1], None, 1 << 20).is_err());
        assert!(p.push("z", DType::U8, &[1; 9], None, 1 << 20).is_err());
        assert!(
            p.push("z", DType::U8, &[2, 2], Some(&[1]), 1 << 20)
                .is_err()
        );
        assert!(
            p.push("z", DType::U64, &[u64::MAX / 2, 3], None, u64::MAX)
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn channels_last_strides_are_kept() {
        // N, C, H, W = 2, 3, 4, 5 stored as N, H, W, C.
        let strides = [60, 1, 15, 3];
        let t = TensorInfo::new("img", DType::F32, &[2, 3, 4, 5], Some(&strides), 0).unwrap();
        assert_eq!(t.strides(), &strides);
        assert!(!t.is_contiguous());
        assert_eq!(t.extent_bytes().unwrap(), 120 * 4);
    }

    fn table() -> Box<TensorTable> {
        // SAFETY: TensorTable is all atomics of integers, for which all-zero bytes are valid.
        unsafe { Box::new(std::mem::zeroed()) }
    }

    #[test]
    fn table_round_trips_and_empty_reads_as_bytes() {
        let tab = table();
        let mut out = Vec::new();
        tab.read(100, &mut out).unwrap();
        assert_eq!(out, vec![TensorInfo::bytes(100)]);
        let mut p = TensorPlan::new();
        p.push("a", DType::BF16, &[3, 4], Some(&[1, 3]), 1 << 20)
            .unwrap();
        p.push("b", DType::BOOL, &[], None, 1 << 20).unwrap();
        tab.write(p.tensors());
        tab.read(p.len(), &mut out).unwrap();
        assert_eq!(out, p.tensors());
        let e = tab.read(p.len() - 1, &mut out).unwrap_err();
        assert!(e.contains("beyond the batch"), "{e}");
    }

    #[test]
    fn table_garbage_is_refused() {
        let tab = table();
        tab.count.store(9, Ordering::Relaxed);
        assert!(tab.read(1 << 20, &mut Vec::new()).is_err());
        tab.write(&[TensorInfo::bytes(10), TensorInfo::bytes(10)]);
        let e = tab.read(10, &mut Vec::new()).unwrap_err();
        assert!(e.contains("twice"), "{e}");
        tab.write(&[TensorInfo::bytes(10)]);
        tab.entries[0].dtype.store(0xffff, Ordering::Relaxed);
        assert!(tab.read(10, &mut Vec::new()).unwrap_err().contains("dtype"));
        tab.write(&[TensorInfo::bytes(10)]);
        tab.entries[0].ndim.store(40, Ordering::Relaxed);
        assert!(tab.read(10, &mut Vec::new()).is_err());
        tab.write(&[TensorInfo::bytes(10)]);
        tab.entries[0]
            .offset
            .store(u64::MAX - 255, Ordering::Relaxed);
        assert!(tab.read(10, &mut Vec::new()).is_err());
        tab.write(&[TensorInfo::bytes(10)]);
        tab.entries[0].name[0].store(0xff, Ordering::Relaxed);
        assert!(tab.read(10, &mut Vec::new()).unwrap_err().contains("UTF-8"));
    }

    proptest! {
        /// Whatever a peer writes into a table, reading it either fails or gives tensors that
        /// lie within the batch.
        #[test]
        fn any_table_reads_within_bounds(words in proptest::collection::vec(any::<u64>(), 192), len in 0u64..1 << 24) {
            let tab = table();
            // SAFETY: TensorTable is 1536 bytes of atomics; we store 192 words into it.
            let raw = unsafe { std::slice::from_raw_parts(&*tab as *const TensorTable as *const AtomicU64, 192) };
            for (w, v) in raw.iter().zip(&words) {
                w.store(*v, Ordering::Relaxed);
            }
            tab.count.store((words[0] % 10) as u32, Ordering::Relaxed);
            let mut out = Vec::new();
            if tab.read(len, &mut out).is_ok() {
                for t in &out {
                    prop_assert!(t.end() <= len);
                }
            }
        }
    }
}
