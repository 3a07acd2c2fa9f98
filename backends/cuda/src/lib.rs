//! The CUDA backend: [`CudaDevice`] implements [`Device`], the device-resident decode step.
//! Weights are uploaded once ([`Device::upload_mat`], in the file's block layout), activations
//! and the f16 KV cache stay in GPU memory, selections are index lists in GPU memory, and a step
//! is recorded once as a CUDA graph and replayed at every position (the token and position are
//! read from device memory, [`Device::set_step`]). A prompt runs as batches of rows through the
//! same verbs, its products tiled (matmul.cu).
//!
//! The kernels (`src/kernels/*.cu`, one file per operation, each checked against the CPU scalar
//! reference by `tests/kernels.rs`) are compiled at run time by NVRTC for the device's compute
//! capability, once per process. The driver and NVRTC are loaded at run time too, so this crate
//! builds on machines without CUDA; [`CudaDevice::new`] says why when they are missing.
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream,
    PushKernelArg,
};
use dejavu_backend_api::{
    check_scale_cap, Activation, AttnGeom, BackendError, Device, InputMask, LazyKv, Product,
    QuantType, Rotary, Rows, SeqRow, SeqRows, StepRow, TopK, Weight, MAX_ROWS,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod attention;
mod compile;
mod kv;
mod launch;
mod matmul;
mod mma;
mod open;
mod products;
mod selection;
mod seqs;
mod world;
pub use compile::{compile, nvrtc_present};
use products::act_code;
pub use world::{nccl_id, ID_BYTES};

/// The kernels' name suffix of each weight type (`FOR_TYPES` in common.cuh).
fn type_suffix(q: QuantType) -> &'static str {
    match q {
        QuantType::F32 => "f32",
        QuantType::F16 => "f16",
        QuantType::BF16 => "bf16",
        QuantType::Q8_0 => "q8_0",
        QuantType::Q4_0 => "q4_0",
        QuantType::Q4_1 => "q4_1",
        QuantType::Q5_0 => "q5_0",
        QuantType::Q4K => "q4_k",
        QuantType::Q6K => "q6_k",
        QuantType::Q5_1 => "q5_1",
        QuantType::Q2K => "q2_k",
        QuantType::Q3K => "q3_k",
        QuantType::Q5K => "q5_k",
        QuantType::IQ4NL => "iq4_nl",
        QuantType::IQ4XS => "iq4_xs",
    }
}

/// The CUDA driver can be loaded, or why not (cudarc panics on a missing library).
fn need_driver() -> Result<(), BackendError> {
    // SAFETY: only tries to open the library (dlopen), and closes it again.
    match unsafe { cudarc::driver::sys::is_culib_present() } {
        true => Ok(()),
        false => Err(BackendError::Device(
            "the CUDA driver (libcuda.so) was not found: is an NVIDIA driver installed?".into(),
        )),
    }
}

/// How many GPUs the driver sees (an error where there is no driver).
pub fn device_count() -> Result<usize, BackendError> {
    need_driver()?;
    let n = CudaContext::device_count().map_err(dev_err)?;
    Ok(n.max(0) as usize)
}

/// One GPU, its main stream and a second lane (lookahead), the compiled kernels and the step's
/// `{pos, token of each row}` in device memory.
///
/// One sequence at a time: its streams, lane switch and top-k scratch are shared by every
/// caller, so sessions decoding at once from several threads need a `CudaDevice` each.
pub struct CudaDevice {
    stream: Arc<CudaStream>,
    /// The second lane (`Device::fork`), with the events that order it against the first, and
    /// whether verbs go to it now. `SIDE=0` in `DEJAVU_CUDA_DEFINES` keeps one lane.
    side: Arc<CudaStream>,
    forked: CudaEvent,
    joined: CudaEvent,
    on_side: AtomicBool,
    lanes: bool,
    _module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    step: CudaSlice<i32>,
    /// Steps of several sequences' tables (`seqs::SEQ_TAB` values a row, `Device::attend_rows`):
    /// a call's own rows (`seqs::SEQ_SLOT` values), then every layer's rows as
    /// `Device::set_seq_rows` wrote them, which `seq_set` holds on the host.
    seq_tab: CudaSlice<u64>,
    seq_set: Mutex<Option<seqs::SeqSet>>,
    /// The rows of the batch last set (`Device::set_step`).
    batch: AtomicUsize,
    n_sm: usize,
    /// Rows per warp of the matvec kernels, and the blocks per SM under which they split rows:
    /// products of every row, and gathers over a selection (see `tuning`).
    mv_rows: usize,
    mv_fill: usize,
    mv_fill_sel: usize,
    /// `MVR_FILL` (default 2): `matvec_rows_T`'s blocks per SM under which its warps split a
    /// row's columns (2, 4 or 8 warps an output). Measured on the H100 with 1 warp an output
    /// (synthetic OPT-13B f16, 8 sequences): a head predictor's first layer (40 blocks) took
    /// 87 us, more than a 5120 x 5120 product on the tensor cores (77 us).
    mvr_fill: usize,
    /// `MV_AHEAD_F16=1`: f16 products of every row take the kernel that loads ahead, as bf16's.
    mv_ahead_f16: bool,
    /// `ATTEND_ROWS=1` (the default): a step of several sequences' attention block in four
    /// launches (`Device::attend_rows`); at 0 the rows go one by one through the one-row verbs.
    /// Measured on the H200 (synthetic OPT-13B f16, 8 sequences, `dejavu bench --batch`): a
    /// step of 38.4 ms against 45.2 row by row.
    attend_rows: bool,
    /// `MMA=1` (the default; compute capability 8.0 and up): products of 2 to
    /// `mma::MMA_MAX` batch rows over f16 or bf16 weights (rows a multiple of 32) run on
    /// the tensor cores (matvec_mma.cu); at 0 they take `matvec_rows_T` (8 rows a launch).
    /// Measured on the H200 (synthetic OPT-13B f16, `dejavu bench --backend cuda --batch
    /// 1,2,4,8,16,32 -p 128 -n 16 -r 2`): a step of 8 rows 13.44 ms against 38.20, of 16 26.84
    /// against 103.74, of 32 45.77 against 110.26; one row 7.83 (not on this path).
    mma: bool,
    /// Compute capability 8.0 or later (tf32 `mma.sync`).
    mma_arch: bool,
    /// `MMA_H=1` (the default): those products split their inputs into 16-bit parts first and
    /// run m16n8k16 on the weights as loaded (`mma::split_inputs`); at 0, tf32 with the inputs
    /// split in registers. Measured on the H200 (synthetic OPT-13B f16, `dejavu bench --backend
    /// cuda --batch 1,2,4,8,16,32 -p 128 -n 16 -r 2`, with `HMMA_U=2`, `HMMA_OCC=4` and before
    /// the split between blocks): a step of 8 rows 11.82 ms (5.30x one row's aggregate tok/s,
    /// one row 7.83 ms), 16 rows 15.88 (7.89x), 32 rows 24.39 (10.27x), against 13.14, 26.92
    /// and 45.87 with tf32 in an earlier session's run.
    mma_h: bool,
    /// Each lane's scratch for those products (`mma::MmaScratch`), made at open where the
    /// tensor-core products can run.
    mma_scratch: Option<[mma::MmaScratch; 2]>,
    /// `HMMA_FILL` (default 6): `matvec_hmma`'s blocks per SM under which a tile's chunks split
    /// between blocks (`mma::mma_ks`; 1 keeps a block a tile). Measured on the H100 with
    /// `profile_batch`: 8 rows through the 5120 x 20480 fc2 127.1 us at 6 (4 blocks a tile)
    /// against 134.1 at 3 (2 a tile), the 5120-square product 38.6 against 39.6: the split
    /// buys little there; the input split's own launch is the suspect (2 rows cost as much as 8).
    hmma_fill: usize,
    /// `SPLIT_COLS` (default 1024; 0: a block a row): the inputs' split runs a block per that
    /// many columns of a row (`mma_split_T`). H200, `profile_batch`, 8 rows: fc2 (20480 columns
    /// in) 85.1 us with a block a row, 81.2 with 1024 (81.5 with 2048), the other products
    /// 0.6-0.9 us faster; `dejavu bench --batch` on synthetic:opt-13b, 8 rows 11.51 -> 11.23 ms.
    split_cols: usize,
    /// `MMA_PROMPT=1`: a prompt's products of every row, too, in chunks of `MMA_MAX` rows
    /// (each chunk reads the weights again) instead of matmul.cu's tiles.
    mma_prompt: bool,
    /// `ATT_SPAN` (default 512; 0: off): attention splits each row's positions into spans of
    /// at least this many, as many as fill the SMs 8 deep, each span a block, then merges them
    /// (flash-decoding: `attention_split_f16`, `attention_rows_split_f16`); the spans' sums go
    /// to `att_part` (`ATT_PART` floats a SM).
    att_span: usize,
    att_part: CudaSlice<f32>,
    /// `SEQ_GRAPHS` (default 1): `Device::set_seq_rows` writes every layer's rows of a step of
    /// several sequences before it, so that the step is recorded (a graph per leader and row
    /// count) and replayed; 0: each layer's call uploads its rows, and the step runs eagerly.
    seq_graphs: bool,
    /// `GRAPHS` (default 1): a decode step is recorded once as a CUDA graph and replayed;
    /// `GRAPHS=0` runs every step's launches eagerly (a diagnostic: what recording buys).
    graphs: bool,
    /// The global state of `top_k_select`: 3 selections' `products::TK_SCRATCH`, zero between
    /// launches.
    tk_scratch: CudaSlice<u32>,
    /// 256-column chunks per axpy block, and axpy blocks per SM (see `tuning`).
    ax_vec: usize,
    ax_fill: usize,
    /// Batch rows per pass of `axpy_rows_T` (`AXB_ROWS`, default 8), and its blocks per SM
    /// (`AXB_FILL`, default 4): a step of several sequences' sparse down projection.
    axb_rows: usize,
    axb_fill: usize,
    name: String,
    /// The dynamic shared memory each kernel is allowed beyond the default 48 KiB (raised on
    /// demand, before any capture that needs it).
    smem: Mutex<HashMap<&'static str, usize>>,
    /// This GPU's communicator in a tensor-parallel world ([`CudaDevice::in_world`]).
    world: Option<world::Nccl>,
    /// `--deterministic` ([`CudaDevice::set_deterministic`]): batch-invariant products and
    /// attention (`matmul::launch_invariant`, `att_spans`).
    deterministic: bool,
}

/// An f32 vector in GPU memory.
pub struct Buf(CudaSlice<f32>);
/// A u32 index list in GPU memory.
pub struct Idx(CudaSlice<u32>);
/// A weight matrix in GPU memory, in its file's block layout.
pub struct Mat {
    data: CudaSlice<u8>,
    qtype: QuantType,
    rows: usize,
    cols: usize,
}
/// One layer's keys or values, `[n_ctx][width]` f16.
pub struct Cache {
    data: CudaSlice<u16>,
    n_ctx: usize,
    width: usize,
}
/// A recorded decode step.
pub struct Graph(CudaGraph);

fn dev_err(e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{e:?}"))
}

fn shape(what: String) -> BackendError {
    BackendError::Shape(what)
}

fn need(what: &str, have: usize, want: usize) -> Result<(), BackendError> {
    match have >= want {
        true => Ok(()),
        false => Err(shape(format!("{what}: {have} values, needs {want}"))),
    }
}

impl Device for CudaDevice {
    type Buf = Buf;
    type Idx = Idx;
    type Mat = Mat;
    type Cache = Cache;
    type Graph = Graph;

    fn name(&self) -> String {
        match self.deterministic {
            true => format!("cuda ({}), deterministic", self.name),
            false => format!("cuda ({})", self.name),
        }
    }
    fn supports(&self, _qtype: QuantType) -> bool {
        true
    }

    fn zeros(&self, n: usize) -> Result<Buf, BackendError> {
        Ok(Buf(self.stream.alloc_zeros(n.max(1)).map_err(dev_err)?))
    }
    fn upload(&self, x: &[f32]) -> Result<Buf, BackendError> {
        match x.is_empty() {
            true => self.zeros(1),
            false => Ok(Buf(self.stream.clone_htod(x).map_err(dev_err)?)),
        }
    }
    fn upload_idx(&self, idx: &[u32]) -> Result<Idx, BackendError> {
        match idx.is_empty() {
            true => Ok(Idx(self.stream.alloc_zeros(1).map_err(dev_err)?)),
            false => Ok(Idx(self.stream.clone_htod(idx).map_err(dev_err)?)),
        }
    }
    fn upload_mat(&self, w: &Weight) -> Result<Mat, BackendError> {
        w.check();
        if w.layout != dejavu_backend_api::RowLayout::Ggml {
            return Err(BackendError::Unsupported {
                backend: self.name(),
                what: format!(
                    "{:?} rows (the file's row layout only: load the model with --no-repack)",
                    w.layout
                ),
            });
        }
        if w.cols > i32::MAX as usize || w.rows > i32::MAX as usize {
            return Err(shape(format!("{}x{} matrix", w.rows, w.cols)));
        }
        Ok(Mat {
            data: self.stream.clone_htod(w.data).map_err(dev_err)?,
            qtype: w.qtype,
            rows: w.rows,
            cols: w.cols,
        })
    }
    fn cache(&self, n_ctx: usize, width: usize) -> Result<Cache, BackendError> {
        Ok(Cache {
            data: self.stream.alloc_zeros(n_ctx * width).map_err(dev_err)?,
            n_ctx,
            width,
        })
    }
    fn copy_cache(&self, src: &Cache, dst: &mut Cache, n: usize) -> Result<(), BackendError> {
        if src.width != dst.width || n > src.n_ctx || n > dst.n_ctx {
            return Err(shape(format!(
                "copying {n} positions of a cache of {}x{} into one of {}x{}",
                src.n_ctx, src.width, dst.n_ctx, dst.width
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let len = n * src.width;
        (self.lane())
            .memcpy_dtod(&src.data.slice(..len), &mut dst.data.slice_mut(..len))
            .map_err(dev_err)
    }
    fn download(&self, x: &Buf, out: &mut [f32]) -> Result<(), BackendError> {
        need("download", x.0.len(), out.len())?;
        self.stream
            .memcpy_dtoh(&x.0.slice(..out.len()), out)
            .map_err(dev_err)?;
        self.synchronize()
    }
    fn download_idx(&self, x: &Idx, out: &mut [u32]) -> Result<(), BackendError> {
        need("download_idx", x.0.len(), out.len())?;
        self.stream
            .memcpy_dtoh(&x.0.slice(..out.len()), out)
            .map_err(dev_err)?;
        self.synchronize()
    }
    fn write_idx(&self, x: &mut Idx, v: &[u32]) -> Result<(), BackendError> {
        need("write_idx", x.0.len(), v.len())?;
        if v.is_empty() {
            return Ok(());
        }
        let mut dst = x.0.slice_mut(..v.len());
        self.stream.memcpy_htod(v, &mut dst).map_err(dev_err)
    }
    fn set_step(&self, tokens: &[u32], pos: usize) -> Result<(), BackendError> {
        let big = tokens.iter().any(|&t| t > i32::MAX as u32);
        if tokens.is_empty() || tokens.len() > MAX_ROWS || big || pos > i32::MAX as usize / 2 {
            return Err(shape(format!(
                "a batch of {} rows at position {pos}",
                tokens.len()
            )));
        }
        let positions: Vec<usize> = (pos..pos + tokens.len()).collect();
        self.set_steps(tokens, &positions)
    }
    fn set_steps(&self, tokens: &[u32], positions: &[usize]) -> Result<(), BackendError> {
        let big = tokens.iter().any(|&t| t > i32::MAX as u32);
        let far = positions.iter().any(|&p| p > i32::MAX as usize / 2);
        let n = tokens.len();
        if n == 0 || n > MAX_ROWS || big || far || positions.len() != n {
            return Err(shape(format!(
                "a batch of {n} rows at {} positions",
                positions.len()
            )));
        }
        // {position of row 0, each row's token (MAX_ROWS places), each row's position}.
        let mut step = vec![0i32; 1 + MAX_ROWS + n];
        step[0] = positions[0] as i32;
        for (r, (&t, &p)) in tokens.iter().zip(positions).enumerate() {
            (step[1 + r], step[1 + MAX_ROWS + r]) = (t as i32, p as i32);
        }
        launch::htod(&self.stream, &self.step, &step)?;
        self.batch.store(n, Ordering::Relaxed);
        self.forget_seq_rows();
        Ok(())
    }

    fn embed(
        &self,
        t: &Mat,
        which: StepRow,
        acc: bool,
        x: &mut Buf,
        rows: usize,
    ) -> Result<(), BackendError> {
        self.batch_rows("embed", rows)?;
        need("embed output", x.0.len(), rows * t.cols)?;
        let (w, off) = match which {
            StepRow::Token { first } => (0i32, -(first as i32)),
            StepRow::Position { offset } => (1, offset as i32),
        };
        let f = self.func(&format!("embed_{}", type_suffix(t.qtype)));
        let (t_rows, cols, acc) = (t.rows as i32, t.cols as i32, acc as i32);
        let (wp, sp, xp) = (self.ptr(&t.data), self.ptr(&self.step), self.ptr(&x.0));
        let pp = sp + ((1 + MAX_ROWS) * std::mem::size_of::<i32>()) as u64;
        let mut b = self.lane().launch_builder(f);
        b.arg(&wp)
            .arg(&t_rows)
            .arg(&cols)
            .arg(&sp)
            .arg(&pp)
            .arg(&w)
            .arg(&off)
            .arg(&acc)
            .arg(&xp);
        launch::run(b, launch::rows(launch::grid(t.cols.div_ceil(8), 256), rows))
    }

    fn batch_invariant(&self) -> bool {
        self.deterministic
    }

    fn matvecs(&self, x: &Buf, jobs: &mut [Product<'_, Self>]) -> Result<(), BackendError> {
        match self.deterministic {
            true => self.launch_invariant(x, 1, jobs),
            false => self.launch_matvecs(x, jobs),
        }
    }

    fn matmul(
        &self,
        x: &Buf,
        rows: usize,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.launch_matmul(x, rows, jobs)
    }

    fn axpy(
        &self,
        w: &Mat,
        rows: Rows<'_, Idx>,
        a: &Buf,
        bias: Option<&Buf>,
        y: &mut Buf,
    ) -> Result<(), BackendError> {
        let mut job = [Product::new(w, rows, y).bias(bias)];
        self.launch_axpys(a, None, &mut job)
    }

    fn axpy_steps(
        &self,
        w: &Mat,
        rows: Rows<'_, Idx>,
        a: &Buf,
        n: usize,
        bias: Option<&Buf>,
        y: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_axpy_steps(w, rows, a, n, bias, y)
    }

    fn axpys(
        &self,
        a: &Buf,
        mask: Option<InputMask<'_, Buf>>,
        jobs: &mut [Product<'_, Self>],
    ) -> Result<(), BackendError> {
        self.launch_axpys(a, mask, jobs)
    }

    fn clear(&self, bufs: &mut [(&mut Buf, usize)]) -> Result<(), BackendError> {
        self.launch_clear(bufs)
    }

    fn rmsnorm(
        &self,
        x: &Buf,
        w: &Buf,
        eps: f32,
        out: &mut Buf,
        rows: usize,
    ) -> Result<(), BackendError> {
        let n = w.0.len();
        // Rows of a batch, or each of their heads (qwen3's Q and K norms): a grid of blocks.
        if rows == 0 || rows > i32::MAX as usize {
            return Err(shape(format!("rmsnorm of {rows} rows")));
        }
        need("rmsnorm input", x.0.len(), rows * n)?;
        need("rmsnorm output", out.0.len(), rows * n)?;
        let (xp, wp, op, ni) = (self.ptr(&x.0), self.ptr(&w.0), self.ptr(&out.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("rmsnorm"));
        b.arg(&xp).arg(&wp).arg(&ni).arg(&eps).arg(&op);
        launch::run(b, launch::blocks(launch::one_block(n), rows))
    }

    fn layernorm(
        &self,
        x: &Buf,
        w: &Buf,
        bias: Option<&Buf>,
        eps: f32,
        out: &mut Buf,
        rows: usize,
    ) -> Result<(), BackendError> {
        let n = w.0.len();
        self.batch_rows("layernorm", rows)?;
        need("layernorm input", x.0.len(), rows * n)?;
        need("layernorm output", out.0.len(), rows * n)?;
        if let Some(bb) = bias {
            need("layernorm bias", bb.0.len(), n)?;
        }
        let (xp, wp, op, ni) = (self.ptr(&x.0), self.ptr(&w.0), self.ptr(&out.0), n as i32);
        let bp = bias.map_or(0, |bb| self.ptr(&bb.0));
        let mut b = self.lane().launch_builder(self.func("layernorm"));
        b.arg(&xp).arg(&wp).arg(&bp).arg(&ni).arg(&eps).arg(&op);
        launch::run(b, launch::blocks(launch::one_block(n), rows))
    }

    fn add(&self, x: &mut Buf, y: &Buf, n: usize) -> Result<(), BackendError> {
        need("add output", x.0.len(), n)?;
        need("add input", y.0.len(), n)?;
        let (xp, yp, ni) = (self.ptr(&x.0), self.ptr(&y.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("add_f32"));
        b.arg(&xp).arg(&yp).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    fn scatter(
        &self,
        src: &Buf,
        idx: &Idx,
        count: usize,
        group: usize,
        dst: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_scatter(src, idx, count, group, dst)
    }

    fn gather(
        &self,
        src: &Buf,
        idx: &Idx,
        count: usize,
        group: usize,
        dst: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_gather(src, idx, count, group, dst)
    }

    fn sparsify(
        &self,
        x: &Buf,
        n: usize,
        mask: InputMask<'_, Buf>,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_sparsify(x, n, mask, out)
    }

    fn abs(&self, x: &mut Buf, n: usize) -> Result<(), BackendError> {
        self.launch_abs(x, n)
    }

    fn count_nonzero(
        &self,
        x: &Buf,
        n: usize,
        group: usize,
        out: &mut Buf,
        slot: usize,
    ) -> Result<(), BackendError> {
        self.launch_count_nonzero(x, n, group, out, slot)
    }

    fn group_norms(
        &self,
        x: &Buf,
        groups: usize,
        width: usize,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_group_norms(x, groups, width, out)
    }

    fn copy(&self, x: &Buf, y: &mut Buf, n: usize) -> Result<(), BackendError> {
        need("copy input", x.0.len(), n)?;
        need("copy output", y.0.len(), n)?;
        let (xp, yp, ni) = (self.ptr(&x.0), self.ptr(&y.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("copy_f32"));
        b.arg(&xp).arg(&yp).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    fn take_rows(
        &self,
        x: &Buf,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Buf,
    ) -> Result<(), BackendError> {
        need("take_rows input", x.0.len(), (r + n) * width)?;
        need("take_rows output", y.0.len(), n * width)?;
        self.copy_values(x, r * width, y, 0, n * width)
    }

    fn put_rows(
        &self,
        x: &Buf,
        r: usize,
        n: usize,
        width: usize,
        y: &mut Buf,
    ) -> Result<(), BackendError> {
        need("put_rows input", x.0.len(), n * width)?;
        need("put_rows output", y.0.len(), (r + n) * width)?;
        self.copy_values(x, 0, y, r * width, n * width)
    }

    fn rope(
        &self,
        x: &mut Buf,
        n_heads: usize,
        head_dim: usize,
        rope: Rotary<'_, Buf>,
        rows: usize,
    ) -> Result<(), BackendError> {
        need("rope", x.0.len(), rows * n_heads * head_dim)?;
        let xp = self.ptr(&x.0);
        self.launch_rope(xp, n_heads, 0, 0, head_dim, rope, rows, 0)
    }

    fn rope_qk(
        &self,
        q: &mut Buf,
        n_q: usize,
        k: &mut Buf,
        n_k: usize,
        head_dim: usize,
        rope: Rotary<'_, Buf>,
        rows: usize,
    ) -> Result<(), BackendError> {
        need("rope queries", q.0.len(), rows * n_q * head_dim)?;
        need("rope keys", k.0.len(), rows * n_k * head_dim)?;
        let (qp, kp) = (self.ptr(&q.0), self.ptr(&k.0));
        self.launch_rope(qp, n_q, kp, n_k, head_dim, rope, rows, 0)
    }

    fn glu(&self, act: Activation, gate: &mut Buf, up: &Buf, n: usize) -> Result<(), BackendError> {
        need("glu gate", gate.0.len(), n)?;
        need("glu up", up.0.len(), n)?;
        let (a, gp, up_, ni) = (act_code(act), self.ptr(&gate.0), self.ptr(&up.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("glu"));
        b.arg(&a).arg(&gp).arg(&up_).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    fn activate(&self, act: Activation, x: &mut Buf, n: usize) -> Result<(), BackendError> {
        need("activate", x.0.len(), n)?;
        let (a, xp, ni) = (act_code(act), self.ptr(&x.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("activate"));
        b.arg(&a).arg(&xp).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    fn scale_cap(
        &self,
        x: &mut Buf,
        n: usize,
        s: f32,
        cap: Option<f32>,
    ) -> Result<(), BackendError> {
        need("scale_cap", x.0.len(), n)?;
        check_scale_cap(s, cap)?;
        let (xp, ni, c) = (self.ptr(&x.0), n as i32, cap.unwrap_or(0.0));
        let mut b = self.lane().launch_builder(self.func("scale_cap"));
        b.arg(&xp).arg(&ni).arg(&s).arg(&c);
        launch::run(b, launch::grid(n, 256))
    }

    fn store_row(&self, x: &Buf, c: &mut Cache, rows: usize) -> Result<(), BackendError> {
        self.launch_store_row(x, c, rows)
    }

    fn kv_fill(
        &self,
        job: LazyKv<'_, Self>,
        valid: &mut Idx,
        k: &mut Cache,
        v: &mut Cache,
    ) -> Result<(), BackendError> {
        self.launch_kv_fill(job, valid, k, v)
    }

    fn attend_rows(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        rope: Option<Rotary<'_, Buf>>,
        geom: AttnGeom,
        layer: usize,
        rows: &mut [SeqRow<'_, Self>],
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_attend_rows(q, k, v, rope, geom, layer, rows, out)
    }
    fn set_seq_rows(
        &self,
        n_heads: usize,
        rows: &[SeqRows<'_, Self>],
    ) -> Result<bool, BackendError> {
        self.write_seq_rows(n_heads, rows)
    }

    fn store(
        &self,
        k: &Buf,
        v: &Buf,
        kc: &mut Cache,
        vc: &mut Cache,
        rows: usize,
    ) -> Result<(), BackendError> {
        if kc.width != vc.width || kc.n_ctx != vc.n_ctx {
            return Err(shape("key and value caches of different shapes".into()));
        }
        self.batch_rows("store", rows)?;
        need("store keys", k.0.len(), rows * kc.width)?;
        need("store values", v.0.len(), rows * vc.width)?;
        let (kp, vp, kcp, vcp, sp) = (
            self.ptr(&k.0),
            self.ptr(&v.0),
            self.ptr(&kc.data),
            self.ptr(&vc.data),
            self.ptr(&self.step),
        );
        let (w, n) = (kc.width as i32, kc.n_ctx as i32);
        let mut b = self.lane().launch_builder(self.func("store_f16"));
        b.arg(&kp)
            .arg(&vp)
            .arg(&kcp)
            .arg(&vcp)
            .arg(&w)
            .arg(&n)
            .arg(&sp);
        launch::run(b, launch::rows(launch::grid(kc.width, 256), rows))
    }

    fn attention(
        &self,
        q: &Buf,
        k: &Cache,
        v: &Cache,
        heads: Rows<'_, Idx>,
        g: AttnGeom,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        self.launch_attention(q, k, v, heads, g, out)
    }

    fn top_k(&self, s: &Buf, n: usize, k: usize, out: &mut Idx) -> Result<(), BackendError> {
        self.launch_top_ks(&mut [TopK {
            scores: s,
            row: 0,
            n,
            k,
            out,
        }])
    }
    fn top_ks(&self, jobs: &mut [TopK<'_, Self>]) -> Result<(), BackendError> {
        self.launch_top_ks(jobs)
    }

    fn fork(&self) -> Result<(), BackendError> {
        if self.lanes {
            self.forked.record(&self.stream).map_err(dev_err)?;
            self.side.wait(&self.forked).map_err(dev_err)?;
            self.on_side.store(true, Ordering::Relaxed);
        }
        Ok(())
    }
    fn back(&self) -> Result<(), BackendError> {
        self.on_side.store(false, Ordering::Relaxed);
        Ok(())
    }
    fn join(&self) -> Result<(), BackendError> {
        self.on_side.store(false, Ordering::Relaxed);
        if self.lanes {
            self.joined.record(&self.side).map_err(dev_err)?;
            self.stream.wait(&self.joined).map_err(dev_err)?;
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), BackendError> {
        self.synchronize()
    }
    fn world(&self) -> (usize, usize) {
        self.world.as_ref().map_or((0, 1), |w| (w.rank, w.size))
    }
    fn all_reduce(&self, x: &mut Buf, n: usize) -> Result<(), BackendError> {
        self.nccl_all_reduce(x, n)
    }
    fn all_gather(&self, x: &Buf, n: usize, out: &mut Buf) -> Result<(), BackendError> {
        self.nccl_all_gather(x, n, out)
    }
    fn begin_capture(&self) -> Result<bool, BackendError> {
        if !self.graphs {
            return Ok(false);
        }
        // `DEJAVU_TP_GRAPHS=0`: a world's steps run eagerly (NCCL calls not recorded).
        if self.world.is_some() && std::env::var("DEJAVU_TP_GRAPHS").is_ok_and(|v| v == "0") {
            return Ok(false);
        }
        use sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as MODE;
        self.synchronize()?;
        self.on_side.store(false, Ordering::Relaxed);
        self.stream.begin_capture(MODE).map_err(dev_err)?;
        Ok(true)
    }
    fn end_capture(&self) -> Result<Graph, BackendError> {
        let g = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(dev_err)?
            .ok_or_else(|| BackendError::Device("an empty graph was captured".into()))?;
        Ok(Graph(g))
    }
    fn replay(&self, g: &Graph) -> Result<(), BackendError> {
        g.0.launch().map_err(dev_err)
    }
}
