//! The per-tensor types of llama.cpp's file types (`llama-quantize`'s `_S`/`_M`/`_L` mixes),
//! ported from `llama_tensor_get_type` (llama-quant.cpp) for the dense architectures we load.
//!
//! Rules (llama.cpp's, in its order; `more(i, n)`: layer i of n is in the first or last eighth or
//! every third layer between, llama.cpp's `use_more_bits`):
//! - the output matrix (and a tied token embedding): Q6_K, or Q8_0 when its width is not a
//!   multiple of the type's block or the file type is Q8_0;
//! - `attn_v` (and Phi-3's fused `attn_qkv`): Q2_K: Q4_K if 4+ query heads share a KV head,
//!   else Q3_K; Q2_K_S: Q4_K with 4+ heads per KV head; Q3_K_M: Q5_K for the first two, then
//!   Q4_K; Q3_K_L: Q5_K; IQ4_NL/IQ4_XS: Q5_K with 4+ heads per KV head; Q4_K_M/Q5_K_M: Q6_K where
//!   `more`; Q4_K_S: Q5_K for the first four; 70B-shaped models (80 layers) raise Q3_K/Q4_K to Q5_K;
//! - `ffn_down`: Q2_K: Q3_K; Q2_K_S: Q4_K in the first eighth; Q3_K_M: Q5_K in the first
//!   sixteenth, else Q4_K; Q3_K_L: Q5_K; Q4_K_M and Q5_K_M: Q6_K where `more`; IQ4_NL/IQ4_XS
//!   without an importance matrix: Q5_K in the first eighth; Q4_K_S: Q5_K in the first eighth;
//!   Q4_0/Q5_0 with an importance matrix: Q4_1/Q5_1 in the first eighth;
//! - `attn_output`: Q2_K: Q3_K; Q3_K_M: Q4_K; Q3_K_L: Q5_K;
//! - every other matrix: the file type's base type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, ...);
//! - then a matrix whose rows are not whole blocks falls back: Q2_K/Q3_K to Q4_0, Q4_K to Q5_0,
//!   Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL, and to F16 if still not whole.
//!
//! `--pure` skips the rules (the base type everywhere, with the fallback). The float file types
//! (F32, F16, BF16) store every matrix in that type.
use dejavu_backend_api::QuantType;

/// A `--type`: llama.cpp's file types (`general.file_type`) that we write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q2KS,
    Q3KS,
    Q3KM,
    Q3KL,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl FileType {
    /// Types llama-quantize refuses without an importance matrix (its IQ1/IQ2 types and
    /// Q2_K_S, of which this crate writes Q2_K_S): their 2-bit rows lose too much without one.
    pub fn needs_imatrix(self) -> bool {
        matches!(self, FileType::Q2KS)
    }

    pub const ALL: [FileType; 20] = [
        FileType::F32,
        FileType::F16,
        FileType::BF16,
        FileType::Q8_0,
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q2K,
        FileType::Q2KS,
        FileType::Q3KS,
        FileType::Q3KM,
        FileType::Q3KL,
        FileType::Q4KS,
        FileType::Q4KM,
        FileType::Q5KS,
        FileType::Q5KM,
        FileType::Q6K,
        FileType::IQ4NL,
        FileType::IQ4XS,
    ];

    /// llama.cpp's name (`llama-quantize`'s argument), lower case.
    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "f32",
            FileType::F16 => "f16",
            FileType::BF16 => "bf16",
            FileType::Q8_0 => "q8_0",
            FileType::Q4_0 => "q4_0",
            FileType::Q4_1 => "q4_1",
            FileType::Q5_0 => "q5_0",
            FileType::Q5_1 => "q5_1",
            FileType::Q2K => "q2_k",
            FileType::Q2KS => "q2_k_s",
            FileType::Q3KS => "q3_k_s",
            FileType::Q3KM => "q3_k_m",
            FileType::Q3KL => "q3_k_l",
            FileType::Q4KS => "q4_k_s",
            FileType::Q4KM => "q4_k_m",
            FileType::Q5KS => "q5_k_s",
            FileType::Q5KM => "q5_k_m",
            FileType::Q6K => "q6_k",
            FileType::IQ4NL => "iq4_nl",
            FileType::IQ4XS => "iq4_xs",
        }
    }

    /// A name as `llama-quantize` takes it (any case; `q3_k`, `q4_k`, `q5_k` are the `_m` mixes).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.to_ascii_lowercase();
        let s = match s.as_str() {
            "q3_k" => "q3_k_m",
            "q4_k" => "q4_k_m",
            "q5_k" => "q5_k_m",
            other => other,
        };
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// The names [`Self::parse`] takes, for messages.
    pub fn names() -> String {
        Self::ALL.map(|f| f.name()).join(", ")
    }

    /// llama.cpp's `general.file_type` value (`llama_ftype`).
    pub fn id(self) -> u32 {
        match self {
            FileType::F32 => 0,
            FileType::F16 => 1,
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q2K => 10,
            FileType::Q3KS => 11,
            FileType::Q3KM => 12,
            FileType::Q3KL => 13,
            FileType::Q4KS => 14,
            FileType::Q4KM => 15,
            FileType::Q5KS => 16,
            FileType::Q5KM => 17,
            FileType::Q6K => 18,
            FileType::Q2KS => 21,
            FileType::IQ4NL => 25,
            FileType::IQ4XS => 30,
            FileType::BF16 => 32,
        }
    }

    /// The type of every matrix no rule names (llama.cpp's `llama_ftype_get_default_type`).
    pub fn base(self) -> QuantType {
        match self {
            FileType::F32 => QuantType::F32,
            FileType::F16 => QuantType::F16,
            FileType::BF16 => QuantType::BF16,
            FileType::Q8_0 => QuantType::Q8_0,
            FileType::Q4_0 => QuantType::Q4_0,
            FileType::Q4_1 => QuantType::Q4_1,
            FileType::Q5_0 => QuantType::Q5_0,
            FileType::Q5_1 => QuantType::Q5_1,
            FileType::Q2K | FileType::Q2KS => QuantType::Q2K,
            FileType::Q3KS | FileType::Q3KM | FileType::Q3KL => QuantType::Q3K,
            FileType::Q4KS | FileType::Q4KM => QuantType::Q4K,
            FileType::Q5KS | FileType::Q5KM => QuantType::Q5K,
            FileType::Q6K => QuantType::Q6K,
            FileType::IQ4NL => QuantType::IQ4NL,
            FileType::IQ4XS => QuantType::IQ4XS,
        }
    }

    fn is_float(self) -> bool {
        matches!(self, FileType::F32 | FileType::F16 | FileType::BF16)
    }
}

/// What a matrix is to the rules (llama.cpp's `tensor_category`), from its GGUF name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    Output,
    AttnQkv,
    AttnV,
    AttnOutput,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    match name {
        "output.weight" => Category::Output,
        "token_embd.weight" => Category::TokenEmbd,
        n if n.contains("attn_qkv.weight") => Category::AttnQkv,
        n if n.contains("attn_v.weight") => Category::AttnV,
        n if n.contains("attn_output.weight") => Category::AttnOutput,
        n if n.contains("ffn_down") => Category::FfnDown,
        _ => Category::Other,
    }
}

/// The rules' state over one file, tensor after tensor in file order (llama.cpp counts the
/// `attn_v` and `ffn_down` matrices as it goes).
pub struct Mix {
    pub ftype: FileType,
    /// `--pure`: the base type everywhere.
    pub pure: bool,
    pub has_imatrix: bool,
    /// The output matrix is the token embedding.
    pub tied: bool,
    /// Query heads per KV head.
    pub n_gqa: usize,
    /// llama.cpp's 70B rule (80 layers).
    pub is_70b: bool,
    pub n_attn_v: usize,
    pub n_ffn_down: usize,
    i_attn_v: usize,
    i_ffn_down: usize,
}

impl Mix {
    /// The state for a file of `n_layers` layers (one `attn_v` and one `ffn_down` each).
    pub fn new(
        ftype: FileType,
        pure: bool,
        has_imatrix: bool,
        tied: bool,
        n_gqa: usize,
        n_layers: usize,
    ) -> Self {
        Self {
            ftype,
            pure,
            has_imatrix,
            tied,
            n_gqa,
            is_70b: n_layers == 80,
            n_attn_v: n_layers,
            n_ffn_down: n_layers,
            i_attn_v: 0,
            i_ffn_down: 0,
        }
    }

    /// The type of the next matrix, `name` with rows of `cols` elements (call in file order).
    pub fn tensor_type(&mut self, name: &str, cols: usize) -> QuantType {
        let base = self.ftype.base();
        if self.ftype.is_float() {
            return base;
        }
        let t = if self.pure {
            base
        } else {
            self.rule(name, cols, base)
        };
        fallback(t, cols)
    }

    fn rule(&mut self, name: &str, cols: usize, base: QuantType) -> QuantType {
        use FileType as F;
        use QuantType as Q;
        let f = self.ftype;
        let more = |i: usize, n: usize| {
            i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize) % 3 == 2
        };
        let cat = category(name);
        let mut t = base;
        if cat == Category::Output || (self.tied && cat == Category::TokenEmbd) {
            return if !cols.is_multiple_of(base.block_len()) || base == Q::Q8_0 {
                Q::Q8_0
            } else {
                Q::Q6K
            };
        }
        match cat {
            Category::AttnV | Category::AttnQkv => {
                let (i, n) = (self.i_attn_v, self.n_attn_v);
                t = match f {
                    F::Q2K if self.n_gqa >= 4 => Q::Q4K,
                    F::Q2K => Q::Q3K,
                    F::Q2KS if self.n_gqa >= 4 => Q::Q4K,
                    F::Q3KM if i < 2 => Q::Q5K,
                    F::Q3KM => Q::Q4K,
                    F::Q3KL => Q::Q5K,
                    F::IQ4NL | F::IQ4XS if self.n_gqa >= 4 => Q::Q5K,
                    F::Q4KM | F::Q5KM if more(i, n) => Q::Q6K,
                    F::Q4KS if i < 4 => Q::Q5K,
                    _ => t,
                };
                if self.is_70b && matches!(t, Q::Q3K | Q::Q4K) {
                    t = Q::Q5K;
                }
                self.i_attn_v += 1;
            }
            Category::FfnDown => {
                let (i, n) = (self.i_ffn_down, self.n_ffn_down);
                t = match f {
                    F::Q2K => Q::Q3K,
                    F::Q2KS if i < n / 8 => Q::Q4K,
                    F::Q3KM if i < n / 16 => Q::Q5K,
                    F::Q3KM => Q::Q4K,
                    F::Q3KL => Q::Q5K,
                    F::Q4KM if more(i, n) => Q::Q6K,
                    F::IQ4NL | F::IQ4XS if i < n / 8 && !self.has_imatrix => Q::Q5K,
                    F::Q5KM if more(i, n) => Q::Q6K,
                    F::Q4KS if i < n / 8 => Q::Q5K,
                    F::Q4_0 if self.has_imatrix && i < n / 8 => Q::Q4_1,
                    F::Q5_0 if self.has_imatrix && i < n / 8 => Q::Q5_1,
                    _ => t,
                };
                self.i_ffn_down += 1;
            }
            Category::AttnOutput => {
                t = match f {
                    F::Q2K => Q::Q3K,
                    F::Q3KM => Q::Q4K,
                    F::Q3KL => Q::Q5K,
                    _ => t,
                };
            }
            _ => {}
        }
        t
    }
}

/// llama.cpp's `tensor_type_fallback`: a type whose blocks do not divide `cols` becomes a
/// 32-wide one, else F16.
fn fallback(t: QuantType, cols: usize) -> QuantType {
    if cols.is_multiple_of(t.block_len()) {
        return t;
    }
    let t = match t {
        QuantType::Q2K | QuantType::Q3K => QuantType::Q4_0,
        QuantType::Q4K => QuantType::Q5_0,
        QuantType::Q5K => QuantType::Q5_1,
        QuantType::Q6K => QuantType::Q8_0,
        QuantType::IQ4XS => QuantType::IQ4NL,
        other => other,
    };
    if cols.is_multiple_of(t.block_len()) {
        t
    } else {
        QuantType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The types of one 32-layer GQA-8 model's `attn_v` and `ffn_down` under Q4_K_M and Q3_K_M,
    /// counted against llama.cpp's rules by hand.
    #[test]
    fn mixes_follow_llama_cpp() {
        let mut m = Mix::new(FileType::Q4KM, false, false, false, 4, 32);
        let v: Vec<QuantType> = (0..32)
            .map(|l| m.tensor_type(&format!("blk.{l}.attn_v.weight"), 4096))
            .collect();
        // more(i, 32): i < 4, i >= 28, or (i - 4) % 3 == 2 (6, 9, ..., 27).
        let six: Vec<usize> = (0..32).filter(|&i| v[i] == QuantType::Q6K).collect();
        let want: Vec<usize> = (0..32)
            .filter(|&i| !(4..28).contains(&i) || (i - 4) % 3 == 2)
            .collect();
        assert_eq!(six, want);
        assert!(v
            .iter()
            .all(|&t| t == QuantType::Q6K || t == QuantType::Q4K));
        assert_eq!(m.tensor_type("output.weight", 4096), QuantType::Q6K);
        assert_eq!(m.tensor_type("blk.0.attn_q.weight", 4096), QuantType::Q4K);
        // Rows that are not whole super-blocks (Qwen2.5-0.5B's 896).
        assert_eq!(m.tensor_type("blk.0.attn_q.weight", 896), QuantType::Q5_0);
        assert_eq!(m.tensor_type("output.weight", 896), QuantType::Q8_0);
        let mut m = Mix::new(FileType::Q3KM, false, false, false, 4, 32);
        let d: Vec<QuantType> = (0..32)
            .map(|l| m.tensor_type(&format!("blk.{l}.ffn_down.weight"), 14336))
            .collect();
        assert_eq!(&d[..3], &[QuantType::Q5K, QuantType::Q5K, QuantType::Q4K]);
        assert_eq!(
            m.tensor_type("blk.0.attn_output.weight", 4096),
            QuantType::Q4K
        );
        assert_eq!(m.tensor_type("blk.0.attn_v.weight", 4096), QuantType::Q5K);
        // Tied embeddings take the output's type; --pure takes the base everywhere.
        let mut m = Mix::new(FileType::Q5KM, false, false, true, 1, 2);
        assert_eq!(m.tensor_type("token_embd.weight", 2048), QuantType::Q6K);
        let mut m = Mix::new(FileType::Q5KM, true, false, true, 1, 2);
        assert_eq!(m.tensor_type("token_embd.weight", 2048), QuantType::Q5K);
        assert_eq!(m.tensor_type("token_embd.weight", 2080), QuantType::Q5_1);
        assert_eq!(m.tensor_type("token_embd.weight", 2081), QuantType::F16);
        for f in FileType::ALL {
            assert_eq!(FileType::parse(&f.name().to_uppercase()), Some(f));
        }
        assert_eq!(FileType::parse("Q4_K"), Some(FileType::Q4KM));
        assert_eq!(FileType::parse("q7_k"), None);
    }
}
