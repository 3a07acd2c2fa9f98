//! Opening a GPU (the driver, NVRTC, the kernels compiled for its compute capability, the
//! tuning constants), and the device's own helpers: its lanes, kernels by name, shared memory
//! opt-ins, buffer addresses and index lists.
use crate::compile::{self, ax_vec, axb_rows, compile, mv_rows, tuning};
use crate::{
    dev_err, launch, mma, need_driver, products, seqs, shape, type_suffix, Buf, CudaDevice, Idx,
};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, PushKernelArg,
};
use dejavu_backend_api::{BackendError, QuantType, Rows, MAX_ROWS};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

impl CudaDevice {
    /// `y[at_y..at_y + n] = x[at_x..at_x + n]` on the lane (the caller checked both extents).
    pub(crate) fn copy_values(
        &self,
        x: &Buf,
        at_x: usize,
        y: &mut Buf,
        at_y: usize,
        n: usize,
    ) -> Result<(), BackendError> {
        if n == 0 {
            return Ok(());
        }
        let xp = self.ptr(&x.0) + (at_x * 4) as u64;
        let (yp, ni) = (self.ptr(&y.0) + (at_y * 4) as u64, n as i32);
        let mut b = self.lane().launch_builder(self.func("copy_f32"));
        b.arg(&xp).arg(&yp).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    /// GPU `ordinal`: loads the driver and NVRTC, compiles the kernels for its compute capability.
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        need_driver()?;
        compile::need_nvrtc()?;
        let ctx = CudaContext::new(ordinal).map_err(dev_err)?;
        // SAFETY: this device orders its launches itself: one main stream, and a second lane
        // whose work is ordered against the main one only by `fork`/`join` events, whose callers
        // keep to the contract of `Device::fork` (the second lane reads what was written before
        // the fork; the main lane reads its writes after the join); `synchronize` waits for
        // both. cudarc's per-buffer events (which graph capture cannot record) are not needed.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(dev_err)?;
        let ptx = compile(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(ptx).map_err(dev_err)?;
        let mut names: Vec<String> = [
            "rmsnorm",
            "layernorm",
            "rope",
            "glu",
            "activate",
            "scale_cap",
            "copy_f32",
            "add_f32",
            "scatter_f32",
            "gather_f32",
            "abs_f32",
            "clear_f32",
            "matvec_f16_ahead",
            "matvec_bf16_ahead",
            "sparsify_f32",
            "count_nonzero_f32",
            "group_norms",
            "store_f16",
            "attention_f16",
            "attention_rows_f16",
            "attention_split_f16",
            "attention_merge",
            "attention_rows_split_f16",
            "attention_rows_merge",
            "store_rows_f16",
            "kv_mark",
            "store_row_f16",
            "top_k_hist",
            "top_k_select",
        ]
        .map(String::from)
        .to_vec();
        for q in [QuantType::F16, QuantType::BF16] {
            names.push(format!("mma_split_{}", type_suffix(q)));
            for nt in mma::MMA_TILES {
                names.push(format!("matvec_mma{nt}_{}", type_suffix(q)));
                names.push(format!("matvec_hmma{nt}_{}", type_suffix(q)));
            }
        }
        for q in QuantType::ALL {
            for op in [
                "matvec",
                "matvec_rows",
                "matmul",
                "matmul_small",
                "axpy",
                "axpy_rows",
                "embed",
                "kv_fill",
            ] {
                names.push(format!("{op}_{}", type_suffix(q)));
            }
        }
        let funcs = names
            .into_iter()
            .map(|n| Ok((n.clone(), module.load_function(&n).map_err(dev_err)?)))
            .collect::<Result<HashMap<_, _>, BackendError>>()?;
        // A stream of its own: the legacy default stream cannot be captured.
        let stream = ctx.new_stream().map_err(dev_err)?;
        let side = ctx.new_stream().map_err(dev_err)?;
        let (forked, joined) = (
            ctx.new_event(None).map_err(dev_err)?,
            ctx.new_event(None).map_err(dev_err)?,
        );
        let step = stream
            .alloc_zeros::<i32>(1 + 2 * MAX_ROWS)
            .map_err(dev_err)?;
        let slots = 1 + seqs::SEQ_LAYERS;
        let seq_tab = (stream.alloc_zeros::<u64>(seqs::SEQ_SLOT * slots)).map_err(dev_err)?;
        let tk_scratch = (stream.alloc_zeros::<u32>(3 * products::TK_SCRATCH)).map_err(dev_err)?;
        let mma_scratch = match major >= 8 {
            true => Some([
                mma::MmaScratch::new(&stream)?,
                mma::MmaScratch::new(&stream)?,
            ]),
            false => None,
        };
        let n_sm = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err)? as usize;
        let name = ctx.name().map_err(dev_err)?;
        let att_part = stream.alloc_zeros::<f32>(crate::attention::ATT_PART * n_sm);
        let att_part = att_part.map_err(dev_err)?;
        Ok(Self {
            stream,
            side,
            forked,
            joined,
            on_side: AtomicBool::new(false),
            lanes: tuning("SIDE", 1, 0..=1) == 1,
            _module: module,
            funcs,
            step,
            seq_tab,
            seq_set: Mutex::default(),
            batch: AtomicUsize::new(1),
            tk_scratch,
            n_sm,
            mv_rows: mv_rows(),
            mv_fill: tuning("MV_FILL", 2, 1..=64),
            mv_fill_sel: tuning("MV_FILL_SEL", 8, 1..=64),
            mvr_fill: tuning("MVR_FILL", 2, 1..=64),
            mv_ahead_f16: tuning("MV_AHEAD_F16", 0, 0..=1) == 1,
            attend_rows: tuning("ATTEND_ROWS", 1, 0..=1) == 1,
            mma_arch: major >= 8,
            mma: major >= 8 && tuning("MMA", 1, 0..=1) == 1,
            mma_h: tuning("MMA_H", 1, 0..=1) == 1,
            mma_scratch,
            hmma_fill: tuning("HMMA_FILL", 6, 1..=64),
            split_cols: split_cols(tuning("SPLIT_COLS", 1024, 0..=32768)),
            mma_prompt: tuning("MMA_PROMPT", 0, 0..=1) == 1,
            graphs: tuning("GRAPHS", 1, 0..=1) == 1,
            seq_graphs: tuning("SEQ_GRAPHS", 1, 0..=1) == 1,
            att_span: tuning("ATT_SPAN", 512, 0..=65536),
            att_part,
            ax_vec: ax_vec(),
            ax_fill: tuning("AX_FILL", 4, 1..=64),
            axb_rows: axb_rows(),
            axb_fill: tuning("AXB_FILL", 4, 1..=64),
            name,
            smem: Mutex::default(),
            world: None,
            deterministic: false,
        })
    }

    /// Run a step of several sequences' attention block in one call (`Device::attend_rows`, the
    /// default), or row by row (`ATTEND_ROWS=0` in `DEJAVU_CUDA_DEFINES` sets it too).
    pub fn set_attend_rows(&mut self, on: bool) {
        self.attend_rows = on;
    }

    /// `--deterministic`: every verb gives each row bit for bit what it gives that row alone,
    /// whatever the rows beside it (`Device::batch_invariant`). Products of any number of rows
    /// take one kernel each ([`Self::launch_invariant`]); attention takes one block a row's head
    /// over all its positions (no spans). Costs: a one-row step through the batch kernels, and a
    /// prompt's products in chunks of 32 (16-bit weights) or 8 rows instead of tiles.
    pub fn set_deterministic(&mut self, on: bool) {
        self.deterministic = on;
    }

    /// Run a few batch rows' products of 16-bit weights on the tensor cores (`MMA=1` in
    /// `DEJAVU_CUDA_DEFINES` sets it too); ignored below compute capability 8.0.
    pub fn set_mma(&mut self, on: bool) {
        self.mma = on && self.mma_arch;
    }

    /// Split the tensor-core products' inputs into 16-bit parts (`MMA_H=1`, the default) or
    /// take tf32 with the inputs split in registers (see `mma`).
    pub fn set_mma_h(&mut self, on: bool) {
        self.mma_h = on;
    }

    /// The inputs' split of the tensor-core products by blocks of `cols` columns (a multiple
    /// of 256; `mma_split_T`; 1024 by default), or a block per row (0; as `SPLIT_COLS`).
    pub fn set_split_cols(&mut self, cols: usize) {
        self.split_cols = split_cols(cols);
    }

    /// Record steps of several sequences (`Device::set_seq_rows` writes their rows; as
    /// `SEQ_GRAPHS`).
    pub fn set_seq_graphs(&mut self, on: bool) {
        self.seq_graphs = on;
    }

    /// Split a step of several sequences' attention into spans of about `positions` (0: one
    /// block a row's head; as `ATT_SPAN`).
    pub fn set_att_span(&mut self, positions: usize) {
        self.att_span = positions;
    }

    /// Wait until every queued launch has run.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.side.synchronize().map_err(dev_err)?;
        self.stream.synchronize().map_err(dev_err)
    }

    /// `rows` is 1 up to the rows of the batch set (the step buffer holds their tokens).
    pub(crate) fn batch_rows(&self, what: &str, rows: usize) -> Result<(), BackendError> {
        let have = self.batch.load(Ordering::Relaxed);
        match rows > 0 && rows <= have {
            true => Ok(()),
            false => Err(shape(format!("{what} of {rows} rows in a batch of {have}"))),
        }
    }

    /// The stream that verbs go to now (see `Device::fork`).
    pub(crate) fn lane(&self) -> &Arc<CudaStream> {
        match self.on_side.load(Ordering::Relaxed) {
            true => &self.side,
            false => &self.stream,
        }
    }

    /// 0 for the main lane, 1 for the second (`Device::fork`): the lane's scratch.
    pub(crate) fn lane_index(&self) -> usize {
        self.on_side.load(Ordering::Relaxed) as usize
    }

    pub(crate) fn func(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// Let kernel `name` use `bytes` of dynamic shared memory (an error past the device's limit).
    pub(crate) fn allow_smem(&self, name: &'static str, bytes: usize) -> Result<(), BackendError> {
        use sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
        let mut allowed = self.smem.lock().expect("smem lock");
        // The opt-in covers static plus dynamic memory past 48 KiB: always set it.
        let have = allowed.get(name).copied().unwrap_or(0);
        if bytes > have {
            (self.func(name).set_attribute(MAX, bytes as i32)).map_err(|e| {
                shape(format!(
                    "{name} needs {bytes} bytes of shared memory: {e:?}"
                ))
            })?;
            allowed.insert(name, bytes);
        }
        Ok(())
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// The index list's address, count, group and outputs of `rows` over a matrix of `n` rows;
    /// checks the list holds `count` entries.
    pub(crate) fn sel(
        &self,
        rows: Rows<'_, Idx>,
        n: usize,
    ) -> Result<(u64, i32, i32, usize), BackendError> {
        match rows {
            Rows::All => Ok((0, n as i32, 1, n)),
            Rows::Sel { idx, count, group } => {
                if idx.0.len() < count || group == 0 || count * group > n {
                    return Err(shape(format!(
                        "selection of {count} x {group} over {n} rows (list of {})",
                        idx.0.len()
                    )));
                }
                Ok((
                    self.ptr(&idx.0),
                    (count * group) as i32,
                    group as i32,
                    count * group,
                ))
            }
        }
    }
}

/// `cols` columns per block of the inputs' split where it is a multiple of 256 up to 32768,
/// else 0 (a block per row).
fn split_cols(cols: usize) -> usize {
    match cols.is_multiple_of(256) && cols <= 32768 {
        true => cols,
        false => 0,
    }
}
