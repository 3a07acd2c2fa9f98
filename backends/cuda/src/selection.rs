//! The verbs of selections and input sparsity (elementwise.cu): `Device::sparsify` (the kept
//! inputs of a TEAL or WINA rule, compared with the threshold on the device, so a recorded step
//! replays it with no host round trip), `scatter`, `gather`, `abs`, `count_nonzero` and
//! `group_norms`.
use crate::{launch, need, shape, Buf, CudaDevice, Idx};
use cudarc::driver::PushKernelArg;
use dejavu_backend_api::{BackendError, InputMask};

impl CudaDevice {
    pub(crate) fn launch_sparsify(
        &self,
        x: &Buf,
        n: usize,
        mask: InputMask<'_, Buf>,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        need("sparsify input", x.0.len(), n)?;
        need("sparsify output", out.0.len(), n)?;
        if let Some(s) = mask.scale {
            need("sparsify scales", s.0.len(), n)?;
        }
        let (xp, op) = (self.ptr(&x.0), self.ptr(&out.0));
        let sp = mask.scale.map_or(0, |s| self.ptr(&s.0));
        let (ni, t) = (n as i32, mask.threshold);
        let mut b = self.lane().launch_builder(self.func("sparsify_f32"));
        b.arg(&xp).arg(&ni).arg(&t).arg(&sp).arg(&op);
        launch::run(b, launch::grid(n, 256))
    }

    pub(crate) fn launch_scatter(
        &self,
        src: &Buf,
        idx: &Idx,
        count: usize,
        group: usize,
        dst: &mut Buf,
    ) -> Result<(), BackendError> {
        let n = count * group;
        if group == 0 {
            return Err(shape("a scatter of groups of 0".into()));
        }
        need("scatter input", src.0.len(), n)?;
        need("scatter indices", idx.0.len(), count)?;
        if dst.0.len() > i32::MAX as usize || n > i32::MAX as usize {
            return Err(shape(format!("scatter of {n} into {} values", dst.0.len())));
        }
        let (sp, ip, dp) = (self.ptr(&src.0), self.ptr(&idx.0), self.ptr(&dst.0));
        let (ni, gi, len) = (n as i32, group as i32, dst.0.len() as i32);
        let mut b = self.lane().launch_builder(self.func("scatter_f32"));
        b.arg(&sp).arg(&ip).arg(&ni).arg(&gi).arg(&dp).arg(&len);
        launch::run(b, launch::grid(n, 256))
    }

    pub(crate) fn launch_gather(
        &self,
        src: &Buf,
        idx: &Idx,
        count: usize,
        group: usize,
        dst: &mut Buf,
    ) -> Result<(), BackendError> {
        let n = count * group;
        need("gather indices", idx.0.len(), count)?;
        need("gather output", dst.0.len(), n)?;
        if src.0.len() > i32::MAX as usize || n > i32::MAX as usize || group == 0 {
            return Err(shape(format!("gather of {count} groups of {group}")));
        }
        let (sp, ip, dp) = (self.ptr(&src.0), self.ptr(&idx.0), self.ptr(&dst.0));
        let (ci, gi, len) = (count as i32, group as i32, src.0.len() as i32);
        let mut b = self.lane().launch_builder(self.func("gather_f32"));
        b.arg(&sp).arg(&ip).arg(&ci).arg(&gi).arg(&dp).arg(&len);
        launch::run(b, launch::grid(n, 256))
    }

    pub(crate) fn launch_abs(&self, x: &mut Buf, n: usize) -> Result<(), BackendError> {
        need("abs", x.0.len(), n)?;
        let (xp, ni) = (self.ptr(&x.0), n as i32);
        let mut b = self.lane().launch_builder(self.func("abs_f32"));
        b.arg(&xp).arg(&ni);
        launch::run(b, launch::grid(n, 256))
    }

    pub(crate) fn launch_count_nonzero(
        &self,
        x: &Buf,
        n: usize,
        group: usize,
        out: &mut Buf,
        slot: usize,
    ) -> Result<(), BackendError> {
        need("count_nonzero input", x.0.len(), n)?;
        need("count_nonzero output", out.0.len(), slot + 1)?;
        if group == 0 || group > i32::MAX as usize {
            return Err(shape(format!(
                "count_nonzero: groups of {group} of {n} values"
            )));
        }
        let (xp, ni, op, si) = (self.ptr(&x.0), n as i32, self.ptr(&out.0), slot as i32);
        let gi = group as i32;
        let mut b = self.lane().launch_builder(self.func("count_nonzero_f32"));
        b.arg(&xp).arg(&ni).arg(&gi).arg(&op).arg(&si);
        launch::run(b, launch::one_block(1024))
    }

    pub(crate) fn launch_group_norms(
        &self,
        x: &Buf,
        groups: usize,
        width: usize,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        need("group_norms input", x.0.len(), groups * width)?;
        need("group_norms output", out.0.len(), groups)?;
        if groups == 0 {
            return Ok(());
        }
        let (xp, op, wi) = (self.ptr(&x.0), self.ptr(&out.0), width as i32);
        let mut b = self.lane().launch_builder(self.func("group_norms"));
        b.arg(&xp).arg(&wi).arg(&op);
        launch::run(b, launch::blocks(launch::grid(32, 32), groups))
    }
}
