//! What skipping rows saves from this machine's memory, with no kernel in the way: the
//! input-sparse products read each kept input's row of a matrix, a run of bytes (an input-block
//! row is `outputs * bits / 8` bytes: 288 for SmolLM2's down projection in Q4_1, 7 KiB for
//! Llama-3-8B's gate), and skip the others. A skipped run saves its bytes' time only if the
//! memory system streams the kept runs as fast as it streams every run.
//!
//! `cargo bench --bench run_lengths -- RUN_BYTES KEPT [THREADS] [MB]`: memory cut into groups
//! of 32 runs of `RUN_BYTES`; in each group `KEPT` of the 32 are chosen at random. Four reads,
//! alternating, five rounds after one to warm up: every run in order (a dense product's
//! stream); every run of each group in a shuffled order (the same bytes, a jump after each
//! run); the kept runs in order, one after another; and the kept runs of each group a line of
//! each at a time (the input-block kernels' order: a tile of outputs of every kept row).
//! `THREADS` each read a region of `MB` (256 by default) of their own, in huge pages. Plain
//! loads with no software prefetch and no arithmetic: what the memory system gives a simple
//! reader, not a bound on a kernel (the kernels' prefetches do better on long runs: 4096 x
//! 14336 Q4_0 kept 0.95 of dense's rate at half its inputs, `input_ratio`, one thread).
//! Synthetic bytes, not a model's speed.
use std::hint::black_box;
use std::time::Instant;

/// Runs a group holds (the inputs of one input block).
const GROUP: usize = 32;

/// One reader's memory and the starts of its runs, in the orders of the three reads.
struct Region {
    mem: memmap2::MmapMut,
    all: Vec<usize>,
    kept: Vec<usize>,
    shuffled: Vec<usize>,
}

/// A small deterministic generator (xorshift64*), so that every run picks the same rows.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
    fn shuffle(&mut self, v: &mut [usize]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

fn region(bytes: usize, run: usize, kept: usize, seed: u64) -> Region {
    let mut mem = dejavu::memstat::huge_zeroed(bytes).expect("anonymous memory");
    // Touch every page, and give the bytes values.
    for (i, b) in mem.iter_mut().enumerate().step_by(512) {
        *b = i as u8;
    }
    let mut rng = Rng(seed | 1);
    let (mut all, mut keep, mut shuffled) = (Vec::new(), Vec::new(), Vec::new());
    for g in 0..bytes / (GROUP * run) {
        let starts: Vec<usize> = (0..GROUP).map(|r| (g * GROUP + r) * run).collect();
        all.extend(&starts);
        let mut order = starts.clone();
        rng.shuffle(&mut order);
        let mut chosen = order[..kept].to_vec();
        chosen.sort_unstable();
        keep.extend(chosen);
        shuffled.extend(order);
    }
    Region {
        mem,
        all,
        kept: keep,
        shuffled,
    }
}

/// Read the runs from `starts` (every byte, as a sum of words) and return the sum.
fn read(mem: &[u8], starts: &[usize], run: usize) -> u64 {
    let mut sum = [0u64; 8];
    let mut tail = 0u64;
    for &s in starts {
        let bytes = &mem[s..s + run];
        let mut lines = bytes.chunks_exact(64);
        for line in &mut lines {
            let w: [u64; 8] = std::array::from_fn(|i| {
                u64::from_le_bytes(line[8 * i..8 * i + 8].try_into().unwrap())
            });
            for (s, w) in sum.iter_mut().zip(w) {
                *s = s.wrapping_add(w);
            }
        }
        tail = (lines.remainder().iter()).fold(tail, |a, &b| a.wrapping_add(b as u64));
    }
    sum.iter().fold(tail, |a, b| a.wrapping_add(*b))
}

/// Read the kept runs of each group a line of each at a time (as the input-block kernels read
/// a block's kept rows, a tile of outputs of each) and return the sum.
fn interleaved(mem: &[u8], kept: &[usize], per_group: usize, run: usize) -> u64 {
    let mut sum = [0u64; 8];
    for group in kept.chunks(per_group) {
        for at in (0..run).step_by(64) {
            let n = (run - at).min(64);
            for &s in group {
                let line = &mem[s + at..s + at + n];
                for (s, w) in sum.iter_mut().zip(line.chunks_exact(8)) {
                    *s = s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                }
            }
        }
    }
    sum.iter().fold(0, |a, b| a.wrapping_add(*b))
}

/// Seconds for every reader to read its runs of `pick`, at once.
fn timed(regions: &[Region], f: impl Fn(&Region) -> u64 + Sync) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for r in regions {
            let f = &f;
            s.spawn(move || black_box(f(r)));
        }
    });
    t0.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let num = |i: usize, default: Option<usize>| -> Option<usize> {
        match args.get(i) {
            Some(a) => a.parse().ok(),
            None => default,
        }
    };
    let (Some(run), Some(kept), Some(threads), Some(mb)) = (
        num(0, None),
        num(1, None),
        num(2, Some(1)),
        num(3, Some(256)),
    ) else {
        eprintln!("usage: run_lengths RUN_BYTES KEPT [THREADS] [MB] (KEPT of 32 runs a group)");
        return;
    };
    if run == 0 || kept == 0 || kept > GROUP || threads == 0 || mb * (1 << 20) < GROUP * run {
        eprintln!("run_lengths: RUN_BYTES > 0, KEPT in 1..=32, THREADS > 0, MB >= one group");
        return;
    }
    let bytes = mb << 20;
    let regions: Vec<Region> = (0..threads)
        .map(|t| region(bytes, run, kept, 0x9E37_79B9 + t as u64))
        .collect();
    let (mut dense, mut sparse, mut inter, mut jumps) = (0.0, 0.0, 0.0, 0.0);
    for round in 0..6 {
        let d = timed(&regions, |r| read(&r.mem, &r.all, run));
        let s = timed(&regions, |r| read(&r.mem, &r.kept, run));
        let i = timed(&regions, |r| interleaved(&r.mem, &r.kept, kept, run));
        let j = timed(&regions, |r| read(&r.mem, &r.shuffled, run));
        if round > 0 {
            (dense, sparse, inter, jumps) = (dense + d, sparse + s, inter + i, jumps + j);
        }
    }
    let all = (regions.iter().map(|r| r.all.len() * run).sum::<usize>() * 5) as f64;
    let some = (regions.iter().map(|r| r.kept.len() * run).sum::<usize>() * 5) as f64;
    println!(
        "runs of {run} B, {kept} of {GROUP} kept, {threads} threads: every run in order {:.1} \
         GB/s, every run shuffled {:.1}; the kept runs one by one {:.1}, interleaved {:.1}: \
         the faster {:.2}x faster than every run in order (their bytes: {:.2}x fewer)",
        all / dense / 1e9,
        all / jumps / 1e9,
        some / sparse / 1e9,
        some / inter / 1e9,
        dense / sparse.min(inter),
        GROUP as f64 / kept as f64,
    );
}
