//! Instruction-set tiers, detected once, overridable with
//! `DEJAVU_ISA=scalar|portable|neon|dotprod|avx2|avx512`.
//!
//! - `Scalar`: the plain reference kernels (any CPU);
//! - `Portable`: `wide` vectors, no intrinsics (builds and vectorises on ARM too);
//! - `Neon`: aarch64 Advanced SIMD (every ARMv8-A core), byte dots by widening multiplies;
//! - `Dotprod`: aarch64 NEON with the ARMv8.2 dot product (`sdot`);
//! - `Avx2`: x86 AVX2 + FMA + F16C;
//! - `Avx512`: x86 AVX-512 F/BW/VL with VNNI (`vpdpbusd`).
//!
//! A tier's operations without a kernel of their own run the portable (`wide`) kernel.
use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    Portable,
    Neon,
    Dotprod,
    Avx2,
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 6] = [
        Isa::Scalar,
        Isa::Portable,
        Isa::Neon,
        Isa::Dotprod,
        Isa::Avx2,
        Isa::Avx512,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Portable => "portable",
            Isa::Neon => "neon",
            Isa::Dotprod => "dotprod",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar | Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::Dotprod => {
                Isa::Neon.is_supported() && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            #[allow(unreachable_patterns)] // every tier of this architecture is listed above
            _ => false,
        }
    }

    /// The best tier this CPU supports.
    pub fn detect() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Scalar)
    }

    /// Every tier this CPU supports, from the reference up (what the tests iterate over).
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why `DEJAVU_ISA` could not be honoured.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IsaError {
    #[error("DEJAVU_ISA={0}: unknown tier (scalar, portable, neon, dotprod, avx2, avx512)")]
    Unknown(String),
    #[error("DEJAVU_ISA={0}: this CPU does not support that tier (best: {1})")]
    Unsupported(String, Isa),
}

/// The tier chosen for this process: `DEJAVU_ISA` if set, else the best detected. Decided once.
pub fn selected() -> Result<Isa, IsaError> {
    static CHOICE: OnceLock<Result<Isa, IsaError>> = OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var("DEJAVU_ISA") {
            Ok(v) if !v.is_empty() => match Isa::from_name(&v) {
                None => Err(IsaError::Unknown(v)),
                Some(i) if !i.is_supported() => Err(IsaError::Unsupported(v, Isa::detect())),
                Some(i) => Ok(i),
            },
            _ => Ok(Isa::detect()),
        })
        .clone()
}
