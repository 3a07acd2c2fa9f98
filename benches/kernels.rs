//! Criterion benches of the CPU kernels on the shapes of the real models: one matvec per weight
//! type (reported as bytes of weights read per second, since decode is memory-bound), and a
//! prefill-sized matmul. Weights are synthetic bytes of the right layout: these measure kernels,
//! not model quality. Run: `cargo bench --bench kernels`.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dejavu_backend_api::{IndexSet, QuantType, Weight};
use dejavu_backend_cpu::isa::Isa;
use dejavu_backend_cpu::kernels::table::Kernels;
use dejavu_backend_cpu::matmul::matmul;
use dejavu_backend_cpu::pool::SpinPool;
use half::f16;

/// Bytes of a valid `rows x cols` tensor: every block scale set to a small finite f16.
fn synthetic(qtype: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let n = qtype.row_bytes(cols) * rows;
    let mut bytes: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let scale = f16::from_f32(0.01).to_le_bytes();
    let bb = qtype.block_bytes();
    let offsets = qtype.scale_offsets();
    if offsets.is_empty() {
        let one: Vec<u8> = match qtype {
            QuantType::F32 => 0.01f32.to_le_bytes().to_vec(),
            QuantType::F16 => scale.to_vec(),
            _ => half::bf16::from_f32(0.01).to_le_bytes().to_vec(),
        };
        return one.iter().cycle().take(n).copied().collect();
    }
    for blk in bytes.chunks_exact_mut(bb) {
        for &o in offsets {
            blk[o..o + 2].copy_from_slice(&scale);
        }
    }
    bytes
}

fn matvec(c: &mut Criterion) {
    let pool = SpinPool::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    // SmolLM2's ffn_up (1536 x 576) and Qwen2.5's ffn_down (896 x 4864), on every ISA tier this CPU
    // has; types whose block does not divide the row are skipped.
    for (isa, (rows, cols)) in Isa::supported()
        .into_iter()
        .flat_map(|i| [(1536, 576), (896, 4864)].map(|s| (i, s)))
    {
        let k = Kernels::for_isa(isa).unwrap();
        let mut g = c.benchmark_group(format!("matvec_{rows}x{cols}_{isa}"));
        for qtype in QuantType::ALL
            .into_iter()
            .filter(|q| cols % q.block_len() == 0)
        {
            let data = synthetic(qtype, rows, cols);
            let w = Weight::new(qtype, rows, cols, &data).unwrap();
            let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0f32; rows];
            let all = IndexSet::full(rows);
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_function(BenchmarkId::from_parameter(qtype.name()), |b| {
                b.iter(|| matmul(&k, &pool, &w, &all, &x, &mut y))
            });
        }
        g.finish();
    }
}

fn prefill(c: &mut Criterion) {
    let pool = SpinPool::new(1);
    let (rows, cols, n_tok) = (1536, 576, 128);
    let data = synthetic(QuantType::Q4_1, rows, cols);
    let w = Weight::new(QuantType::Q4_1, rows, cols, &data).unwrap();
    let x: Vec<f32> = (0..n_tok * cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y = vec![0f32; n_tok * rows];
    let k = Kernels::for_isa(Isa::detect()).unwrap();
    let mut g = c.benchmark_group("matmul_q4_1_1536x576");
    g.throughput(Throughput::Elements((2 * rows * cols * n_tok) as u64));
    g.bench_function(BenchmarkId::new("tokens", n_tok), |b| {
        b.iter(|| matmul(&k, &pool, &w, &IndexSet::full(rows), &x, &mut y))
    });
    g.finish();
}

/// The sparse MLP's kernels at opt-6.7b's shape (fc1 and the neuron-major fc2: 16384 rows of
/// 4096) in Q8_0 and f16, and opt-1.3b's (8192 of 2048) in Q8_0, over every row and over 50%, 10% and 5% of them, next to the dense
/// matvec: bytes read per second should stay near the dense figure as density falls. As in the
/// engine, the weights lie in anonymous memory advised to use huge pages; each iteration reads
/// the next of four matrices (more than any L3) with the next of eight random sets, so the
/// figures are DRAM's, not the cache's.
fn sparse(c: &mut Criterion) {
    let pool = SpinPool::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    let k = Kernels::for_isa(Isa::detect()).unwrap();
    let shapes = [
        (16384, 4096, QuantType::Q8_0),
        (16384, 4096, QuantType::F16),
        (8192, 2048, QuantType::Q8_0),
    ];
    for (rows, cols, qtype) in shapes {
        let one = synthetic(qtype, rows, cols);
        let mats: Vec<memmap2::MmapMut> = (0..4)
            .map(|_| {
                let mut m = memmap2::MmapMut::map_anon(one.len()).unwrap();
                #[cfg(target_os = "linux")]
                let _ = m.advise(memmap2::Advice::HugePage);
                m.copy_from_slice(&one);
                m
            })
            .collect();
        drop(one);
        let ws: Vec<Weight> = (mats.iter())
            .map(|m| Weight::new(qtype, rows, cols, m).unwrap())
            .collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let a: Vec<f32> = (0..rows).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut y = vec![0f32; rows];
        let mut out = vec![0f32; cols];
        let mut g = c.benchmark_group(format!("sparse_{rows}x{cols}_{}", qtype.name()));
        g.sample_size(20);
        let mut state = 12345u64;
        for density in [1.0, 0.5, 0.1, 0.05] {
            let sets: Vec<IndexSet> = (0..8)
                .map(|_| {
                    let mut keep = |_: &u32| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        ((state >> 33) as f64 / (1u64 << 31) as f64) < density
                    };
                    match density {
                        1.0 => IndexSet::full(rows),
                        _ => IndexSet::new(rows, (0..rows as u32).filter(|i| keep(i)).collect())
                            .unwrap(),
                    }
                })
                .collect();
            let bytes = sets[0].len() * qtype.row_bytes(cols);
            g.throughput(Throughput::Bytes(bytes as u64));
            let mut it = 0usize;
            g.bench_function(BenchmarkId::new("gather_matvec", density), |b| {
                b.iter(|| {
                    it += 1;
                    matmul(&k, &pool, &ws[it % 4], &sets[it % 8], &x, &mut y)
                })
            });
            g.bench_function(BenchmarkId::new("axpy_rows", density), |b| {
                b.iter(|| {
                    it += 1;
                    let (w, set) = (&ws[it % 4], &sets[it % 8]);
                    dejavu_backend_cpu::axpy_matmul::axpy_matmul(&k, &pool, w, set, &a, &mut out)
                })
            });
        }
        g.finish();
    }
}

/// The fused axpy kernel alone, one thread, on 8 cache-resident rows of 2048: its compute rate
/// (the sparse down projection's ceiling when rows come from cache).
fn axpy_kernel(c: &mut Criterion) {
    let isa = Isa::detect();
    let f = dejavu_backend_cpu::kernels::axpy_q::select(isa);
    let cols = 2048;
    let mut g = c.benchmark_group(format!("axpy_kernel_8x{cols}_{isa}"));
    for qtype in [
        QuantType::Q8_0,
        QuantType::F16,
        QuantType::Q5_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
    ] {
        let rows: Vec<Vec<u8>> = (0..8).map(|_| synthetic(qtype, 1, cols)).collect();
        let refs: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
        let coef = [0.5f32; 8];
        let mut y = vec![0f32; cols];
        g.throughput(Throughput::Bytes((8 * qtype.row_bytes(cols)) as u64));
        g.bench_function(BenchmarkId::from_parameter(qtype.name()), |b| {
            b.iter(|| f(qtype, &refs, &coef, &mut y))
        });
    }
    g.finish();
}

/// The row dot kernels alone, one thread, on 64 cache-resident rows of 896 (Qwen2.5's width):
/// the ggml layout against the repacked one (`kernels::repack`), per tier and type.
fn row_dot_kernel(c: &mut Criterion) {
    use dejavu_backend_api::quant::{BlockQ8A, QK};
    use dejavu_backend_cpu::kernels::{dot_repacked, repack};
    let (rows, cols) = (64, 896);
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    for isa in Isa::supported()
        .into_iter()
        .filter(|i| dot_repacked::repacks(*i, QuantType::Q8_0))
    {
        let k = Kernels::for_isa(isa).unwrap();
        let mut act = vec![
            BlockQ8A {
                d: 0.0,
                s: 0.0,
                qs: [0; QK]
            };
            cols / QK
        ];
        (k.quantize)(&x, &mut act);
        let mut groups = vec![repack::ActGroup::ZERO; act.len() / repack::GROUP];
        repack::act_groups(&act, &mut groups);
        let mut g = c.benchmark_group(format!("row_dot_{rows}x{cols}_{isa}"));
        for qtype in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
        ] {
            let data = synthetic(qtype, rows, cols);
            let mut packed = vec![0u8; data.len()];
            repack::repack_matrix(qtype, cols, &data, &mut packed);
            let rb = qtype.row_bytes(cols);
            let Some(ggml) = k.dot(qtype, false).q8a() else {
                unreachable!()
            };
            let rep = dot_repacked::select(qtype, isa, true);
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_function(BenchmarkId::new("ggml", qtype.name()), |b| {
                b.iter(|| data.chunks_exact(rb).map(|r| ggml(r, &act)).sum::<f32>())
            });
            g.bench_function(BenchmarkId::new("repacked", qtype.name()), |b| {
                b.iter(|| {
                    packed
                        .chunks_exact(rb)
                        .map(|r| rep(r, &act, &groups))
                        .sum::<f32>()
                })
            });
            // Four tokens per row (a speculative verification's or a batch's decode rows):
            // the multi-token kernel, against four one-token dots per row.
            let tokens = dot_repacked::select_tokens(qtype, isa, true);
            let (acts, grs) = ([&act[..]; 4], [&groups[..]; 4]);
            g.bench_function(BenchmarkId::new("repacked_4_tokens", qtype.name()), |b| {
                b.iter(|| {
                    let mut out = [0f32; 4];
                    packed
                        .chunks_exact(rb)
                        .for_each(|r| tokens(r, &acts, &grs, &mut out));
                    out[0]
                })
            });
            g.bench_function(BenchmarkId::new("repacked_4_x_1", qtype.name()), |b| {
                b.iter(|| {
                    packed
                        .chunks_exact(rb)
                        .map(|r| (0..4).map(|t| rep(r, acts[t], grs[t])).sum::<f32>())
                        .sum::<f32>()
                })
            });
        }
        g.finish();
    }
}

/// Input sparsity's product (`axpy_matmul::axpy_blocks`) over an input-block matrix against
/// the dense matvec of the same matrix in the file's layout, on the best tier and every thread:
/// SmolLM2's gate (576 inputs, 1536 outputs) and Llama-3-8B's (4096 x 14336), every input kept
/// and half of them; throughput in bytes of the kept inputs' rows.
fn input_blocks(c: &mut Criterion) {
    use dejavu_backend_api::RowLayout;
    use dejavu_backend_cpu::axpy_matmul::axpy_blocks;
    let pool = SpinPool::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    let isa = *Isa::supported().last().unwrap();
    let k = Kernels::for_isa(isa).unwrap();
    let mut kf = k;
    kf.axpy_blocks = dejavu_backend_cpu::kernels::axpy_blocks::select(isa);
    kf.axpy_blocks_q8 = None;
    for (n_in, n_out) in [(576, 1536), (4096, 14336)] {
        let mut g = c.benchmark_group(format!("input_blocks_{n_in}x{n_out}"));
        for qtype in [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_1] {
            // Same bytes, two readings: rows of the file (dense matvec), input blocks (axpy).
            let data = synthetic(qtype, n_out, n_in);
            let w = Weight::new(qtype, n_out, n_in, &data).unwrap();
            // The same bytes with every input block's scale table set to small finite f16s.
            let mut tdata = data.clone();
            let (bb, sb) = (
                32 * qtype.row_bytes(n_out),
                2 * n_out * (1 + (qtype == QuantType::Q4_1) as usize),
            );
            for blk in tdata.chunks_exact_mut(bb) {
                for h in blk[..sb].chunks_exact_mut(2) {
                    h.copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
                }
            }
            let wt = Weight::new(qtype, n_in, n_out, &tdata)
                .unwrap()
                .with_layout(RowLayout::InputBlocks);
            let x: Vec<f32> = (0..n_in).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0f32; n_out];
            g.throughput(Throughput::Bytes(data.len() as u64));
            let all = IndexSet::full(n_out);
            g.bench_function(BenchmarkId::new("dense_matvec", qtype.name()), |b| {
                b.iter(|| matmul(&k, &pool, &w, &all, &x, &mut y))
            });
            g.bench_function(BenchmarkId::new("axpy_all", qtype.name()), |b| {
                b.iter(|| axpy_blocks(&k, &pool, &wt, &x, &mut y))
            });
            // Every other input dropped at random-looking places (about half).
            let half: Vec<f32> = (x.iter().enumerate())
                .map(|(i, v)| {
                    if (i * 2654435761usize) % 7 < 3 {
                        0.0
                    } else {
                        *v
                    }
                })
                .collect();
            let kept = half.iter().filter(|v| **v != 0.0).count();
            g.throughput(Throughput::Bytes((data.len() * kept / n_in) as u64));
            g.bench_function(BenchmarkId::new("axpy_half", qtype.name()), |b| {
                b.iter(|| axpy_blocks(&k, &pool, &wt, &half, &mut y))
            });
            // The same with the tier's f32 kernel (the AVX-512 tier's own rounds x to 8 bits).
            g.bench_function(BenchmarkId::new("axpy_half_f32", qtype.name()), |b| {
                b.iter(|| axpy_blocks(&kf, &pool, &wt, &half, &mut y))
            });
        }
        g.finish();
    }
}

/// Attention's softmax over one head's 512 scores and the MLP's SiLU GLU over SmolLM2's 1536
/// neurons, on every tier (elements per second).
fn activations(c: &mut Criterion) {
    use dejavu_backend_api::{Activation, Scoring};
    let scores: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
    let gate: Vec<f32> = (0..1536).map(|i| (i as f32 * 0.11).cos() * 5.0).collect();
    let up: Vec<f32> = (0..1536).map(|i| (i as f32 * 0.07).sin()).collect();
    let mut g = c.benchmark_group("activations");
    for isa in Isa::supported() {
        let k = Kernels::for_isa(isa).unwrap();
        let mut x = scores.clone();
        g.throughput(Throughput::Elements(scores.len() as u64));
        g.bench_function(BenchmarkId::new("softmax_512", isa), |b| {
            b.iter(|| {
                x.copy_from_slice(&scores);
                (k.softmax)(&mut x, Scoring::plain(64))
            })
        });
        let mut y = gate.clone();
        g.throughput(Throughput::Elements(gate.len() as u64));
        g.bench_function(BenchmarkId::new("silu_glu_1536", isa), |b| {
            b.iter(|| {
                y.copy_from_slice(&gate);
                (k.glu)(Activation::Silu, &mut y, &up)
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    matvec,
    prefill,
    sparse,
    axpy_kernel,
    row_dot_kernel,
    input_blocks,
    activations
);
criterion_main!(benches);
