//! The allreduce entry points.
//!
//! Every entry takes one [`LaunchArgs`] by value. Names follow
//! `allreduce_{one_stage|two_stage|push|push_ll|push_two_stage|push_islands}_{f32|f16|bf16}_w{N}[_virtual]`; the
//! host's entry table builds the same names from the same parts.
//!
//! Launch contract (checked by the host, and by the kernel where a wrong
//! value would corrupt memory): `gridDim.x <= MAX_BLOCKS` blocks per rank,
//! `blockDim.x >= N`, the same grid on every rank of a collective, and for
//! `_virtual` entries `gridDim.y == N` with all blocks co-resident. A push
//! kernel reads its own input at `own_inputs[rank]` where that is not 0
//! (the host sets it for push_ll only), else at the table's entry.
//!
//! Files: this one and the files it includes hold what every algorithm
//! shares: `kernels/error_records.rs` the flags and the error record,
//! `kernels/block_barrier.rs` the block barriers and the epochs,
//! `kernels/loops.rs` the element and pack loops,
//! `kernels/push_start.rs` the push kernels' common start. Submodules:
//! `pull.rs` the one-stage and two-stage entries, which read peers'
//! buffers; `push.rs` the push entries, which write into peers' landing
//! zones; `push_ll.rs` the push entries whose data carries its own arrival
//! signal; `push_two_stage.rs` reduce-scatter and all-gather by writes
//! into landing zones; `push_islands.rs` the same over two islands of
//! ranks, with f32 partials crossing between them; `norm.rs` (and
//! `norm/`) the fused allreduce + residual add + RMSNorm
//! (`allreduce_rmsnorm_*`).
//!
//! The shared files are `include!`d, not submodules, so their items keep
//! this module's path and their symbol names: rustc hands a crate's
//! functions to LLVM sorted by symbol name, which holds the module path,
//! and LLVM's inlining follows that order, so the same code in submodules
//! compiles to other PTX. As included files, the PTX is byte-identical to
//! the one file it was. The same holds for `norm.rs` and `norm/`.
//!
//! Which barriers run, and with which memory order, comes from the protocol
//! table in [`crate::barrier`] ([`barriers`](crate::barrier::barriers),
//! [`order`]); the kernels only place the barrier sites.

use crate::abi::{
    error_code, flag_word, ll_highs, tag_of, Algorithm, BarrierKind, ErrorRecord, LaunchArgs,
    RankTable, Signal, MAX_BLOCKS, MAX_RANKS,
};
use crate::barrier::{arrive_ordered, next_epoch, order, runs, wait_ordered, Order, Wait};
use crate::cuda::*;
use crate::numeric::{Bf16, Element, Pack, F16, F32};
use crate::reduce::{partition, reduce_pack, split};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::AtomicU64;

include!("kernels/error_records.rs");
include!("kernels/block_barrier.rs");
include!("kernels/loops.rs");
include!("kernels/push_start.rs");

/// The real-rank and virtual-rank entries of a push-family kernel `$f`,
/// one pair per (element type, world) line.
macro_rules! push_entries {
    ($f:ident; $( $name:ident, $vname:ident: $E:ty, $N:literal; )*) => { $(
        /// A real-rank entry: this rank is `a.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `a` filled as the kernel function requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { $f::<$E, $N>(&a, a.rank) }
        }
        /// A virtual-rank entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(a: LaunchArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { $f::<$E, $N>(&a, block_idx_y()) }
        }
    )* };
}

mod norm;
mod pull;
mod push;
mod push_islands;
mod push_ll;
mod push_two_stage;
