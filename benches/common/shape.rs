//! The command line the input-sparsity benches share, `INPUTS OUTPUTS TYPE DENSITY [THREADS]
//! [MB]` (flags that cargo passes, `--bench`, ignored; the tier from `DEJAVU_ISA`), and their
//! input. `MB`: the megabytes of copies of the matrix that the calls read in turn (each bench's
//! default is more than any L3, so that they read from memory; 1 keeps them in cache: the
//! kernels' own speed, without memory's).
use dejavu_backend_api::QuantType;
use dejavu_backend_cpu::isa::Isa;

pub struct Shape {
    pub n_in: usize,
    pub n_out: usize,
    pub q: QuantType,
    pub density: f32,
    pub threads: usize,
    pub isa: Isa,
    /// Megabytes of copies, when given.
    pub mb: Option<usize>,
}

/// The shape on the command line, or `None` after printing the usage of `bench`.
pub fn parse(bench: &str) -> Option<Shape> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if args.len() < 4 {
        eprintln!(
            "usage: cargo bench --bench {bench} -- INPUTS OUTPUTS TYPE DENSITY [THREADS] [MB]"
        );
        return None;
    }
    let num = |s: &str| s.parse::<usize>().expect("a number");
    Some(Shape {
        n_in: num(&args[0]),
        n_out: num(&args[1]),
        q: QuantType::from_name(&args[2].to_uppercase()).expect("a weight type"),
        density: args[3].parse().expect("a density"),
        threads: args.get(4).map_or(2, |s| num(s)),
        mb: args.get(5).map(|s| num(s).max(1)),
        isa: (std::env::var("DEJAVU_ISA").ok())
            .and_then(|s| Isa::from_name(&s))
            .unwrap_or(Isa::detect()),
    })
}

/// `x` with input i dropped (0) where a hash of i falls below `1 - density`.
pub fn drop_inputs(x: &[f32], density: f32) -> Vec<f32> {
    let hash = |i: usize| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32;
    let cut = (1.0 - density) * (1u64 << 24) as f32;
    (x.iter().enumerate())
        .map(|(i, &v)| if hash(i) < cut { 0.0 } else { v })
        .collect()
}

/// `bytes` in anonymous memory advised to use huge pages, as a model's load holds its repacked
/// rows and input-major layouts (with 4 KiB pages the sparse reads wait on the TLB).
pub fn huge_pages(bytes: &[u8]) -> memmap2::MmapMut {
    let mut m = dejavu::memstat::huge_zeroed(bytes.len()).expect("anonymous memory");
    m[..bytes.len()].copy_from_slice(bytes);
    m
}
