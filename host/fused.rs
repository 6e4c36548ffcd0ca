//! The fused allreduce + residual add + RMSNorm: its plan (algorithm, row
//! chunks, blocks) and its launches, for every group kind. Numerics in
//! docs/numerics.md; the CPU oracle is `reference::add_rmsnorm_bits`.
//!
//! This file holds the plan ([`NormPlan`], [`split_ctas`]); `buffers`
//! the call's pointers, shape and buffers; `launch` the launches on a
//! `Collective`; `tests` the unit tests.

use crate::abi::{
    norm_reg_path, norm_reg_slots, norm_split_range, Algorithm, Dtype, NORM_CHUNK, NORM_MAX_CTAS,
    NORM_MAX_HIDDEN,
};
use crate::error::{Error, Result};
use crate::plan::{AlgoChoice, Config, Inputs, Link};

mod buffers;
mod launch;
#[cfg(test)]
mod tests;

pub(crate) use buffers::{norm_shape, NormBuffers, NormInputs, NormPtrs};

/// The plan of one fused call: one algorithm for the whole call, the rows
/// of each launch, and the blocks per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormPlan {
    pub algorithm: Algorithm,
    pub rows: usize,
    pub hidden: usize,
    /// Rows per launch (all of them if they fit the staging buffers).
    pub rows_per_step: usize,
    /// Blocks per rank: `ctas` per row at a time (each block, or each
    /// cluster of `ctas` blocks, takes whole rows).
    pub blocks: u32,
    /// CTAs of the thread-block cluster that splits each row (fused
    /// push_ll on sm_90 and newer, [`split_ctas`]); 1: a block per row, no
    /// cluster.
    pub ctas: u32,
    /// Threads per block: on the register path
    /// ([`crate::abi::norm_reg_path`]) just enough warps for the row's
    /// chunks (fewer warps issue fewer instructions), else
    /// `Config::threads_per_block`.
    pub threads: u32,
}

impl NormPlan {
    /// The plan of `rows x hidden` elements of `dtype` per rank, or the
    /// error that refuses it: `hidden` 0 with rows, or above
    /// [`NORM_MAX_HIDDEN`] (`NormShape`); push, push_two_stage or
    /// push_islands (`NormAlgorithm`); staged, a row that does not fit the
    /// staging buffers (or, push_ll, its landing zone: `MessageTooLarge`),
    /// or rows that need chunks with chunking off; zero-copy (one launch,
    /// no chunks), two-stage rows that do not fit the scratch
    /// (`ScratchTooSmall`), push_ll rows that do not fit its landing zone
    /// (`ZoneTooSmall`); push_ll rows off the register path
    /// (`NormPushLlShape`: the fused push_ll kernel has no other path).
    /// `Auto` never refuses for room: zero-copy rows that do not fit the
    /// scratch run one-stage where the table says two-stage (the same bits).
    /// `Auto` runs push_ll where the allreduce of the same bytes would (and
    /// for one rank, where no allreduce runs: push_ll then sends and waits
    /// for nothing), the rows fit its zone and take the register path, else
    /// one-stage or two-stage as the allreduce would. `max_ctas`: the most CTAs over
    /// which push_ll may split a row ([`split_ctas`]): [`NORM_MAX_CTAS`]
    /// where every device of the group runs thread-block clusters (sm_90
    /// and newer), 1 where not (or where fewer must do: co-residency).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &Config,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        world: usize,
        link: Link,
        choice: AlgoChoice,
        inputs: Inputs,
        max_ctas: u32,
    ) -> Result<NormPlan> {
        if hidden == 0 && rows > 0 {
            return Err(Error::NormShape(format!(
                "{rows} rows of hidden size 0: give hidden >= 1"
            )));
        }
        if hidden > NORM_MAX_HIDDEN {
            return Err(Error::NormShape(format!(
                "hidden size {hidden} is above the fused kernels' {NORM_MAX_HIDDEN}: use allreduce and a separate RMSNorm"
            )));
        }
        let row_bytes = hidden.max(1) * dtype.size();
        let total = rows * row_bytes;
        let ll_zone = config.push_ll_max_bytes;
        let max_threads = config.threads_per_block;
        let reg_path = norm_reg_path(dtype.lanes(), hidden as u64, max_threads as u64);
        // Elements one thread holds on the register path.
        let per_thread = NORM_CHUNK * norm_reg_slots(dtype.lanes());
        let mut algorithm = match choice {
            AlgoChoice::Auto => match config.choose(AlgoChoice::Auto, total, world, link) {
                _ if world <= 1 && total <= ll_zone && reg_path => Algorithm::PushLl,
                Algorithm::TwoStage => Algorithm::TwoStage,
                Algorithm::PushLl if total <= ll_zone && reg_path => Algorithm::PushLl,
                _ => Algorithm::OneStage,
            },
            AlgoChoice::OneStage => Algorithm::OneStage,
            AlgoChoice::TwoStage => Algorithm::TwoStage,
            AlgoChoice::PushLl if reg_path => Algorithm::PushLl,
            AlgoChoice::PushLl => {
                return Err(Error::NormPushLlShape {
                    dtype,
                    hidden,
                    max_hidden: per_thread * max_threads as usize,
                    threads: max_threads,
                })
            }
            other => {
                return Err(Error::NormAlgorithm(
                    other.explicit().unwrap_or(Algorithm::OneStage),
                ))
            }
        };
        let rows_per_step = if inputs == Inputs::ZeroCopy {
            // One launch; only two-stage needs room (scratch) for the sums:
            // `Auto` runs one-stage there (the same bits), an explicit
            // two-stage is refused.
            if choice == AlgoChoice::Auto
                && algorithm == Algorithm::TwoStage
                && total > config.max_bytes
            {
                algorithm = Algorithm::OneStage;
            }
            if algorithm == Algorithm::TwoStage && total > config.max_bytes {
                return Err(Error::ScratchTooSmall {
                    bytes: total,
                    capacity: config.max_bytes,
                });
            }
            if algorithm == Algorithm::PushLl && total > ll_zone {
                return Err(Error::ZoneTooSmall {
                    algorithm,
                    bytes: total,
                    capacity: ll_zone,
                    setting: crate::config::zone_setting(algorithm),
                });
            }
            rows.max(1)
        } else {
            // Staging holds the inputs and, two-stage, scratch the sums;
            // push_ll's landing zone holds its steps too.
            let capacity = if algorithm == Algorithm::PushLl {
                config.max_bytes.min(ll_zone)
            } else {
                config.max_bytes
            };
            let rows_per_step = capacity / row_bytes;
            if rows_per_step == 0 || (rows > rows_per_step && !config.chunking) {
                return Err(Error::MessageTooLarge {
                    bytes: if rows_per_step == 0 { row_bytes } else { total },
                    capacity,
                });
            }
            rows_per_step.min(rows.max(1))
        };
        // A block (push_ll with clusters: a cluster of `ctas` blocks) per
        // row up to the cap: every algorithm normalises every row on every
        // rank (two-stage reduces only a partition first).
        let cap = config.blocks_cap(link);
        let ctas = if algorithm == Algorithm::PushLl {
            split_ctas(
                config.fused_ctas,
                hidden / NORM_CHUNK,
                norm_reg_slots(dtype.lanes()),
                rows_per_step,
                world,
                cap,
                max_ctas,
            )
        } else {
            1
        };
        let row_blocks = (rows_per_step.min(u32::MAX as usize) as u32).clamp(1, cap / ctas);
        // Register path: a warp per 32 threads the chunks of a CTA's range
        // need, at most the configured block (a multiple of 32, checked by
        // Config).
        let threads = if reg_path {
            let chunks = (hidden / NORM_CHUNK) as u32;
            let local = norm_split_range(chunks, ctas).min(chunks) as usize;
            let need = (local * NORM_CHUNK).div_ceil(per_thread);
            (need.div_ceil(32) * 32).clamp(32, max_threads as usize) as u32
        } else {
            max_threads
        };
        Ok(NormPlan {
            algorithm,
            rows,
            hidden,
            rows_per_step,
            blocks: row_blocks * ctas,
            ctas,
            threads,
        })
    }

    /// `(first row, rows)` of each launch; one empty launch for no rows
    /// (it still runs the barriers, as every rank's call must).
    pub fn steps(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let n = self.rows.div_ceil(self.rows_per_step).max(1);
        (0..n).map(move |k| {
            let first = k * self.rows_per_step;
            (
                first,
                self.rows_per_step.min(self.rows - first.min(self.rows)),
            )
        })
    }
}

/// Least chunks per CTA that [`split_ctas`] gives a row under `Auto` (a
/// warp's worth): smaller ranges add a CTA for almost no work.
pub const AUTO_MIN_CTA_CHUNKS: usize = 32;

/// Threads of a whole-row block at and below which `Auto` keeps the rows
/// of a world of 2 whole: there the split cost more than it saved
/// (docs/design/fused.md, "Splitting a fused row over a cluster").
pub const AUTO_WHOLE_ROW_THREADS_W2: usize = 256;

/// CTAs of the cluster that splits each fused push_ll row of `chunks`
/// chunks (`slots` per thread on the register path), for `rows` rows per
/// launch, a world of `world`, at most `cap` blocks per rank and at most
/// `max_ctas` (a power of two; 1: no clusters). `fused_ctas` when given (a
/// power of two; no more than `cap` and `max_ctas` allow). Else, from the
/// fused bench on one H200 (virtual ranks, docs/benchmarks.md): 8 or 4
/// CTAs, the most that keep every row's cluster within `cap` blocks and at
/// least [`AUTO_MIN_CTA_CHUNKS`] chunks per CTA; none for one rank (no
/// gain measured), for two ranks with rows that one block of at most
/// [`AUTO_WHOLE_ROW_THREADS_W2`] threads holds, and for 2 CTAs (which lost
/// to whole rows in most shapes).
pub fn split_ctas(
    fused_ctas: Option<u32>,
    chunks: usize,
    slots: usize,
    rows: usize,
    world: usize,
    cap: u32,
    max_ctas: u32,
) -> u32 {
    // The largest power of two at most `n` (n >= 1).
    let floor_pow2 = |n: u32| 1u32 << (31 - n.max(1).leading_zeros());
    let most = floor_pow2(cap.min(max_ctas).min(NORM_MAX_CTAS as u32));
    if let Some(k) = fused_ctas {
        return floor_pow2(k).min(most);
    }
    let whole_threads = chunks.div_ceil(slots.max(1));
    if world <= 1 || (world == 2 && whole_threads <= AUTO_WHOLE_ROW_THREADS_W2) {
        return 1;
    }
    for k in [8u32, 4] {
        if k <= most
            && rows.max(1) * k as usize <= cap as usize
            && norm_split_range(chunks as u32, k) as usize >= AUTO_MIN_CTA_CHUNKS
        {
            return k;
        }
    }
    1
}
