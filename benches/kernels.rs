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
    let offsets: &[usize] = match qtype {
        QuantType::F32 | QuantType::F16 | QuantType::BF16 => &[],
        QuantType::Q4_1 | QuantType::Q4K => &[0, 2],
        QuantType::Q6K => &[208],
        _ => &[0],
    };
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

criterion_group!(benches, matvec, prefill);
criterion_main!(benches);
