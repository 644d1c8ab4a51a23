//! The quantized weight formats the kernels read, and their reference unpacking.
//!
//! Owns [`FORMATS`], the one table of formats in kvpage: each format's name,
//! weights and bytes per block, whether its rows carry a float scale, its GGUF
//! type name, and its code (its index, `QuantType as usize`, the order of
//! [`QuantType::ALL`]). Nothing else writes these numbers: [`QuantType`]'s
//! methods read the table; Python reads it through `kvpage._core.quant_formats()`
//! (`rust/py/quant.rs`) into `kvpage.quant.formats` (`BLOCK_LAYOUTS`, `KINDS`,
//! `GGUF_KEPT`), and `kvpage.kernels.host.cpu_qmatmul.KINDS` is that `KINDS`.
//!
//! Also owns [`unpack`], which turns
//! one 32-weight sub-block into integers, scales and offsets:
//! `w[i] = scale[i / 16] * q[i] + min[i / 16]`. The AVX2 kernel unpacks the
//! same values in registers; the tests check both against this.
//!
//! Layouts (GGUF's, little-endian; `f16` is IEEE half precision):
//! - `Q8_0`, 32 weights in 34 bytes: `f16 d`, `i8 q[32]`; `w = d * q`.
//! - `Q4_0`, 32 in 18: `f16 d`, `u8 qs[16]`; weight `i < 16` is `qs[i] & 15`,
//!   weight `16 + i` is `qs[i] >> 4`; `w = d * (q - 8)`.
//! - `Q4_1`, 32 in 20: `f16 d`, `f16 m`, `qs[16]` as Q4_0; `w = d * q + m`.
//! - `Q5_0`, 32 in 22: `f16 d`, `u32 qh` (little-endian; bit `i` is weight
//!   `i`'s fifth bit), `qs[16]` as Q4_0 for the low four; `w = d * (q - 16)`.
//!   llama.cpp writes it for rows a K-quant block does not divide (Qwen2.5's
//!   896-wide layers in a Q4_K_M file).
//! - `Q5_1`, 32 in 24: `f16 d`, `f16 m`, `u32 qh`, `qs[16]` as Q5_0;
//!   `w = d * q + m`.
//! - `Q4_K`, 256 in 144: `f16 d`, `f16 dmin`, 12 bytes of 6-bit scales and
//!   mins for eight sub-blocks of 32, `qs[128]`: sub-block `2c` is the low
//!   nibbles of `qs[32c..32c + 32]`, `2c + 1` their high nibbles;
//!   `w = d * sc * q - dmin * m`.
//! - `Q6_K`, 256 in 210: `ql[128]`, `qh[64]`, `i8 scales[16]` (one per 16
//!   weights), `f16 d`; a weight's low 4 bits come from `ql`, its high 2 from
//!   `qh`; `w = d * scale * (q - 32)`.
//! - `Int8` (kvpage's per-channel int8), 32 in 32: `i8 q[32]`; `w = s * q` with
//!   one float scale `s` per weight row, kept beside the weights.

/// Weights per sub-block: the unit of the kernels' inner product.
pub const SUB: usize = 32;

/// A weight format the kernels read; its value is its code (its row of
/// [`FORMATS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Q8_0 = 0,
    Q4_0 = 1,
    Q4_1 = 2,
    Q4K = 3,
    Q6K = 4,
    Int8 = 5,
    Q5_0 = 6,
    Q5_1 = 7,
}

/// One format's row of [`FORMATS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FormatInfo {
    pub kind: QuantType,
    /// The name Python uses (`kvpage.quant`), also the suffix of the FFI targets
    /// (`kvpage_qmatmul_<name>`, `kvpage_dequantize_<name>`).
    pub name: &'static str,
    /// Weights per block.
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Each weight row carries one float scale beside its blocks.
    pub row_scaled: bool,
    /// GGUF's name of the tensor type stored in these blocks, if a GGUF file
    /// stores it.
    pub gguf: Option<&'static str>,
}

/// Every format, in the order of their codes: `FORMATS[kind as usize].kind ==
/// kind` (checked at compile time). Int8 (kvpage's per-channel int8) is a block
/// of 32 `i8` like the others' sub-blocks, so a row needs a multiple of 32
/// weights.
pub const FORMATS: [FormatInfo; 8] = [
    FormatInfo {
        kind: QuantType::Q8_0,
        name: "q8_0",
        block_elems: 32,
        block_bytes: 34,
        row_scaled: false,
        gguf: Some("Q8_0"),
    },
    FormatInfo {
        kind: QuantType::Q4_0,
        name: "q4_0",
        block_elems: 32,
        block_bytes: 18,
        row_scaled: false,
        gguf: Some("Q4_0"),
    },
    FormatInfo {
        kind: QuantType::Q4_1,
        name: "q4_1",
        block_elems: 32,
        block_bytes: 20,
        row_scaled: false,
        gguf: Some("Q4_1"),
    },
    FormatInfo {
        kind: QuantType::Q4K,
        name: "q4_k",
        block_elems: 256,
        block_bytes: 144,
        row_scaled: false,
        gguf: Some("Q4_K"),
    },
    FormatInfo {
        kind: QuantType::Q6K,
        name: "q6_k",
        block_elems: 256,
        block_bytes: 210,
        row_scaled: false,
        gguf: Some("Q6_K"),
    },
    FormatInfo {
        kind: QuantType::Int8,
        name: "int8",
        block_elems: 32,
        block_bytes: 32,
        row_scaled: true,
        gguf: None,
    },
    FormatInfo {
        kind: QuantType::Q5_0,
        name: "q5_0",
        block_elems: 32,
        block_bytes: 22,
        row_scaled: false,
        gguf: Some("Q5_0"),
    },
    FormatInfo {
        kind: QuantType::Q5_1,
        name: "q5_1",
        block_elems: 32,
        block_bytes: 24,
        row_scaled: false,
        gguf: Some("Q5_1"),
    },
];

// Each row sits at its code, and every block is whole sub-blocks.
const _: () = {
    let mut i = 0;
    while i < FORMATS.len() {
        assert!(FORMATS[i].kind as usize == i);
        assert!(FORMATS[i].block_elems.is_multiple_of(SUB));
        i += 1;
    }
};

impl QuantType {
    /// Every format, in the order of their codes ([`FORMATS`]' order).
    pub const ALL: [QuantType; FORMATS.len()] = {
        let mut all = [QuantType::Q8_0; FORMATS.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = FORMATS[i].kind;
            i += 1;
        }
        all
    };

    /// This format's row of [`FORMATS`].
    pub const fn info(self) -> FormatInfo {
        FORMATS[self as usize]
    }

    /// The name Python uses (`kvpage.quant`), also the suffix of the FFI target.
    pub fn name(self) -> &'static str {
        self.info().name
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Weights per block.
    pub const fn block_elems(self) -> usize {
        self.info().block_elems
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        self.info().block_bytes
    }

    /// Whether `q` is signed (`-128..=127`); otherwise it is `0..=63`, with the
    /// offset in `min`.
    pub const fn signed(self) -> bool {
        matches!(self, QuantType::Q8_0 | QuantType::Int8)
    }

    /// Whether each weight row carries one float scale beside its blocks.
    pub const fn row_scaled(self) -> bool {
        self.info().row_scaled
    }

    /// Bytes of one weight row of `inner` weights, `None` unless `inner` is a
    /// positive multiple of the block.
    pub fn row_bytes(self, inner: usize) -> Option<usize> {
        (inner > 0 && inner.is_multiple_of(self.block_elems()))
            .then(|| inner / self.block_elems() * self.block_bytes())
    }
}

/// One sub-block of [`SUB`] weights: `w[i] = scale[i / 16] * q[i] + min[i / 16]`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SubBlock {
    pub q: [i8; SUB],
    pub scale: [f32; 2],
    pub min: [f32; 2],
}

/// IEEE half precision to float, exactly.
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = if bits & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exponent = (bits >> 10) & 0x1f;
    let mantissa = u32::from(bits & 0x3ff);
    match exponent {
        0 => sign * mantissa as f32 * (1.0 / 16_777_216.0), // subnormal: m * 2^-24
        0x1f => f32::from_bits((u32::from(bits & 0x8000) << 16) | 0x7f80_0000 | (mantissa << 13)),
        _ => f32::from_bits(
            (u32::from(bits & 0x8000) << 16)
                | ((u32::from(exponent) + 112) << 23)
                | (mantissa << 13),
        ),
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Q4_K's 6-bit scale and min of sub-block `j` (0..8) from its 12 packed bytes.
pub fn q4k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Sub-block `j` (`0 .. block_elems / 32`) of one block of `kind`.
/// `row_scale` is the row's scale for [`QuantType::Int8`] (ignored otherwise).
///
/// Panics if `block` is shorter than the type's block.
pub fn unpack(kind: QuantType, block: &[u8], j: usize, row_scale: f32) -> SubBlock {
    let block = &block[..kind.block_bytes()];
    let mut out = SubBlock::default();
    let nibbles = |qs: &[u8], high: bool, q: &mut [i8; SUB]| {
        for (i, v) in q.iter_mut().enumerate() {
            let byte = qs[i];
            *v = if high { byte >> 4 } else { byte & 15 } as i8;
        }
    };
    match kind {
        QuantType::Q8_0 | QuantType::Int8 => {
            let (d, qs) = if kind == QuantType::Q8_0 {
                (f16_at(block, 0), &block[2..])
            } else {
                (row_scale, block)
            };
            for (v, &b) in out.q.iter_mut().zip(qs) {
                *v = b as i8;
            }
            out.scale = [d; 2];
        }
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let d = f16_at(block, 0);
            let (min, qs) = if kind == QuantType::Q4_0 {
                (-8.0 * d, &block[2..18])
            } else {
                (f16_at(block, 2), &block[4..20])
            };
            for (i, byte) in qs.iter().enumerate() {
                out.q[i] = (byte & 15) as i8;
                out.q[16 + i] = (byte >> 4) as i8;
            }
            out.scale = [d; 2];
            out.min = [min; 2];
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let d = f16_at(block, 0);
            let (min, at) = if kind == QuantType::Q5_0 {
                (-16.0 * d, 2)
            } else {
                (f16_at(block, 2), 4)
            };
            let qh = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            for (i, byte) in block[at + 4..at + 20].iter().enumerate() {
                let (high_low, high_high) = ((qh >> i) & 1, (qh >> (i + 16)) & 1);
                out.q[i] = ((byte & 15) | (high_low << 4) as u8) as i8;
                out.q[16 + i] = ((byte >> 4) | (high_high << 4) as u8) as i8;
            }
            out.scale = [d; 2];
            out.min = [min; 2];
        }
        QuantType::Q4K => {
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let (sc, m) = q4k_scale_min(&block[4..16], j);
            let qs = &block[16 + 32 * (j / 2)..][..32];
            nibbles(qs, j % 2 == 1, &mut out.q);
            let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
            out.scale = [scale; 2];
            out.min = [-min; 2];
        }
        QuantType::Q6K => {
            let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
            let d = f16_at(block, 208);
            let (half, chunk) = (j / 4, j % 4);
            let low = &ql[64 * half + 32 * (chunk & 1)..][..32];
            let high = &qh[32 * half..][..32];
            for l in 0..SUB {
                let lo = if chunk >= 2 { low[l] >> 4 } else { low[l] & 15 };
                let hi = (high[l] >> (2 * chunk)) & 3;
                out.q[l] = (lo | (hi << 4)) as i8;
            }
            for h in 0..2 {
                let scale = d * f32::from(scales[8 * half + 2 * chunk + h] as i8);
                out.scale[h] = scale;
                out.min[h] = -32.0 * scale;
            }
        }
    }
    out
}

/// The float weights of one row (`inner` weights; `row` holds its blocks), by
/// [`unpack`]: the reference the kernels are tested against.
pub fn dequantize_row(kind: QuantType, row: &[u8], inner: usize, row_scale: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(inner);
    for block in row
        .chunks_exact(kind.block_bytes())
        .take(inner / kind.block_elems())
    {
        for j in 0..kind.block_elems() / SUB {
            let sub = unpack(kind, block, j, row_scale);
            out.extend((0..SUB).map(|i| sub.scale[i / 16] * f32::from(sub.q[i]) + sub.min[i / 16]));
        }
    }
    out
}
