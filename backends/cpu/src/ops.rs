//! Element-wise and per-token ops of a transformer layer: RMSNorm, LayerNorm, RoPE, the MLP
//! activations. Scalar references; each states its formula.
use dejavu_backend_api::{Activation, RopeStyle};

/// Per token of width `w.len()`: `out = x / sqrt(mean(x^2) + eps) * w` (sum of squares in f64,
/// in 8 interleaved partial sums, which the compiler turns into vector adds).
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xt, ot) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut part = [0f64; 8];
        let mut lanes = xt.chunks_exact(8);
        for c in &mut lanes {
            for (p, &v) in part.iter_mut().zip(c) {
                *p += (v as f64) * (v as f64);
            }
        }
        let tail: f64 = lanes
            .remainder()
            .iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum();
        let ss = part.iter().sum::<f64>() + tail;
        let scale = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in ot.iter_mut().zip(xt).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// Per token of width `w.len()`: `out = (x - mean) / sqrt(var + eps) * w + b` (biased variance,
/// as PyTorch's LayerNorm; moments in f64). `b` absent is 0.
pub fn layernorm(x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xt, ot) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xt.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = xt.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (i, (o, &v)) in ot.iter_mut().zip(xt).enumerate() {
            let n = ((v as f64 - mean) * inv) as f32;
            *o = n * w[i] + b.map_or(0.0, |b| b[i]);
        }
    }
}

/// Rotary embedding: for pair `i < head_dim/2` of a head at position `p`, angle
/// `p * theta^(-2i/head_dim) / factors[i]` (`factors`: Llama 3's per-pair divisors, 1 without);
/// the pair is `(x[2i], x[2i+1])` (Interleaved) or `(x[i], x[i+d/2])` (Neox). `factors`, when
/// given, holds `head_dim / 2` values. The angles' cosines and sines come from [`rope_table`].
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos0: usize,
    theta: f32,
    style: RopeStyle,
    factors: Option<&[f32]>,
) {
    let half = head_dim / 2;
    for (t, xt) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
        rope_table(theta, head_dim, factors, pos0 + t, |cs| {
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
        })
    }
}

/// The rotations of one RoPE setting (its key: theta's and the factors' bits, and the head
/// width): the pairs' frequencies, and the cosines and sines of the positions met so far.
struct RopeTables {
    key: (u32, usize, Vec<u32>),
    inv_freq: Vec<f64>,
    at: std::collections::HashMap<usize, Box<[(f32, f32)]>>,
}

/// Settings kept per thread (Gemma alternates two thetas), and positions kept per setting (a
/// setting past it starts over): at most 2 x 4096 x 64 pairs x 8 bytes, 4 MiB, at a head width
/// of 128.
const ROPE_SETTINGS: usize = 2;
const ROPE_POSITIONS: usize = 4096;

std::thread_local! {
    static ROPE: std::cell::RefCell<Vec<RopeTables>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` of the `head_dim / 2` pairs' `(cos, sin)` at position `p` (in f64, rounded to f32):
/// computed once per setting and position on this thread, so the layers of a step and the
/// queries and keys of a row share them (they cost a `powf`, a `cos` and a `sin` per pair).
fn rope_table<R>(
    theta: f32,
    head_dim: usize,
    factors: Option<&[f32]>,
    p: usize,
    f: impl FnOnce(&[(f32, f32)]) -> R,
) -> R {
    let bits = |f: &[f32]| f.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // Compared in place: the key is built (an allocation, with factors) only for a new setting.
    let same = |(t, d, f): &(u32, usize, Vec<u32>)| {
        *t == theta.to_bits()
            && *d == head_dim
            && f.iter()
                .copied()
                .eq(factors.unwrap_or(&[]).iter().map(|v| v.to_bits()))
    };
    ROPE.with_borrow_mut(|sets| {
        let i = match sets.iter().position(|t| same(&t.key)) {
            Some(i) => i,
            None => {
                if sets.len() == ROPE_SETTINGS {
                    sets.remove(0);
                }
                let key = (theta.to_bits(), head_dim, factors.map_or(Vec::new(), bits));
                let inv_freq = (0..head_dim / 2)
                    .map(|i| {
                        let f = factors.map_or(1.0, |f| f[i] as f64);
                        (theta as f64).powf(-2.0 * i as f64 / head_dim as f64) / f
                    })
                    .collect();
                let at = Default::default();
                sets.push(RopeTables { key, inv_freq, at });
                sets.len() - 1
            }
        };
        let t = &mut sets[i];
        if t.at.len() >= ROPE_POSITIONS && !t.at.contains_key(&p) {
            t.at.clear();
        }
        let inv_freq = &t.inv_freq;
        let cs = t.at.entry(p).or_insert_with(|| {
            let pf = p as f64;
            (inv_freq.iter())
                .map(|f| ((pf * f).cos() as f32, (pf * f).sin() as f32))
                .collect()
        });
        f(cs)
    })
}

/// Gated activation (SwiGLU for `Silu`, gated ReLU for `Relu`): `gate[i] = act(gate[i]) * up[i]`.
pub fn glu(act: Activation, gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = act.apply(*g) * u;
    }
}

/// `x[i] = s * x[i]`, then with a cap `c`: `c * tanh(x[i] / c)`.
pub fn scale_cap(x: &mut [f32], s: f32, cap: Option<f32>) {
    match cap {
        Some(c) => x.iter_mut().for_each(|v| *v = c * (s * *v / c).tanh()),
        None => x.iter_mut().for_each(|v| *v *= s),
    }
}

/// `x[i] = act(x[i])`.
pub fn activate(act: Activation, x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = act.apply(*v));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memoized angles equal the formula's bit for bit across more settings than are kept
    /// (each evicting another), positions past the kept count, and repeats.
    #[test]
    fn rope_tables_survive_eviction() {
        let hd = 8;
        let direct = |theta: f32, f: Option<&[f32]>, p: usize| -> Vec<f32> {
            let mut x: Vec<f32> = (0..hd).map(|i| i as f32 - 3.5).collect();
            for i in 0..hd / 2 {
                let fr = (theta as f64).powf(-2.0 * i as f64 / hd as f64)
                    / f.map_or(1.0, |f| f[i] as f64);
                let (c, s) = ((p as f64 * fr).cos() as f32, (p as f64 * fr).sin() as f32);
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0 * c - x1 * s;
                x[2 * i + 1] = x0 * s + x1 * c;
            }
            x
        };
        let factors = [1.0f32, 2.0, 4.0, 8.0];
        let settings: [(f32, Option<&[f32]>); 3] =
            [(10000.0, None), (500000.0, None), (10000.0, Some(&factors))];
        for round in 0..2 {
            for p in [0, 7, ROPE_POSITIONS + 3, 7, 2 * ROPE_POSITIONS + round] {
                for &(theta, f) in &settings {
                    let mut x: Vec<f32> = (0..hd).map(|i| i as f32 - 3.5).collect();
                    rope(&mut x, 1, hd, p, theta, RopeStyle::Interleaved, f);
                    assert_eq!(x, direct(theta, f, p), "theta {theta} {f:?} position {p}");
                }
            }
        }
        // A position table filled past its bound starts over.
        for p in 0..ROPE_POSITIONS + 2 {
            let mut x = vec![1.0f32; hd];
            rope(&mut x, 1, hd, p, 10000.0, RopeStyle::Neox, None);
        }
        let mut x: Vec<f32> = (0..hd).map(|i| i as f32 - 3.5).collect();
        rope(&mut x, 1, hd, 5, 10000.0, RopeStyle::Interleaved, None);
        assert_eq!(x, direct(10000.0, None, 5));
    }

    #[test]
    fn rmsnorm_formula() {
        let x = [3.0f32, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 8];
        rmsnorm(&x, &w, 0.0, &mut out);
        // token 0: rms = sqrt(25/4) = 2.5
        assert_eq!(&out[..4], &[1.2, 3.2, 0.0, 0.0]);
        assert_eq!(&out[4..], &[1.0, 2.0, 1.0, 1.0]);
    }

    #[test]
    fn rope_pairs_and_angles() {
        // head_dim 4, theta 100: pair 0 angle p, pair 1 angle p / 10.
        let p = 3usize;
        let x0 = [1.0f32, 2.0, 3.0, 4.0];
        let rot = |a: f32, b: f32, ang: f64| {
            let (c, s) = (ang.cos() as f32, ang.sin() as f32);
            (a * c - b * s, a * s + b * c)
        };
        let mut x = x0;
        rope(&mut x, 1, 4, p, 100.0, RopeStyle::Interleaved, None);
        let (a, b) = rot(1.0, 2.0, 3.0);
        let (c, d) = rot(3.0, 4.0, 0.3);
        for (got, want) in x.iter().zip([a, b, c, d]) {
            assert!((got - want).abs() < 1e-6);
        }
        let mut x = x0;
        rope(&mut x, 1, 4, p, 100.0, RopeStyle::Neox, None);
        let (a, c) = rot(1.0, 3.0, 3.0);
        let (b, d) = rot(2.0, 4.0, 0.3);
        for (got, want) in x.iter().zip([a, b, c, d]) {
            assert!((got - want).abs() < 1e-6);
        }
        // Position 0 is the identity; a batch rotates token t at pos0 + t.
        let mut x = [x0, x0].concat();
        rope(&mut x, 1, 4, 0, 100.0, RopeStyle::Neox, None);
        assert_eq!(&x[..4], &x0);
        let mut one = x0;
        rope(&mut one, 1, 4, 1, 100.0, RopeStyle::Neox, None);
        assert_eq!(&x[4..], &one);
        // Frequency divisors (Llama 3): pair 0 at angle p / 1, pair 1 at (p / 10) / 8.
        let mut x = x0;
        rope(&mut x, 1, 4, p, 100.0, RopeStyle::Neox, Some(&[1.0, 8.0]));
        let (a, c) = rot(1.0, 3.0, 3.0);
        let (b, d) = rot(2.0, 4.0, 0.3 / 8.0);
        for (got, want) in x.iter().zip([a, b, c, d]) {
            assert!((got - want).abs() < 1e-6);
        }
    }

    #[test]
    fn gelu_tanh_and_scale_cap_formulas() {
        // GELU's tanh approximation at +-1 and 3 (worked in f64: 0.841192, -0.158808,
        // 2.996363); 0 stays 0.
        let mut x = [1.0f32, -1.0, 3.0, 0.0];
        activate(Activation::GeluTanh, &mut x);
        let want = [0.841192, -0.158808, 2.996363, 0.0];
        assert!(
            x.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5),
            "{x:?}"
        );
        let mut y = [1.0f32, -2.0, 10.0];
        scale_cap(&mut y, 2.0, None);
        assert_eq!(y, [2.0, -4.0, 20.0]);
        // Capped at 5: 5 tanh(2/5), 5 tanh(-4/5), 5 tanh(4): near the cap, never past it.
        scale_cap(&mut y, 1.0, Some(5.0));
        let want = [1.899741, -3.320184, 4.996646];
        assert!(
            y.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-5),
            "{y:?}"
        );
    }

    #[test]
    fn glu_formula() {
        let mut g = [0.0f32, 1.0, -2.0];
        glu(Activation::Silu, &mut g, &[5.0, 2.0, 1.0]);
        let silu = |x: f32| x / (1.0 + (-x).exp());
        // Within 1e-6: `exp` may round differently from call to call (Miri models that).
        let want = [0.0, silu(1.0) * 2.0, silu(-2.0)];
        assert!(
            g.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6),
            "{g:?} {want:?}"
        );
        let mut g = [0.5f32, -1.0, 2.0];
        glu(Activation::Relu, &mut g, &[4.0, 3.0, -1.0]);
        assert_eq!(g, [2.0, 0.0, -2.0]);
        let mut x = [-0.0f32, -3.0, 1.5];
        activate(Activation::Relu, &mut x);
        assert_eq!(x, [0.0, 0.0, 1.5]);
    }

    #[test]
    fn layernorm_formula() {
        // token 0: mean 2.5, biased var 1.25; token 1 constant: normalises to 0, output = bias.
        let x = [1.0f32, 2.0, 3.0, 4.0, 7.0, 7.0, 7.0, 7.0];
        let (w, b) = ([1.0f32, 2.0, 1.0, 1.0], [0.0f32, 0.0, 1.0, -1.0]);
        let mut out = [0f32; 8];
        let eps = 1e-6;
        layernorm(&x, &w, Some(&b), eps, &mut out);
        let s = (1.25f64 + eps as f64).sqrt();
        let want = [-1.5 / s, 2.0 * -0.5 / s, 0.5 / s + 1.0, 1.5 / s - 1.0];
        for (o, w) in out[..4].iter().zip(want) {
            assert!((*o as f64 - w).abs() < 1e-6, "{o} vs {w}");
        }
        assert_eq!(&out[4..], &[0.0, 0.0, 1.0, -1.0]);
        layernorm(&x, &w, None, eps, &mut out);
        assert_eq!(&out[4..], &[0.0; 4]);
    }
}
