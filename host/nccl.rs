//! NCCL through cudarc (cargo feature `nccl`): the comparison baseline of the
//! benchmarks and an opt-in fallback for [`crate::PeerGroup`].
//!
//! NCCL sums in its own order, so its results are *not* covered by the
//! determinism contract: it is used only when asked (`AlgoChoice::Nccl`) or
//! when `Config::nccl_above` sets a size above which `Auto` may hand over.
//! libnccl is loaded at run time; cudarc looks for `libnccl.so` (or
//! `libnccl.so.1`, `.9`..`.12`) on the library path. The PyPI wheels ship
//! `libnccl.so.2`: link it as `libnccl.so` in a directory on `LD_LIBRARY_PATH`.

use crate::error::{Error, Result};
use crate::group::DeviceElement;
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{result as nccl_result, Comm, NcclType, ReduceOp};
use std::sync::Arc;

/// Whether libnccl can be loaded (cudarc panics on first use without it).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// One NCCL communicator per rank, all driven from this process.
pub struct NcclGroup {
    comms: Vec<Comm>,
}

fn nccl_err(during: &'static str) -> impl Fn(nccl_result::NcclError) -> Error {
    move |e| Error::Nccl(format!("{during}: {e:?}"))
}

impl NcclGroup {
    /// `streams[r]` is rank r's stream; each must be on a distinct GPU (NCCL
    /// refuses two ranks on one device).
    pub fn new(streams: &[Arc<CudaStream>]) -> Result<Self> {
        if !crate::driver::driver_present() {
            return Err(Error::NoDriver);
        }
        if !nccl_present() {
            return Err(Error::Nccl(
                "libnccl could not be loaded: install NCCL (e.g. the nvidia-nccl-cu12/13 wheel) and put a \
                 directory holding libnccl.so on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let comms = Comm::from_devices(streams.to_vec()).map_err(nccl_err("ncclCommInitAll"))?;
        Ok(NcclGroup { comms })
    }

    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// Sum-allreduce of `inputs[r]` into `outputs[r]` on every rank's stream.
    pub fn allreduce<T: DeviceElement + NcclType>(
        &self,
        inputs: &[&CudaSlice<T>],
        outputs: &mut [CudaSlice<T>],
    ) -> Result<()> {
        if inputs.len() != self.world() || outputs.len() != self.world() {
            return Err(Error::RankCount {
                what: "inputs/outputs",
                got: inputs.len().min(outputs.len()),
                world: self.world(),
            });
        }
        nccl_result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let mut first_err = None;
        for ((comm, input), output) in self.comms.iter().zip(inputs).zip(outputs.iter_mut()) {
            if output.len() < input.len() {
                first_err.get_or_insert(Error::BufferTooSmall {
                    what: "output",
                    rank: comm.rank(),
                    len: output.len(),
                    need: input.len(),
                });
                continue;
            }
            if let Err(e) = comm.all_reduce(*input, output, &ReduceOp::Sum) {
                first_err.get_or_insert(nccl_err("ncclAllReduce")(e));
            }
        }
        // The group must be closed even after an error.
        nccl_result::group_end().map_err(nccl_err("ncclGroupEnd"))?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
