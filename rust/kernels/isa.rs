//! The instruction-set level tinyloop's kernels run at, chosen once, when a kernel first asks: the best level the
//! CPU has, or a lower one `TINYLOOP_ISA` names (`avx512`, `avx2`, `neon`, `scalar`; a level the CPU lacks falls
//! back to the best it has). Each kernel with a body for a level checks the level per call and otherwise runs its
//! portable body, which the compiler vectorizes for the build's baseline.

use std::sync::OnceLock;

/// Levels. Each architecture has its own ladder of them (`ladder`), lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// The portable kernels only.
    Scalar,
    /// x86: AVX2, FMA and F16C.
    Avx2,
    /// x86: AVX-512 F, BW, VL and DQ (with AVX2, FMA, F16C); with VNNI, the Q4_0 / Q8_0 kernel's fastest body.
    Avx512,
    /// aarch64: Advanced SIMD (NEON), with the half-precision conversions every ARMv8-A core has.
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    fn parse(name: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon].into_iter().find(|l| l.name() == name)
    }
}

/// This architecture's levels, lowest first.
pub fn ladder() -> &'static [Isa] {
    if cfg!(target_arch = "x86_64") {
        &[Isa::Scalar, Isa::Avx2, Isa::Avx512]
    } else if cfg!(target_arch = "aarch64") {
        &[Isa::Scalar, Isa::Neon]
    } else {
        &[Isa::Scalar]
    }
}

/// The best level this CPU has, and whether it has that level's integer dot product (x86: AVX-512 VNNI; aarch64:
/// the dot-product extension).
fn detected() -> (Isa, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return (Isa::Avx512, has!("avx512vnni"));
        }
        if avx2 {
            return (Isa::Avx2, false);
        }
    }
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return (Isa::Neon, std::arch::is_aarch64_feature_detected!("dotprod"));
    }
    (Isa::Scalar, false)
}

/// The levels this CPU runs, lowest first, whatever `TINYLOOP_ISA` asks (for tests that run every level side by
/// side).
pub fn runnable() -> Vec<Isa> {
    let best = detected().0;
    let top = ladder().iter().position(|&l| l == best).unwrap_or(0);
    ladder()[..=top].to_vec()
}

/// `TINYLOOP_ISA` as a level, if set: an error for a name that is not one.
pub fn requested() -> Result<Option<Isa>, String> {
    match std::env::var("TINYLOOP_ISA") {
        Err(_) => Ok(None),
        Ok(name) => Isa::parse(name.trim()).map(Some).ok_or_else(|| {
            format!("TINYLOOP_ISA={name:?} is not a level: one of \"avx512\", \"avx2\", \"neon\", \"scalar\"")
        }),
    }
}

fn chosen() -> (Isa, bool) {
    static CHOSEN: OnceLock<(Isa, bool)> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let (best, dot) = detected();
        // An unknown name is reported where a model loads (`Engine::load`); the kernels use the best level, as
        // they do for a level this CPU lacks (another architecture's, or one above its best).
        let level = requested().ok().flatten().filter(|r| runnable().contains(r)).unwrap_or(best);
        (level, dot && level == best)
    })
}

/// The level the kernels run at.
pub fn level() -> Isa {
    chosen().0
}

/// The AVX-512 kernels run.
#[inline]
pub fn avx512() -> bool {
    level() == Isa::Avx512
}

/// The AVX-512 VNNI body of the Q4_0 / Q8_0 kernel runs.
pub fn vnni() -> bool {
    chosen().1 && level() == Isa::Avx512
}

/// The NEON dot-product body of the Q4_0 / Q8_0 kernel runs.
pub fn dotprod() -> bool {
    chosen().1 && level() == Isa::Neon
}

/// The level in use as people read it: `avx512+vnni`, `avx512`, `avx2`, `neon+dotprod`, `neon` or `scalar`.
pub fn describe() -> String {
    match (level(), chosen().1) {
        (Isa::Avx512, true) => "avx512+vnni".to_string(),
        (Isa::Neon, true) => "neon+dotprod".to_string(),
        (l, _) => l.name().to_string(),
    }
}
