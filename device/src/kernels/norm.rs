//! Fused allreduce + residual add + RMSNorm (`allreduce_rmsnorm_*`): the
//! one-stage and two-stage pull algorithms and push_ll (flag-in-data
//! lines, no barrier), by whole rows, with the exact operation order of
//! docs/numerics.md.
//!
//! Files, in the order a row flows: `norm/sums.rs` where a row's rounded
//! sums come from ([`RowSums`]) and the pull sources, `norm/ll_sums.rs`
//! the push_ll source; `norm/row.rs` the per-pack arithmetic and the row
//! by any shape (two-pass), `norm/reg_rows.rs` the register path (and its
//! split over a cluster), `norm/block_rows.rs` a block's loop over its
//! rows, `norm/tree.rs` the pairwise tree of the sum of squares;
//! `norm/pull_kernel.rs` and `norm/ll_kernel.rs` the kernel bodies,
//! `norm/entries.rs` the entries.
//!
//! The files are `include!`d, in this order, not submodules: their items
//! stay in this module, under the same symbol names. rustc hands a
//! crate's functions to LLVM sorted by symbol name, which holds the module
//! path, and LLVM's inlining follows that order: in submodules the same
//! code compiles to other PTX (registers numbered differently). As
//! included files, the PTX is byte-identical to the one file it was.

use super::*;
use crate::abi::{NormArgs, NORM_CHUNK, NORM_MAX_HIDDEN};
use crate::ll::{Lines, PackSlot};
use crate::norm_tree::{combine_quarters, warp_adds, QUARTERS, WARP};

include!("norm/sums.rs");
include!("norm/ll_sums.rs");
include!("norm/row.rs");
include!("norm/reg_rows.rs");
include!("norm/block_rows.rs");
include!("norm/tree.rs");
include!("norm/pull_kernel.rs");
include!("norm/ll_kernel.rs");
include!("norm/entries.rs");
