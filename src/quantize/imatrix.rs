//! Importance matrices, llama.cpp's method (`llama-imatrix`): run the source model densely over a
//! calibration text in chunks of `ctx` tokens and keep, for every matrix, the mean over all tokens
//! of the square of each of its input columns. `quantize` weights each element's rounding error
//! by its column's value (ggml's `quantize_*_impl` with `quant_weights`).
//!
//! Inputs per matrix: Q, K, V (and Phi-3's fused QKV) read the attention input; the attention
//! output matrix reads the attention output (every head); gate and up read the MLP input; down
//! reads the MLP activations; the output head (and a token embedding tied to it, which llama.cpp
//! records under that name) reads the final hidden state. Other matrices (OPT's projections and
//! an untied token embedding, which is a lookup) get none.
use crate::exec::{Engine, Logits};
use crate::sparsity::policy::Policy;
use crate::Result;

/// Per layer the four input statistics, and the output head's; each a mean of squares.
#[derive(Clone)]
pub struct Imatrix {
    attn_in: Vec<Vec<f32>>,
    attn_out: Vec<Vec<f32>>,
    mlp_in: Vec<Vec<f32>>,
    down_in: Vec<Vec<f32>>,
    hidden: Vec<f32>,
    tied: bool,
    /// Tokens the statistics are over.
    pub tokens: usize,
    /// Chunks of `ctx` tokens run.
    pub chunks: usize,
}

/// `acc[i] += sum over rows of row[i]^2` for `rows` of width `acc.len()`.
fn add_squares(acc: &mut Vec<f32>, rows: &[f32], width: usize) {
    acc.resize(width, 0.0);
    for r in rows.chunks_exact(width) {
        acc.iter_mut().zip(r).for_each(|(a, x)| *a += x * x);
    }
}

impl Imatrix {
    /// Run `engine`'s model over `tokens` in chunks of `ctx` (at most `max_chunks`), as
    /// `llama-imatrix` does.
    pub fn collect(
        engine: &Engine,
        tokens: &[u32],
        ctx: usize,
        max_chunks: Option<usize>,
    ) -> Result<Self> {
        let c = &engine.model.config;
        let chunks: Vec<&[u32]> = (tokens.chunks(ctx.max(2)))
            .filter(|ch| ch.len() >= 2)
            .take(max_chunks.unwrap_or(usize::MAX))
            .collect();
        if chunks.is_empty() {
            return Err(crate::Error::Invalid(format!(
                "--imatrix: the text has {} tokens, fewer than one chunk of 2",
                tokens.len()
            )));
        }
        let nl = c.n_layers;
        let mut m = Self {
            attn_in: vec![Vec::new(); nl],
            attn_out: vec![Vec::new(); nl],
            mlp_in: vec![Vec::new(); nl],
            down_in: vec![Vec::new(); nl],
            hidden: Vec::new(),
            tied: c.tied_output,
            tokens: 0,
            chunks: chunks.len(),
        };
        let mut s = engine.decoder(&Policy::dense(c))?;
        s.capture(true);
        let bar = crate::progress::bar(chunks.len() as u64, "importance matrix");
        for chunk in chunks {
            s.truncate(0);
            let n = chunk.len();
            let h = s.run(chunk, Logits::Hidden(0, n))?;
            add_squares(&mut m.hidden, h, c.d_embed);
            let cap = s.take_capture();
            // A layer the capture did not record (none should be missing) adds nothing.
            fn of(v: &[Vec<f32>], l: usize) -> &[f32] {
                v.get(l).map_or(&[], |x| x.as_slice())
            }
            for l in 0..nl {
                let (attn_in, mlp_in) = (of(&cap.attn_in, l), of(&cap.mlp_in, l));
                add_squares(&mut m.attn_in[l], attn_in, c.d_model);
                add_squares(&mut m.mlp_in[l], mlp_in, c.d_model);
                let sq = of(&cap.attn_out_sq, l);
                let n = sq.len().max(m.attn_out[l].len());
                m.attn_out[l].resize(n, 0.0);
                m.attn_out[l].iter_mut().zip(sq).for_each(|(a, s)| *a += s);
                if !mlp_in.is_empty() {
                    let act = s.mlp_activations(l, mlp_in)?;
                    add_squares(&mut m.down_in[l], &act, c.n_ff);
                }
            }
            m.tokens += n;
            bar.inc(1);
        }
        bar.finish_and_clear();
        let inv = 1.0 / m.tokens as f32;
        let all = (m.attn_in.iter_mut())
            .chain(&mut m.attn_out)
            .chain(&mut m.mlp_in)
            .chain(&mut m.down_in)
            .chain(std::iter::once(&mut m.hidden));
        for v in all {
            v.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(m)
    }

    /// The column importances of the matrix named `name` (a GGUF tensor name), if it has any.
    pub fn for_tensor(&self, name: &str) -> Option<&[f32]> {
        if name == "output.weight" || (self.tied && name == "token_embd.weight") {
            return Some(&self.hidden);
        }
        let rest = name.strip_prefix("blk.")?;
        let (l, t) = rest.split_once('.')?;
        let l: usize = l.parse().ok()?;
        let v = match t {
            "attn_q.weight" | "attn_k.weight" | "attn_v.weight" | "attn_qkv.weight" => {
                &self.attn_in
            }
            "attn_output.weight" => &self.attn_out,
            "ffn_gate.weight" | "ffn_up.weight" => &self.mlp_in,
            "ffn_down.weight" => &self.down_in,
            _ => return None,
        };
        v.get(l).map(|v| v.as_slice()).filter(|v| !v.is_empty())
    }
}
