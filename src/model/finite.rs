//! Non-finite weights are refused at load, not turned into garbage (`ppl: NaN`, token 0 forever).
//!
//! Contract: norms and biases (read whole at load) are checked in full where they are read
//! (`weights::Table::vector`). Matrices are checked here, by their block scales (the f16 `d`,
//! and `m`/`dmin` where the type has one) or, for float types, their values: the token embedding
//! and a separate output matrix in full (every step reads the output head anyway), every other
//! matrix at [`SAMPLES`] blocks spread over it. A non-finite value the samples miss makes
//! non-finite logits, which `text::generate::check_logits` refuses at run time.
use super::weights::{Model, WeightRef};
use crate::{Error, Result};
use dejavu_backend_api::QuantType;

/// Blocks checked per matrix that is not checked in full.
pub const SAMPLES: usize = 4096;

/// Whether block `b` (its bytes) of type `q` holds only finite scales or values.
fn block_finite(q: QuantType, b: &[u8]) -> bool {
    let f16_at = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).is_finite();
    match q {
        QuantType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite(),
        QuantType::F16 => f16_at(0),
        QuantType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).is_finite(),
        _ => q.scale_offsets().iter().all(|&o| f16_at(o)),
    }
}

impl Model {
    /// Check every matrix as the module doc says; the first bad one is an error naming it.
    pub fn check_finite(&self) -> Result<()> {
        let full = [Some(&self.token_embd), Some(&self.output)];
        let mut all: Vec<(&WeightRef, bool)> = full.iter().flatten().map(|w| (*w, true)).collect();
        all.extend(
            self.pos_embd
                .iter()
                .chain(&self.proj_in)
                .chain(&self.proj_out)
                .map(|w| (w, false)),
        );
        all.extend(
            self.layers
                .iter()
                .flat_map(|l| l.matrices())
                .map(|w| (w, false)),
        );
        for (w, whole) in all {
            let bytes = self.weight(w).data;
            let bb = w.qtype.block_bytes();
            let blocks = bytes.len() / bb;
            let step = match whole {
                true => 1,
                false => (blocks / SAMPLES).max(1),
            };
            let bad = (0..blocks)
                .step_by(step)
                .find(|&i| !block_finite(w.qtype, &bytes[i * bb..(i + 1) * bb]));
            if let Some(i) = bad {
                return Err(Error::BadTensor {
                    tensor: w.name.clone(),
                    reason: format!("a non-finite (NaN or infinite) value or scale in block {i}"),
                });
            }
        }
        Ok(())
    }
}

/// A vector read at load (a norm or a bias): every value finite.
pub fn check_vector(name: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::BadTensor {
            tensor: name.into(),
            reason: format!("a non-finite value (NaN or infinite) at element {i}"),
        }),
    }
}
