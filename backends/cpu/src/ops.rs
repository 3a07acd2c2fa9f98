//! Element-wise and per-token ops of a transformer layer: RMSNorm, RoPE, SwiGLU. Scalar
//! references; each states its formula.
use dejavu_backend_api::RopeStyle;

/// Per token of width `w.len()`: `out = x / sqrt(mean(x^2) + eps) * w` (sum of squares in f64).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xt, ot) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xt.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let scale = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in ot.iter_mut().zip(xt).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// Rotary embedding: for pair `i < head_dim/2` of a head at position `p`, angle
/// `p * theta^(-2i/head_dim)`; the pair is `(x[2i], x[2i+1])` (Interleaved) or `(x[i], x[i+d/2])` (Neox).
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos0: usize,
    theta: f32,
    style: RopeStyle,
) {
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    for (t, xt) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        let p = (pos0 + t) as f64;
        let cs: Vec<(f32, f32)> = inv_freq
            .iter()
            .map(|f| ((p * f).cos() as f32, (p * f).sin() as f32))
            .collect();
        for head in xt.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// SwiGLU: `gate[i] = gate[i] * sigmoid(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}
