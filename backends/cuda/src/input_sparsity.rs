//! `Device::sparsify` (elementwise.cu's `sparsify_f32`): the kept inputs of a TEAL or WINA
//! rule, compared with the threshold on the device (a recorded step replays it with no host
//! round trip).
use crate::{launch, need, Buf, CudaDevice};
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
}
