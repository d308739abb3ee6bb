//! The NEON body of the Q4_0 / Q8_0 kernel, for aarch64 cores with the dot-product extension (ARMv8.2's `SDOT`,
//! optional before ARMv8.4): `SDOT` sums 4 signed byte products into each 32-bit lane, as `vpdpbusd` does with one
//! operand unsigned. Q4_0: nibbles 0..15 × inputs, less 8 · Σx; Q8_0: codes × inputs (the stored inputs, + 128 for
//! the VNNI body, back to signed). Each lane collects one output's exact integer block sum and takes the fused
//! multiply-add of the other bodies, so all give the same bits. A pass covers one input row and the whole panel:
//! sixteen 4-lane integer block sums in registers, the float accumulators in the output row (in L1).

use std::arch::aarch64::*;

use super::layout::{Codes, Q8Rows, QMatrix, QK};
use crate::kernels::panels::PANEL;

/// `out[o]` for input row `i` and panel `p`; `unpacked` as in the VNNI body.
///
/// # Safety
/// The CPU must have NEON and the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn panel_dots(m: &QMatrix, xq: &Q8Rows, p: usize, i: usize, unpacked: &[u8], out: &mut [f32; PANEL]) {
    let (nb, bb) = (m.nb, m.codes.block_bytes());
    assert!(xq.d.len() >= (i + 1) * nb && m.d.len() >= (p + 1) * nb * PANEL);
    assert!(unpacked.is_empty() || unpacked.len() >= nb * 8 * 4 * PANEL);
    let (low, flip) = (vdupq_n_u8(0x0F), vdupq_n_u8(0x80));
    *out = [0.0; PANEL];
    for b in 0..nb {
        let (pb, ib) = (p * nb + b, i * nb + b);
        // Vector `t` of group `g`: rows 4t.., each row's 4 bytes side by side.
        let at = |codes: *const u8, g: usize, t: usize| vld1q_u8(codes.add(g * 4 * PANEL + 16 * t));
        let x = |t: usize| {
            vreinterpretq_u8_u32(vdupq_n_u32((xq.qs.as_ptr().add(ib * QK + t) as *const u32).read_unaligned()))
        };
        let mut sums = [vdupq_n_s32(if m.codes == Codes::Nibbles { xq.start[ib] } else { 0 }); 16];
        match m.codes {
            Codes::Bytes => {
                let w = m.qs.as_ptr().add(pb * PANEL * bb);
                for g in 0..8 {
                    let xs = veorq_u8(x(4 * g), flip);
                    for (t, s) in sums.iter_mut().enumerate() {
                        *s = sdot(*s, at(w, g, t), xs);
                    }
                }
            }
            Codes::Nibbles if unpacked.is_empty() => {
                let w = m.qs.as_ptr().add(pb * PANEL * bb);
                for g in 0..4 {
                    let (xl, xh) = (x(4 * g), x(16 + 4 * g));
                    for (t, s) in sums.iter_mut().enumerate() {
                        let raw = at(w, g, t);
                        *s = sdot(sdot(*s, vandq_u8(raw, low), xl), vshrq_n_u8::<4>(raw), xh);
                    }
                }
            }
            Codes::Nibbles => {
                let u = unpacked.as_ptr().add(b * 8 * 4 * PANEL);
                for g in 0..8 {
                    let xg = x(4 * g);
                    for (t, s) in sums.iter_mut().enumerate() {
                        *s = sdot(*s, at(u, g, t), xg);
                    }
                }
            }
        }
        let dx = vdupq_n_f32(xq.d[ib]);
        for (t, s) in sums.iter().enumerate() {
            let (o, dw) = (out.as_mut_ptr().add(4 * t), vld1q_f32(m.d.as_ptr().add(pb * PANEL + 4 * t)));
            vst1q_f32(o, vfmaq_f32(vld1q_f32(o), vcvtq_f32_s32(*s), vmulq_f32(dw, dx)));
        }
    }
}

/// `SDOT`: each 32-bit lane of `s` plus the four products of its signed bytes in `a` and `b` (the intrinsic is not
/// stable Rust yet).
///
/// # Safety
/// The CPU must have the dot-product extension.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(s: int32x4_t, a: uint8x16_t, b: uint8x16_t) -> int32x4_t {
    let mut r = s;
    std::arch::asm!(
        "sdot {r:v}.4s, {a:v}.16b, {b:v}.16b",
        r = inout(vreg) r,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    r
}

/// One block of 32 activations quantized as the x86 bodies' `quantize_block` does it, bit for bit: `d = amax / 127`,
/// `q = round(x / d)` to nearest (ties to even), saturated to i8. Returns `d` (before its f16 rounding).
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantize_block(xb: &[f32], q: &mut [i8; QK]) -> f32 {
    assert_eq!(xb.len(), QK);
    let v: [float32x4_t; 8] = std::array::from_fn(|j| vld1q_f32(xb.as_ptr().add(4 * j)));
    let amax = vmaxvq_f32(v.iter().fold(vdupq_n_f32(0.0), |m, &x| vmaxq_f32(m, vabsq_f32(x))));
    let d = amax / 127.0;
    let id = vdupq_n_f32(if d != 0.0 { 1.0 / d } else { 0.0 });
    for (j, pair) in v.chunks_exact(2).enumerate() {
        let r = |x: float32x4_t| vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(x, id)));
        let bytes = vqmovn_s16(vcombine_s16(r(pair[0]), r(pair[1])));
        vst1_s8(q.as_mut_ptr().add(8 * j), bytes);
    }
    d
}
