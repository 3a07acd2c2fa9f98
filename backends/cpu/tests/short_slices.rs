//! Every safe kernel entry point, and every safe function pointer the tiers hand out, checks its
//! lengths in release builds: a short (or long) slice panics with a message, on every ISA tier
//! this CPU runs, instead of reading past the end (issue 23, item 5: `select_f32`'s AVX2 body
//! read 4 MiB past a 4-byte row and segfaulted). Run with `--release`: the checks must not be
//! debug assertions.
use dejavu_backend_api::quant::{BlockQ8A, QuantType, QK};
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::kernels::repack::{ActGroup, GROUP};
use dejavu_backend_cpu::kernels::{
    axpy, axpy_q, dequantize, dot_float, dot_q4_0, dot_q4_1, dot_q4k, dot_q5_0, dot_q6k, dot_q8_0,
    dot_repacked, dot_rows, quantize_act, repack,
};
use half::f16;

/// `f` panics, with a message (not an empty payload).
fn panics(what: &str, f: impl FnOnce()) {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(prev);
    let payload = r
        .err()
        .unwrap_or_else(|| panic!("{what}: no panic on a bad length"));
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(!msg.is_empty(), "{what}: a panic without a message");
}

fn act(n: usize) -> Vec<BlockQ8A> {
    vec![
        BlockQ8A {
            d: 1.0,
            s: 0.0,
            qs: [1; QK]
        };
        n
    ]
}

#[test]
fn float_row_dots() {
    for isa in Isa::supported() {
        let x = vec![1.0f32; 1 << 20];
        for (name, f, w) in [
            ("f32", dot_float::select_f32(isa), 4),
            ("f16", dot_float::select_f16(isa), 2),
            ("bf16", dot_float::select_bf16(isa), 2),
        ] {
            // The probe's program: a 4-byte row against a million activations.
            panics(&format!("{isa:?} {name}"), || {
                f(&[1u8; 4], &x);
            });
            panics(&format!("{isa:?} {name} long row"), || {
                f(&vec![0u8; 17 * w], &x[..16]);
            });
            assert_eq!(f(&vec![0u8; 16 * w], &x[..16]), 0.0);
        }
    }
}

#[test]
fn quantized_row_dots() {
    let types = [
        (QuantType::Q4_0, dot_q4_0::select as fn(Isa, bool) -> _),
        (QuantType::Q4_1, dot_q4_1::select),
        (QuantType::Q5_0, dot_q5_0::select),
        (QuantType::Q8_0, dot_q8_0::select),
        (QuantType::Q4K, dot_q4k::select),
        (QuantType::Q6K, dot_q6k::select),
    ];
    for isa in Isa::supported() {
        for (q, select) in types {
            for pf in [false, true] {
                let f = select(isa, pf);
                let a = act(1 << 15);
                let what = format!("{isa:?} {q:?} prefetch {pf}");
                panics(&what, || {
                    f(&[0u8; 4], &a);
                });
                let row = vec![0u8; q.row_bytes(256)];
                panics(&what, || {
                    f(&row, &a[..4]);
                });
                assert_eq!(f(&row, &a[..8]), 0.0, "{what}");
            }
        }
    }
}

#[test]
fn repacked_row_dots() {
    for isa in Isa::supported() {
        for q in [
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q8_0,
        ] {
            for pf in [false, true] {
                let f = dot_repacked::select(q, isa, pf);
                let a = act(1 << 12);
                let g = vec![ActGroup::ZERO; a.len() / GROUP];
                let what = format!("{isa:?} repacked {q:?}");
                panics(&what, || {
                    f(&[0u8; 8], &a, &g);
                });
                let row = vec![0u8; q.row_bytes(16 * QK)];
                panics(&what, || {
                    f(&row, &a[..16], &g[..1]);
                });
                assert_eq!(f(&row, &a[..16], &g[..2]), 0.0, "{what}");
            }
        }
    }
}

#[test]
fn rows_kernels() {
    for isa in Isa::supported() {
        let (d, df) = (dot_rows::select(isa), dot_rows::select_f16(isa));
        let (a, af) = (axpy::select(isa), axpy::select_f16(isa));
        let x = vec![1.0f32; 64];
        let mut out = vec![0.0f32; 1000];
        panics(&format!("{isa:?} dot_rows"), || {
            d(&x, &[0.0; 64], 64, &mut out)
        });
        panics(&format!("{isa:?} dot_rows f16"), || {
            df(&x, &[f16::ZERO; 64], 64, &mut out)
        });
        let coef = vec![1.0f32; 1000];
        let mut y = vec![0.0f32; 64];
        panics(&format!("{isa:?} axpy_rows"), || {
            a(&coef, &[0.0; 64], 64, &mut y)
        });
        panics(&format!("{isa:?} axpy_rows f16"), || {
            af(&coef, &[f16::ZERO; 64], 64, &mut y)
        });
        let q = axpy_q::select(isa);
        for t in [QuantType::Q8_0, QuantType::Q4_0, QuantType::F16] {
            let short = vec![0u8; 4];
            panics(&format!("{isa:?} axpy_q {t:?}"), || {
                q(t, &[&short], &[1.0], &mut y)
            });
        }
    }
}

#[test]
fn conversions() {
    for isa in Isa::supported() {
        let quant = quantize_act::select(isa);
        let mut blocks = act(4);
        panics(&format!("{isa:?} quantize"), || {
            quant(&[1.0; 8], &mut blocks)
        });
        let deq = dequantize::select(isa);
        let mut out = vec![0.0f32; 1 << 16];
        for q in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q6K,
            QuantType::F16,
        ] {
            panics(&format!("{isa:?} dequantize {q:?}"), || {
                deq(q, &[0u8; 34], &mut out)
            });
        }
        let (pack, unpack) = repack::select(isa);
        let mut dst = vec![0u8; 8];
        panics(&format!("{isa:?} repack"), || {
            pack(QuantType::Q8_0, &[0u8; 34 * 8], &mut dst)
        });
        panics(&format!("{isa:?} unpack"), || {
            unpack(QuantType::Q8_0, &[0u8; 34 * 8], &mut dst)
        });
        let rdeq = repack::select_dequantize(isa);
        panics(&format!("{isa:?} repacked dequantize"), || {
            rdeq(QuantType::Q8_0, &[0u8; 34], &mut out)
        });
    }
    panics("vec_dot::dot_row", || {
        dejavu_backend_cpu::vec_dot::dot_row(QuantType::Q8_0, &[0u8; 34], &[1.0; 1 << 16]);
    });
    panics("vec_dot::dot_f32", || {
        dejavu_backend_cpu::vec_dot::dot_f32(&[1.0; 3], &[1.0; 1 << 16]);
    });
    panics("dequant::dequantize_row", || {
        dejavu_backend_cpu::dequant::dequantize_row(QuantType::Q8_0, &[0u8; 34], &mut [0.0; 64]);
    });
}
