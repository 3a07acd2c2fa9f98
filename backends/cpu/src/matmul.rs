//! `y[t][r] = dot(W[r], x[t])` over a subset of rows (see `Backend::matmul`).
//!
//! Two paths:
//! - few tokens (decode) or a row subset: each token's activations are quantized once to Q8A
//!   (for quantized weights) and every selected row is dotted with the tier's integer kernel,
//!   one contiguous range of rows per thread of the [`SpinPool`];
//! - many tokens with every row (prefill): the pool's threads take tiles of rows; on tiers with
//!   an integer prefill kernel (`gemm_q8a`) integer weights are unpacked to 8-bit panels and
//!   multiplied with the tokens quantized once to Q8A; otherwise a tile is dequantized to f32 and
//!   multiplied with the `gemm` crate.
use crate::kernels::gemm_q8a::{Acts, Gemm, Panel, NT, PR};
use crate::kernels::repack::{self, ActGroup, GROUP};
use crate::kernels::table::{Kernels, RowDot};
use crate::pool::SpinPool;
use crate::prefetch;
use dejavu_backend_api::quant::{BlockQ8A, QK};
use dejavu_backend_api::{IndexSet, MatmulJob, RowLayout, Weight};
use std::cell::RefCell;

const _: () = assert!(TOKEN_CHUNK <= crate::kernels::MAX_Q8A_TOKENS);

/// From this many tokens on, a dense matmul goes through dequantized tiles and `gemm`.
pub const GEMM_MIN_TOKENS: usize = 4;
/// The same for repacked rows, whose multi-token dot unpacks a group once for 8 tokens: below
/// this many it beat the tiles. 40 (`dejavu bench -p 8|16|32|48|64 -n 0`: SmolLM2 Q4_1 pp8
/// 2.3x, pp32 1.15x, pp48 and pp64 even; Qwen2.5 Q5_0 pp16 1.4x, pp32 1.1x); 96 on AVX-512,
/// whose dot takes rows in pairs (`-p 48|64|96|160 -n 0 -r 5`, builds alternating, tokens
/// against tiles: SmolLM2 pp48 1.15-1.20x, pp64 1.14-1.15x, pp96 even, pp160 even or tiles
/// ahead; Qwen2.5-Coder-0.5B pp48 1.03-1.09x, pp96 even).
pub fn gemm_min_tokens_repacked(isa: crate::isa::Isa) -> usize {
    match isa {
        crate::isa::Isa::Avx512 => 96,
        _ => 40,
    }
}
/// Target size of a thread's dequantized f32 tile on the prefill path: half of a 512 KiB L2.
/// Rows of one prefill tile (see `matmul_gemm`): small enough that a layer's matrices split
/// evenly over a few threads, large enough that packing the input stays a small cost.
const GEMM_TILE_ROWS: usize = 32;

thread_local! {
    /// Quantized activations of the calling thread, reused across calls (no per-call allocation
    /// once grown to the widest input).
    static ACT: RefCell<Vec<BlockQ8A>> = const { RefCell::new(Vec::new()) };
    /// The same blocks' whole groups transposed, for repacked weights.
    static ACT_GROUPS: RefCell<Vec<ActGroup>> = const { RefCell::new(Vec::new()) };
    /// Dequantized weight tile of this thread (prefill path).
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Integer prefill: this thread's unpacked panel and a row's ggml bytes (repacked rows).
    static PANEL: RefCell<(Panel, Vec<u8>)> = RefCell::new(Default::default());
    /// Integer prefill: the calling thread's tokens, prepared once per call and group size.
    static INT_INPUT: RefCell<IntInput> = RefCell::new(Default::default());
}

const _: () = assert!(GEMM_TILE_ROWS.is_multiple_of(PR));

pub fn matmul(k: &Kernels, pool: &SpinPool, w: &Weight, rows: &IndexSet, x: &[f32], y: &mut [f32]) {
    matmul_shared(k, pool, x, &mut [MatmulJob { w: *w, rows, y }])
}

/// Most products one shared-input call takes on the dot path (Q, K, V).
const MAX_JOBS: usize = 4;

/// Products of one input (see `Backend::matmul_shared_input`). On the dot path the input is
/// quantized once per token and every job's selected rows go to one pool dispatch, split into one
/// contiguous range per thread over the concatenated rows.
pub fn matmul_shared(k: &Kernels, pool: &SpinPool, x: &[f32], jobs: &mut [MatmulJob]) {
    let Some(cols) = check_shared(x, jobs) else {
        return;
    };
    let n_tok = x.len() / cols.max(1);
    if jobs.iter().any(|j| n_tok >= gemm_from(k, &j.w)) || jobs.len() > MAX_JOBS {
        INT_INPUT.with_borrow_mut(|input| {
            input.built = [false; 2];
            for j in jobs {
                if n_tok < gemm_from(k, &j.w) || !j.rows.is_full() {
                    dot_path(k, pool, x, cols, n_tok, std::slice::from_mut(j));
                } else if let Some(f) = k.gemm_q8a.filter(|f| integer_prefill(f, &j.w)) {
                    let acts = input.acts(k, x, cols, crate::dequant::group_len(j.w.qtype));
                    matmul_int(k, f, pool, &j.w, acts, j.y, n_tok);
                } else {
                    matmul_gemm(k, pool, &j.w, x, j.y, n_tok);
                }
            }
        })
    } else {
        dot_path(k, pool, x, cols, n_tok, jobs);
    }
}

/// From how many tokens on a dense product of `w` goes through tiles: [`GEMM_MIN_TOKENS`], or
/// [`gemm_min_tokens_repacked`] for repacked rows whose tiles are the integer kernel's (both
/// paths then take the same 8-bit activations; f32 tiles keep the lower bound).
fn gemm_from(k: &Kernels, w: &Weight) -> usize {
    let int_tiles = || k.gemm_q8a.is_some_and(|f| integer_prefill(&f, w));
    match w.layout {
        RowLayout::Repacked if int_tiles() => gemm_min_tokens_repacked(k.isa),
        _ => GEMM_MIN_TOKENS,
    }
}

/// [`matmul_shared`] through the decode path at any token count: each token's outputs are bit
/// for bit those of a one-token call (a token's dot with a row does not depend on the others;
/// see `part_rows`), which a batch of decode rows needs (`Device::matmul_steps`). The weights
/// are read once per [`TOKEN_CHUNK`] tokens.
pub fn matmul_shared_steps(k: &Kernels, pool: &SpinPool, x: &[f32], jobs: &mut [MatmulJob]) {
    let Some(cols) = check_shared(x, jobs) else {
        return;
    };
    let n_tok = x.len() / cols.max(1);
    for chunk in jobs.chunks_mut(MAX_JOBS) {
        dot_path(k, pool, x, cols, n_tok, chunk);
    }
}

/// The input width of a shared-input call (`None`: no jobs), its extents checked for real (the
/// kernels write `y` through raw pointers).
fn check_shared(x: &[f32], jobs: &[MatmulJob]) -> Option<usize> {
    let cols = jobs.first().map(|j| j.w.cols)?;
    let n_tok = x.len() / cols.max(1);
    assert_eq!(
        x.len(),
        n_tok * cols,
        "matmul: input is not whole rows of {cols}"
    );
    for j in jobs.iter() {
        j.w.check();
        assert_eq!(j.w.cols, cols, "matmul: jobs of one input differ in width");
        assert_eq!(j.y.len(), n_tok * j.w.rows, "matmul: output length");
        assert_eq!(j.rows.universe(), j.w.rows, "matmul: row set universe");
    }
    Some(cols)
}

/// The decode path for at most `MAX_JOBS` jobs sharing the input.
fn dot_path(
    k: &Kernels,
    pool: &SpinPool,
    x: &[f32],
    cols: usize,
    n_tok: usize,
    jobs: &mut [MatmulJob],
) {
    debug_assert!(jobs.len() <= MAX_JOBS);
    for j in jobs.iter_mut().filter(|j| !j.rows.is_full()) {
        j.y.fill(0.0);
    }
    let dots: [Option<RowDot>; MAX_JOBS] =
        std::array::from_fn(|i| jobs.get(i).map(|j| k.dot_for(&j.w, !j.rows.is_full())));
    let needs_q8a = dots
        .iter()
        .flatten()
        .any(|d| matches!(d, RowDot::Q8A(_) | RowDot::Q8AN(..) | RowDot::R8(..)));
    let needs_groups = dots.iter().flatten().any(|d| matches!(d, RowDot::R8(..)));
    ACT.with_borrow_mut(|act| {
        ACT_GROUPS.with_borrow_mut(|groups| {
            // Every token's activations quantized once, so each row is read once per chunk of
            // tokens (see `rows_dot`).
            let bpr = if needs_q8a { cols / QK } else { 0 };
            let gpr = if needs_groups { bpr / GROUP } else { 0 };
            act.resize(
                n_tok * bpr,
                BlockQ8A {
                    d: 0.0,
                    s: 0.0,
                    qs: [0; QK],
                },
            );
            groups.resize(n_tok * gpr, ActGroup::ZERO);
            if needs_q8a {
                for (xt, at) in x.chunks_exact(cols).zip(act.chunks_exact_mut(bpr)) {
                    (k.quantize)(xt, at);
                }
            }
            if gpr > 0 {
                for (at, gt) in act.chunks_exact(bpr).zip(groups.chunks_exact_mut(gpr)) {
                    repack::act_groups(&at[..gpr * GROUP], gt);
                }
            }
            let parts: [Option<Part>; MAX_JOBS] = std::array::from_fn(|i| {
                jobs.get_mut(i).zip(dots[i]).map(|(j, dot)| Part {
                    dot,
                    w: j.w,
                    rows: j.rows,
                    y: SyncPtr::new(j.y.as_mut_ptr()),
                })
            });
            let input = Input {
                x,
                act,
                groups,
                cols,
                bpr,
                gpr,
                n_tok,
            };
            rows_dot(pool, &parts, &input);
        })
    });
}

/// One job of a shared-input dispatch; `y` is its whole output (`n_tok * w.rows`).
#[derive(Clone, Copy)]
struct Part<'a> {
    dot: RowDot,
    w: Weight<'a>,
    rows: &'a IndexSet,
    y: SyncPtr,
}

/// The tokens of a dispatch: f32 rows of `cols`, and (for the integer kernels) their Q8A blocks,
/// `bpr` per token, and (for repacked weights) those blocks' whole groups, `gpr` per token.
struct Input<'a> {
    x: &'a [f32],
    act: &'a [BlockQ8A],
    groups: &'a [ActGroup],
    cols: usize,
    bpr: usize,
    gpr: usize,
    n_tok: usize,
}

impl Input<'_> {
    /// Token `t`'s row dotted with `w`, the blocks `b0..b1` of a row (`b0` a whole number of
    /// groups for repacked rows).
    #[inline(always)]
    fn dot(&self, dot: RowDot, w: &[u8], t: usize, b0: usize, b1: usize, bl: usize) -> f32 {
        let (e0, e1) = (b0 * bl, b1 * bl);
        match dot {
            RowDot::F32(f) => f(w, &self.x[t * self.cols..][e0..e1]),
            RowDot::Q8A(f) | RowDot::Q8AN(f, _) => {
                f(w, &self.act[t * self.bpr..][e0 / QK..e1 / QK])
            }
            RowDot::R8(f, _) => f(w, self.act_of(t, e0, e1), self.groups_of(t, e0, e1)),
        }
    }

    /// `v[i] += ` the dot of `w` with token `tokens.start + i`, as [`Self::dot`] computes it:
    /// repacked rows through the tier's multi-token kernel (bit for bit the same sums).
    #[inline(always)]
    fn dots(&self, dot: RowDot, w: &[u8], tokens: std::ops::Range<usize>, seg: Seg, v: &mut [f32]) {
        let (b0, b1, bl) = seg;
        match dot {
            RowDot::R8(_, f) if tokens.len() > 1 => {
                let (e0, e1) = (b0 * bl, b1 * bl);
                let n = tokens.len();
                let acts: [&[BlockQ8A]; TOKEN_CHUNK] =
                    std::array::from_fn(|i| self.act_of(tokens.start + i.min(n - 1), e0, e1));
                let groups: [&[ActGroup]; TOKEN_CHUNK] =
                    std::array::from_fn(|i| self.groups_of(tokens.start + i.min(n - 1), e0, e1));
                let mut out = [0f32; TOKEN_CHUNK];
                f(w, &acts[..n], &groups[..n], &mut out[..n]);
                for (vt, o) in v.iter_mut().zip(&out[..n]) {
                    *vt += o;
                }
            }
            RowDot::Q8AN(_, f) if tokens.len() > 1 => {
                let (e0, e1) = (b0 * bl, b1 * bl);
                let n = tokens.len();
                let acts: [&[BlockQ8A]; TOKEN_CHUNK] =
                    std::array::from_fn(|i| self.act_of(tokens.start + i.min(n - 1), e0, e1));
                let mut out = [0f32; TOKEN_CHUNK];
                f(w, &acts[..n], &mut out[..n]);
                for (vt, o) in v.iter_mut().zip(&out[..n]) {
                    *vt += o;
                }
            }
            _ => {
                for (vt, t) in v.iter_mut().zip(tokens) {
                    *vt += self.dot(dot, w, t, b0, b1, bl);
                }
            }
        }
    }

    /// Token `t`'s activation blocks of the elements `e0..e1`.
    #[inline(always)]
    fn act_of(&self, t: usize, e0: usize, e1: usize) -> &[BlockQ8A] {
        &self.act[t * self.bpr..][e0 / QK..e1 / QK]
    }

    /// The same blocks' groups (`e0` a whole number of groups; `e1 <= cols`, so the groups end
    /// within the token's `gpr`).
    #[inline(always)]
    fn groups_of(&self, t: usize, e0: usize, e1: usize) -> &[ActGroup] {
        &self.groups[t * self.gpr..][e0 / QK / GROUP..e1 / QK / GROUP]
    }
}

/// Blocks `b0..b1` of a row of `bl`-element blocks.
type Seg = (usize, usize, usize);

const _: () = assert!(TOKEN_CHUNK <= crate::kernels::dot_repacked::MAX_TOKENS);

/// Tokens dotted with one row while it is in L1: a row is read from memory once per chunk.
const TOKEN_CHUNK: usize = 8;

/// `y[t][r] = dot(row r, x[t])` for the selected rows of every part: the concatenated rows are
/// split into one contiguous range per pool thread, so each thread streams one long run of
/// weights, which the prefetchers and DRAM pages favour over interleaved small tasks (measured:
/// 10-35% more GB/s at 2 threads). Tokens go in chunks of [`TOKEN_CHUNK`], rows inside: a row
/// is dotted with every token of the chunk before the next row is read.
fn rows_dot(pool: &SpinPool, parts: &[Option<Part>], input: &Input) {
    let total: usize = parts.iter().flatten().map(|p| p.rows.len()).sum();
    let per = total.div_ceil(pool.threads());
    pool.run(pool.threads(), &|task| {
        let (lo, hi) = (task * per, ((task + 1) * per).min(total));
        for t0 in (0..input.n_tok).step_by(TOKEN_CHUNK) {
            let tokens = t0..(t0 + TOKEN_CHUNK).min(input.n_tok);
            let mut base = 0;
            for p in parts.iter().flatten() {
                let n = p.rows.len();
                let (a, b) = (lo.max(base) - base, hi.min(base + n).saturating_sub(base));
                base += n;
                if a < b {
                    part_rows(p, a, b, input, tokens.clone());
                }
            }
        }
    });
}

/// Rows of a sparse set at least twice this long are read in segments (see [`part_rows`]).
const SEGMENT_BYTES: usize = 512;
/// How far ahead sparse rows are prefetched, in bytes of selected rows (measured on 4 KiB rows
/// from DRAM: 8 KiB read ~25% more GB/s than 4 KiB at 10% density; more gained nothing).
const SPARSE_AHEAD_BYTES: usize = 8192;

/// Selected rows `a..b` of `p` dotted with `tokens`. Full sets use the kernels that prefetch
/// the matrix linearly. A selected row of a sparse set is a short stream of its own, so the
/// hardware prefetcher barely starts on it; the loop prefetches the rows [`SPARSE_AHEAD_BYTES`]
/// later in step with the reading: while it reads segment `s` of row `i` (about
/// [`SEGMENT_BYTES`]), it prefetches segment `s` of row `i + ahead`, keeping a steady number of
/// lines in flight instead of a burst per row that overflows the miss queue.
fn part_rows(p: &Part, a: usize, b: usize, input: &Input, tokens: std::ops::Range<usize>) {
    let (q, cols) = (p.w.qtype, p.w.cols);
    let rb = q.row_bytes(cols);
    let row = |r: usize| &p.w.data[r * rb..(r + 1) * rb];
    let sparse = !p.rows.is_full();
    if let (false, RowDot::R8(_, f)) = (sparse, p.dot) {
        // Dense decode on repacked rows: runs of rows per kernel call.
        return dense_rows_r8(f, p, a, b, input, tokens);
    }
    if !sparse && tokens.len() == 1 {
        // Dense decode: the tightest loop (short rows make per-row work count).
        let t = tokens.start;
        let blocks = cols / q.block_len();
        for r in a..b {
            let v = input.dot(p.dot, row(r), t, 0, blocks, q.block_len());
            // SAFETY: r < w.rows and t < n_tok, inside the part's output (checked by
            // `matmul_shared`); thread ranges are disjoint; the output outlives `pool.run`.
            unsafe { *p.y.get().add(t * p.w.rows + r) = v };
        }
        return;
    }
    let ahead = SPARSE_AHEAD_BYTES.div_ceil(rb).max(1);
    let (bl, bb) = (q.block_len(), q.block_bytes());
    let blocks = cols / bl;
    // Segments of whole blocks (and, for the 8-bit activations, whole QK blocks; for repacked
    // rows, whole groups).
    let unit = match p.w.layout {
        RowLayout::Ggml => bl.max(QK) / bl,
        RowLayout::Repacked => GROUP,
        RowLayout::InputBlocks => panic!("input-block matrices are read by axpy only"),
    };
    let seg_blocks = (SEGMENT_BYTES / bb).max(1).div_ceil(unit) * unit;
    let n_seg = match sparse && rb >= 2 * SEGMENT_BYTES && cols.is_multiple_of(bl.max(QK)) {
        true => blocks.div_ceil(seg_blocks),
        false => 1,
    };
    let mut v = [0f32; TOKEN_CHUNK];
    for i in a..b {
        let r = p.rows.get(i);
        let next = (sparse && i + ahead < b).then(|| row(p.rows.get(i + ahead)));
        v.fill(0.0);
        for s in 0..n_seg {
            let (b0, b1) = (s * seg_blocks, ((s + 1) * seg_blocks).min(blocks));
            let (b0, b1) = if n_seg == 1 { (0, blocks) } else { (b0, b1) };
            let bytes = b0 * bb..b1 * bb;
            match next {
                Some(nx) if n_seg > 1 => prefetch::prefetch(&nx[bytes.clone()]),
                // Short rows: the whole next row at once.
                Some(nx) if s == 0 => prefetch::prefetch(nx),
                _ => {}
            }
            input.dots(p.dot, &row(r)[bytes], tokens.clone(), (b0, b1, bl), &mut v);
        }
        for (vt, t) in v.iter().zip(tokens.clone()) {
            // SAFETY: IndexSet entries are unique and < w.rows, t < n_tok, so t * w.rows + r
            // lies inside the part's output (n_tok * w.rows, checked by `matmul_shared`); the
            // thread ranges are disjoint, so each element has one writer; the output outlives
            // `pool.run`.
            unsafe { *p.y.get().add(t * p.w.rows + r) = *vt };
        }
    }
}

/// Rows a dense multi-token call of a repacked kernel takes at once (each call checks its
/// lengths and sets up its tokens). `dejavu bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2
/// --batch 1,8 -p 8 -n 64 -r 3`, builds alternating, six runs: 8 rows 8.33-8.89 ms at 64
/// against 8.65-9.01 at 16 (each run 1.3-4.7% faster), 8.63-8.96 at 256.
const ROW_RUN: usize = 64;

/// [`part_rows`] for a full set of repacked rows, at any token count: runs of [`ROW_RUN`] rows
/// per call of the tier's multi-token kernel, each output bit for bit the token's one-token
/// dot (`0.0 +` it, as the segment sums of `part_rows` give it).
fn dense_rows_r8(
    f: crate::kernels::dot_repacked::DotR8TokensFn,
    p: &Part,
    a: usize,
    b: usize,
    input: &Input,
    tokens: std::ops::Range<usize>,
) {
    let n = tokens.len();
    let (cols, rb) = (p.w.cols, p.w.qtype.row_bytes(p.w.cols));
    let acts: [&[BlockQ8A]; TOKEN_CHUNK] =
        std::array::from_fn(|i| input.act_of(tokens.start + i.min(n - 1), 0, cols));
    let groups: [&[ActGroup]; TOKEN_CHUNK] =
        std::array::from_fn(|i| input.groups_of(tokens.start + i.min(n - 1), 0, cols));
    let mut out = [0f32; ROW_RUN * TOKEN_CHUNK];
    for r0 in (a..b).step_by(ROW_RUN) {
        let r1 = (r0 + ROW_RUN).min(b);
        let o = &mut out[..(r1 - r0) * n];
        f(&p.w.data[r0 * rb..r1 * rb], &acts[..n], &groups[..n], o);
        for (r, row) in (r0..r1).zip(o.chunks_exact(n)) {
            for (t, &v) in tokens.clone().zip(row) {
                // SAFETY: r < w.rows (a full set's range) and t < n_tok, inside the part's
                // output (checked by `matmul_shared`); the thread ranges are disjoint; the
                // output outlives `pool.run`.
                unsafe { *p.y.get().add(t * p.w.rows + r) = 0.0 + v };
            }
        }
    }
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(*mut f32);
// SAFETY: only used for disjoint element writes (see `rows_dot`).
unsafe impl Send for SyncPtr {}
// SAFETY: as above.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    pub(crate) fn new(p: *mut f32) -> Self {
        Self(p)
    }
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

fn matmul_gemm(
    kern: &Kernels,
    pool: &SpinPool,
    w: &Weight,
    x: &[f32],
    y: &mut [f32],
    n_tok: usize,
) {
    let k = w.cols;
    // Fixed tiles of GEMM_TILE_ROWS rows (the last one shorter), taken by whichever thread is
    // free: a row's product has the same tile shape, so the same summation order inside `gemm`,
    // at any thread count (greedy output does not change with `-t`), and a thread that lost its
    // core holds at most one tile. Each tile is dequantized, then multiplied while in cache.
    let n_tiles = w.rows.div_ceil(GEMM_TILE_ROWS);
    let yp = SyncPtr::new(y.as_mut_ptr());
    pool.run(n_tiles, &|t| {
        let a = t * GEMM_TILE_ROWS;
        let nr = GEMM_TILE_ROWS.min(w.rows - a);
        TILE.with_borrow_mut(|tile| {
            tile.resize(GEMM_TILE_ROWS * k, 0.0);
            for (j, out) in tile.chunks_exact_mut(k).take(nr).enumerate() {
                dequantize_row(kern, w, a + j, out);
            }
            // SAFETY: all pointers come from live slices with the stated extents: dst is y
            // viewed as n_tok x w.rows (row stride w.rows), columns a..a+nr, written by this
            // task alone; lhs is x (n_tok x k, row stride k); rhs(kk, j) = tile[j * k + kk].
            unsafe {
                gemm::gemm(
                    n_tok,
                    nr,
                    k,
                    yp.get().add(a),
                    1,
                    w.rows as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tile.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    });
}

/// Whether `w` goes through the integer prefill kernel `f`: a type it takes, rows of whole Q8A
/// blocks.
fn integer_prefill(f: &Gemm, w: &Weight) -> bool {
    (f.types)(w.qtype) && w.cols.is_multiple_of(QK.max(w.qtype.block_len()))
}

/// The tokens of one `matmul_shared` call for the integer kernel: quantized once, then prepared
/// per group size on first use (`built`).
#[derive(Default)]
struct IntInput {
    blocks: Vec<BlockQ8A>,
    acts: [Acts; 2],
    built: [bool; 2],
}

impl IntInput {
    fn acts(&mut self, k: &Kernels, x: &[f32], cols: usize, g: usize) -> &Acts {
        let i = usize::from(g == QK);
        if !self.built[i] {
            if !self.built[1 - i] {
                self.blocks
                    .resize(x.len() / QK, bytemuck::Zeroable::zeroed());
                for (xt, bt) in x
                    .chunks_exact(cols)
                    .zip(self.blocks.chunks_exact_mut(cols / QK))
                {
                    (k.quantize)(xt, bt);
                }
            }
            self.acts[i].build(g, cols, &self.blocks);
            self.built[i] = true;
        }
        &self.acts[i]
    }
}

/// The prefill product on the integer kernel: fixed tiles of `GEMM_TILE_ROWS` rows, taken by
/// whichever thread is free, as [`matmul_gemm`]; each tile is unpacked panel by panel, and a
/// panel is multiplied with every token while it is in cache. A product's value does not depend
/// on the tile or thread that computed it.
fn matmul_int(
    k: &Kernels,
    f: Gemm,
    pool: &SpinPool,
    w: &Weight,
    acts: &Acts,
    y: &mut [f32],
    n_tok: usize,
) {
    let yp = SyncPtr::new(y.as_mut_ptr());
    pool.run(w.rows.div_ceil(GEMM_TILE_ROWS), &|t| {
        PANEL.with_borrow_mut(|(panel, ggml)| {
            let tile = t * GEMM_TILE_ROWS..((t + 1) * GEMM_TILE_ROWS).min(w.rows);
            for p0 in tile.step_by(PR) {
                let nr = PR.min(w.rows - p0);
                panel.reset(w.qtype, w.cols);
                for r in p0..p0 + nr {
                    match w.layout {
                        RowLayout::Ggml => panel.set_row(w.row(r), f.unpack),
                        RowLayout::Repacked => {
                            ggml.resize(w.row(r).len(), 0);
                            (k.unpack)(w.qtype, w.row(r), ggml);
                            panel.set_row(ggml, f.unpack);
                        }
                        RowLayout::InputBlocks => {
                            panic!("input-block matrices are read by axpy only")
                        }
                    }
                }
                panel.finish(f.finish);
                let mut out = [[0f32; PR]; NT];
                for t0 in (0..n_tok).step_by(NT) {
                    (f.kernel)(panel, acts, t0, &mut out);
                    for (tt, o) in out.iter().enumerate().take(n_tok - t0) {
                        for (r, &v) in o.iter().enumerate().take(nr) {
                            // SAFETY: t0 + tt < n_tok and p0 + r < w.rows, inside y (checked
                            // by `matmul_shared`); tiles are disjoint, so each element has one
                            // writer; y outlives `pool.run`.
                            unsafe { *yp.get().add((t0 + tt) * w.rows + p0 + r) = v };
                        }
                    }
                }
            }
        })
    });
}

/// Row `r` of `w` in f32, whatever its layout.
pub fn dequantize_row(k: &Kernels, w: &Weight, r: usize, out: &mut [f32]) {
    match w.layout {
        RowLayout::Ggml => (k.dequantize)(w.qtype, w.row(r), out),
        RowLayout::Repacked => (k.dequantize_repacked)(w.qtype, w.row(r), out),
        RowLayout::InputBlocks => {
            use crate::kernels::axpy_blocks::{block, input_row};
            input_row(
                w.qtype,
                block(w.qtype, w.data, w.cols, r / 32),
                w.cols,
                r % 32,
                out,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use crate::kernels::testutil::{random_f32, random_row};
    use dejavu_backend_api::QuantType;

    /// A sparse set's rows (read in prefetched segments when long) equal the same rows of the
    /// dense product (masked dense) within float rounding, and unselected rows are 0; for every
    /// tier and type, rows long enough to be segmented with a ragged last segment, and short (and
    /// many: several runs of dense repacked rows); for one token, a chunk and a half of tokens
    /// (each row dotted with several), and enough for the tiles (repacked rows too).
    #[test]
    fn sparse_rows_are_masked_dense() {
        for isa in Isa::supported() {
            let k = Kernels::for_isa(isa).unwrap();
            let pool = SpinPool::new(2);
            for q in QuantType::ALL {
                // Repacked rows through the tiles too.
                let tiles = gemm_min_tokens_repacked(isa) + 1;
                for (cols, n_tok) in [(256 * 9, 1), (256, 1), (256 * 9, 6), (256, 3), (256, tiles)]
                {
                    // Short rows: enough that each thread's share of the dense repacked
                    // rows spans more than one run of `ROW_RUN`, the last one ragged.
                    let n = if cols == 256 { 2 * ROW_RUN + 37 } else { 37 };
                    let data: Vec<u8> = (0..n)
                        .flat_map(|r| random_row(q, cols, r as u64 * 5 + 1))
                        .collect();
                    let w = Weight::new(q, n, cols, &data).unwrap();
                    let mut row = vec![0f32; cols];
                    let x = random_f32(n_tok * cols, 9);
                    let set =
                        IndexSet::new(n, (0..n as u32).filter(|i| i % 3 != 0).collect()).unwrap();
                    let mut got = vec![7f32; n_tok * n];
                    matmul(&k, &pool, &w, &set, &x, &mut got);
                    if repack::supports(q) {
                        // The same rows repacked give the same products.
                        let mut packed = vec![0u8; data.len()];
                        repack::repack_matrix(q, cols, &data, &mut packed);
                        let wr = Weight::new(q, n, cols, &packed)
                            .unwrap()
                            .with_layout(RowLayout::Repacked);
                        let mut rep = vec![7f32; n_tok * n];
                        matmul(&k, &pool, &wr, &set, &x, &mut rep);
                        let mut dense_rep = vec![0f32; n_tok * n];
                        matmul(&k, &pool, &wr, &IndexSet::full(n), &x, &mut dense_rep);
                        // The ggml rows through the path the repacked ones take: the dots
                        // (token by token) below `gemm_from`.
                        let mut dense = vec![0f32; n_tok * n];
                        if n_tok < gemm_from(&k, &wr) {
                            for (xt, yt) in x.chunks_exact(cols).zip(dense.chunks_exact_mut(n)) {
                                matmul(&k, &pool, &w, &IndexSet::full(n), xt, yt);
                            }
                        } else {
                            matmul(&k, &pool, &w, &IndexSet::full(n), &x, &mut dense);
                        }
                        for i in 0..n_tok * n {
                            let tol = 1e-4 * dense[i].abs().max(1.0);
                            assert!(
                                (rep[i] - got[i]).abs() <= tol,
                                "{isa} {q:?} repacked sparse {i}"
                            );
                            assert!(
                                (dense_rep[i] - dense[i]).abs() <= tol,
                                "{isa} {q:?} repacked {i} n_tok {n_tok}: {} vs {}",
                                dense_rep[i],
                                dense[i]
                            );
                        }
                        let mut row_r = vec![0f32; cols];
                        for r in [0, n - 1] {
                            super::dequantize_row(&k, &wr, r, &mut row_r);
                            crate::dequant::dequantize_row(q, w.row(r), &mut row);
                            assert_eq!(row_r, row, "{isa} {q:?} dequantized repacked row {r}");
                        }
                    }
                    for t in 0..n_tok {
                        // Each token alone, all rows: the one-token dense path.
                        let xt = &x[t * cols..(t + 1) * cols];
                        let mut dense = vec![0f32; n];
                        matmul(&k, &pool, &w, &IndexSet::full(n), xt, &mut dense);
                        for r in 0..n {
                            let g = got[t * n + r];
                            if !set.contains(r) {
                                assert_eq!(g, 0.0, "{isa} {q:?} row {r} not selected");
                                continue;
                            }
                            crate::dequant::dequantize_row(q, w.row(r), &mut row);
                            let mag: f32 = row.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                            assert!(
                                (g - dense[r]).abs() <= 1e-5 * mag + 1e-6,
                                "{isa} {q:?} cols {cols} token {t} row {r}: {g} vs {}",
                                dense[r]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Two and three tokens of a full set (the dot path below `GEMM_MIN_TOKENS`) equal one token
    /// at a time.
    #[test]
    fn few_tokens_equal_one_at_a_time() {
        let k = Kernels::for_isa(Isa::detect()).unwrap();
        let pool = SpinPool::new(2);
        for q in QuantType::ALL {
            let (n, cols, n_tok) = (19, 512, 3);
            let data: Vec<u8> = (0..n).flat_map(|r| random_row(q, cols, r as u64)).collect();
            let w = Weight::new(q, n, cols, &data).unwrap();
            let x = random_f32(n_tok * cols, 4);
            let mut all = vec![0f32; n_tok * n];
            matmul(&k, &pool, &w, &IndexSet::full(n), &x, &mut all);
            for t in 0..n_tok {
                let mut one = vec![0f32; n];
                matmul(
                    &k,
                    &pool,
                    &w,
                    &IndexSet::full(n),
                    &x[t * cols..(t + 1) * cols],
                    &mut one,
                );
                assert_eq!(&all[t * n..(t + 1) * n], &one[..], "{q:?} token {t}");
            }
        }
    }

    /// `matmul_shared_steps` gives each of 1-9 tokens its one-token product bit for bit, on
    /// every tier, for every quantized type (the K-quants' multi-token kernels among them), ggml
    /// and repacked rows (the multi-token repacked kernel), full and sparse
    /// sets, rows of whole groups and with a ragged tail of blocks, long (segmented) and short.
    #[test]
    fn steps_equal_one_token_calls() {
        for isa in Isa::supported() {
            let k = Kernels::for_isa(isa).unwrap();
            let pool = SpinPool::new(2);
            for q in QuantType::ALL.into_iter().filter(|&q| q.block_len() > 1) {
                let whole = |c: &usize| c.is_multiple_of(q.block_len());
                for cols in [QK * 8 * 3, QK * 11, QK * 8 * 20 + QK * 3]
                    .into_iter()
                    .filter(whole)
                {
                    let n = 21;
                    let data: Vec<u8> = (0..n)
                        .flat_map(|r| random_row(q, cols, r as u64 * 3 + 2))
                        .collect();
                    let mut layouts = vec![(data.clone(), RowLayout::Ggml)];
                    if repack::supports(q) {
                        let mut packed = vec![0u8; data.len()];
                        repack::repack_matrix(q, cols, &data, &mut packed);
                        layouts.push((packed, RowLayout::Repacked));
                    }
                    let sparse =
                        IndexSet::new(n, (0..n as u32).filter(|i| i % 4 != 1).collect()).unwrap();
                    for (bytes, layout) in &layouts {
                        let w = Weight::new(q, n, cols, bytes).unwrap().with_layout(*layout);
                        for set in [IndexSet::full(n), sparse.clone()] {
                            let x = random_f32(9 * cols, cols as u64);
                            for n_tok in 1..=9 {
                                let x = &x[..n_tok * cols];
                                let mut all = vec![7f32; n_tok * n];
                                let mut jobs = [MatmulJob {
                                    w,
                                    rows: &set,
                                    y: &mut all,
                                }];
                                matmul_shared_steps(&k, &pool, x, &mut jobs);
                                for t in 0..n_tok {
                                    let mut one = vec![7f32; n];
                                    let xt = &x[t * cols..(t + 1) * cols];
                                    matmul(&k, &pool, &w, &set, xt, &mut one);
                                    let got: Vec<u32> =
                                        all[t * n..][..n].iter().map(|v| v.to_bits()).collect();
                                    let want: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                                    assert_eq!(got, want, "{isa} {q:?} {layout:?} cols {cols} {n_tok} tokens, token {t}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
