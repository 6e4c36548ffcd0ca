//! What an engine on candle's cudarc writes against p2p-allreduce: its own
//! `cudarc` types (candle-core's version and features) handed straight to
//! `p2p_allreduce::comm::Comm`, the NCCL-shaped communicator, and the id
//! shared through a file as mistral.rs shares its NCCL id.
//!
//! CI builds this crate two ways (see .ci/run): with no linking feature
//! (cudarc's `dynamic-loading`, through p2p-allreduce's
//! `fallback-dynamic-loading`: the tests run) and with `dynamic-linking`
//! (candle-core's mode), which needs libcuda (and, with candle's features,
//! cuBLAS, cuRAND and NVRTC) at link time: without the CUDA toolkit CI
//! type-checks the library and the tests and links nothing. The
//! `static-linking` feature is for a machine with the toolkit: cudarc
//! bundles its static archives (libcudart_static.a, libstdc++.a, ...) into
//! its rlib, so even `cargo check` needs them.

use cudarc::driver::{CudaSlice, CudaStream};
use p2p_allreduce::comm::{Comm, Id, ReduceOp};
use p2p_allreduce::peer_group::Route;
use std::path::Path;
use std::sync::Arc;

/// The communicator is built from the engine's own cudarc stream: one
/// cudarc in the build, whatever its features.
pub fn comm_for_rank(
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    id: Id,
) -> p2p_allreduce::Result<Comm> {
    Comm::from_rank(stream, rank, world, id)
}

/// The call mistral.rs's `SumAllReduce` makes, on the engine's own slice
/// type.
pub fn sum_in_place(comm: &Comm, x: &mut CudaSlice<half::bf16>) -> p2p_allreduce::Result<Route> {
    comm.all_reduce_in_place(x, &ReduceOp::Sum)
}

/// Rank 0 writes the id's bytes to `path` (atomically: a temporary file,
/// then a rename), as mistral.rs writes its NCCL id.
pub fn write_id(id: &Id, path: &Path) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, id.to_bytes())?;
    std::fs::rename(tmp, path)
}

/// The other ranks read it back.
pub fn read_id(path: &Path) -> std::io::Result<Id> {
    let bytes = std::fs::read(path)?;
    let bytes: [u8; 128] = bytes.try_into().map_err(|b: Vec<u8>| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} holds {} bytes, not an id's 128",
                path.display(),
                b.len()
            ),
        )
    })?;
    Ok(Id::from_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's cudarc and p2p-allreduce's are one crate (the types
    /// are the same types).
    #[test]
    fn one_cudarc_in_the_build() {
        fn same(
            s: Option<Arc<cudarc::driver::CudaStream>>,
        ) -> Option<Arc<p2p_allreduce::cudarc::driver::CudaStream>> {
            s
        }
        assert!(same(None).is_none());
    }

    #[test]
    fn the_id_travels_through_a_file() {
        let id = Id::new().expect("a fresh rendezvous directory");
        let dir = id.dir().expect("an id of this crate");
        let file = dir.join("id");
        write_id(&id, &file).unwrap();
        let back = read_id(&file).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.dir().unwrap(), dir);
        std::fs::write(&file, [1u8; 7]).unwrap();
        assert!(read_id(&file).is_err(), "a truncated file is refused");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Without libcuda the library says so (typed) under every linking
    /// mode, instead of cudarc's panic.
    #[test]
    fn no_driver_is_a_typed_error_here() {
        if p2p_allreduce::driver::driver_present() {
            println!("SKIPPED (a CUDA driver is present)");
            return;
        }
        assert!(matches!(
            p2p_allreduce::driver::device_count(),
            Err(p2p_allreduce::Error::NoDriver)
        ));
        assert!(matches!(
            p2p_allreduce::driver::open_device(0),
            Err(p2p_allreduce::Error::NoDriver)
        ));
    }

    /// The kernel-provider half needs no driver at all.
    #[test]
    fn the_ptx_is_there() {
        let m = p2p_allreduce::ptx::module_for((9, 0)).expect("PTX for sm_90");
        assert!(m.ptx().contains(".entry"));
    }
}
