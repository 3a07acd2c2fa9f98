//! The collectives of a tensor-parallel world on GPUs, through NCCL (cudarc's `nccl` module,
//! loaded at run time): one communicator per [`CudaDevice`], its collectives enqueued on the
//! device's main stream, in order with the kernels (and recorded with them in a CUDA graph).
//!
//! NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless they look like separate
//! hosts: processes given distinct `NCCL_HOSTID`s then talk over NCCL's socket transport. That is
//! how the world of two ranks is tested on a machine of one GPU (`tests/device.rs`); it is a
//! test setup, not a way to run.
use super::{dev_err, need, shape, Buf, CudaDevice};
use cudarc::nccl::{Comm, Id, ReduceOp};
use dejavu_backend_api::BackendError;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Bytes of an NCCL unique id (what rank 0 makes and every rank joins with).
pub const ID_BYTES: usize = 128;

/// A communicator, used by one thread at a time.
pub(crate) struct Nccl {
    comm: Mutex<SendComm>,
    pub(crate) rank: usize,
    pub(crate) size: usize,
}

struct SendComm(Comm);
// SAFETY: an NCCL communicator is a handle that any thread may use, provided no two use it at
// once (NCCL's rule); the mutex around it keeps to that, and its stream is the device's.
unsafe impl Send for SendComm {}

fn nccl_present() -> Result<(), BackendError> {
    // SAFETY: only tries to open the library (dlopen), and closes it again.
    match unsafe { cudarc::nccl::sys::is_culib_present() } {
        true => Ok(()),
        false => Err(BackendError::Device(
            "NCCL (libnccl.so) was not found: tensor parallelism needs it on the library path"
                .into(),
        )),
    }
}

/// A new unique id for a world, made by its rank 0 and handed to every rank.
pub fn nccl_id() -> Result<[u8; ID_BYTES], BackendError> {
    nccl_present()?;
    let id = Id::new().map_err(dev_err)?;
    Ok(id.internal().map(|c| c as u8))
}

impl CudaDevice {
    /// GPU `ordinal` as rank `rank` of a world of `size` ranks, joined through `id` (from
    /// [`nccl_id`]). Returns once every rank has joined.
    pub fn in_world(
        ordinal: usize,
        rank: usize,
        size: usize,
        id: &[u8; ID_BYTES],
    ) -> Result<Self, BackendError> {
        if rank >= size {
            return Err(shape(format!("rank {rank} of a world of {size}")));
        }
        nccl_present()?;
        let mut dev = Self::new(ordinal)?;
        dev.stream.context().bind_to_thread().map_err(dev_err)?;
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(dev.stream.clone(), rank, size, id).map_err(dev_err)?;
        dev.world = Some(Nccl {
            comm: Mutex::new(SendComm(comm)),
            rank,
            size,
        });
        Ok(dev)
    }

    /// The communicator, for a collective on the main lane.
    fn comm(
        &self,
        what: &str,
    ) -> Result<Option<std::sync::MutexGuard<'_, SendComm>>, BackendError> {
        let Some(w) = &self.world else {
            return Ok(None);
        };
        if self.on_side.load(Ordering::Relaxed) {
            return Err(shape(format!("{what} on the second lane")));
        }
        let guard = w
            .comm
            .lock()
            .map_err(|_| dev_err("a poisoned communicator"))?;
        Ok(Some(guard))
    }

    pub(crate) fn nccl_all_reduce(&self, x: &mut Buf, n: usize) -> Result<(), BackendError> {
        need("all-reduce buffer", x.0.len(), n)?;
        if let Some(c) = self.comm("an all-reduce")? {
            let mut view = x.0.slice_mut(0..n);
            c.0.all_reduce_in_place(&mut view, &ReduceOp::Sum)
                .map_err(dev_err)?;
        }
        Ok(())
    }

    pub(crate) fn nccl_all_gather(
        &self,
        x: &Buf,
        n: usize,
        out: &mut Buf,
    ) -> Result<(), BackendError> {
        need("all-gather input", x.0.len(), n)?;
        let size = self.world.as_ref().map_or(1, |w| w.size);
        need("all-gather output", out.0.len(), n * size)?;
        match self.comm("an all-gather")? {
            Some(c) => {
                let mut view = out.0.slice_mut(0..n * size);
                c.0.all_gather(&x.0.slice(0..n), &mut view)
                    .map_err(dev_err)?;
                Ok(())
            }
            None => dejavu_backend_api::Device::copy(self, x, out, n),
        }
    }
}
