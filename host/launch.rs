//! A plan step becomes one kernel launch: the [`LaunchArgs`] the kernels
//! take by value, the grid, and the co-residency rule. The only place that
//! builds `LaunchArgs`.

use crate::abi::{LaunchArgs, MAX_RANKS};
use crate::driver::Kernels;
use crate::error::{Error, Result};
use crate::plan::{Config, Step};
use cudarc::driver::CudaStream;

/// Who one launch runs for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ranks {
    /// Every rank of the group, one per `blockIdx.y` (virtual ranks).
    All,
    /// One real rank.
    One(usize),
}

/// Where one launch reads and writes: the device pointer table (inputs
/// and scratch of every rank, as seen from the launching device), the
/// signal of every rank, and the outputs of the ranks it runs for at the
/// start of the message (the step's offset is applied here).
pub(crate) struct Target<'a> {
    pub table: u64,
    pub signals: &'a [u64; MAX_RANKS],
    pub outputs: &'a [u64; MAX_RANKS],
    /// Fault injection (none normally).
    pub faults: Faults,
    /// The call's tag (`LaunchArgs::call_tag`, [`crate::call_tag`]).
    pub call_tag: u32,
    /// Device address of the launching member's host error mailbox.
    pub host_error: u64,
    /// The ranks' own inputs at the start of the message, read in place
    /// (`LaunchArgs::own_inputs`, push_ll only), or `None`: the table's.
    pub own_inputs: Option<&'a [u64; MAX_RANKS]>,
}

/// Fault injection of one launch (bit r: rank r; ranks past
/// [`MAX_RANKS`] are dropped).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Faults {
    /// Ranks that leave at once (`LaunchArgs::absent_ranks`).
    pub absent: u32,
    /// Ranks that carry another call's tag (`LaunchArgs::mismatched_ranks`).
    pub mismatched: u32,
}

impl Faults {
    const RANKS: u32 = (1 << MAX_RANKS) - 1;
    pub(crate) const fn absent(ranks: u32) -> Self {
        Faults {
            absent: ranks & Self::RANKS,
            mismatched: 0,
        }
    }
    pub(crate) const fn mismatched(ranks: u32) -> Self {
        Faults {
            absent: 0,
            mismatched: ranks & Self::RANKS,
        }
    }
}

/// Launches `step` on `stream` for `ranks` of a `world`-rank group.
///
/// The blocks of a launch must all be resident at once (a block waits at
/// barriers for the same block of its peers; for virtual ranks those peers
/// are blocks of this very launch): a grid that cannot be is refused with
/// `NotCoResident` instead of hanging.
///
/// # Safety
/// The table and signals must point at live buffers of the group; every
/// input in the table must hold `step.offset + step.len` elements (staged:
/// `step.len` from the start) and scratch enough for the step; the outputs
/// must be valid for `step.offset + step.len` elements; all until the
/// launch has run.
pub(crate) unsafe fn launch_step(
    kernels: &Kernels,
    stream: &CudaStream,
    config: &Config,
    world: usize,
    step: &Step,
    ranks: Ranks,
    target: &Target<'_>,
) -> Result<()> {
    let threads = config.threads_per_block;
    let capacity = kernels.co_resident_blocks(step.entry, threads)?;
    let (grid_y, rank) = match ranks {
        Ranks::All => (world as u32, 0),
        Ranks::One(r) => (1, r as u32),
    };
    let total = step.blocks * grid_y;
    if total > capacity {
        return Err(Error::NotCoResident {
            blocks: total,
            threads,
            capacity,
        });
    }
    let size = step.entry.dtype.size() as u64;
    let (landing_offset, landing_part) = config.landing(step.entry.algorithm, world);
    let mut args = LaunchArgs {
        table: target.table,
        signals: *target.signals,
        count: step.len as u64,
        timeout_ns: config.timeout_ns(),
        rank,
        absent_ranks: target.faults.absent,
        mismatched_ranks: target.faults.mismatched,
        call_tag: target.call_tag,
        host_error: target.host_error,
        landing_part,
        landing_offset,
        ..Default::default()
    };
    for r in 0..world {
        if ranks == Ranks::All || ranks == Ranks::One(r) {
            args.outputs[r] = target.outputs[r] + step.offset as u64 * size;
            if let Some(own) = target.own_inputs {
                args.own_inputs[r] = own[r] + step.offset as u64 * size;
            }
        }
    }
    // SAFETY: forwarded from the caller; the entry and grid come from the plan.
    unsafe { kernels.launch(stream, step.entry, (step.blocks, grid_y), threads, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_keep_each_kind_apart_and_drop_ranks_past_the_group_limit() {
        // Bits past MAX_RANKS never reach the kernel, and one kind never
        // sets the other (a ProcessGroup once passed its mask unmasked, so
        // bit 16 of "absent" would have read as a mismatched rank 0).
        let a = Faults::absent(0x1_0105);
        assert_eq!(
            a,
            Faults {
                absent: 0x05,
                mismatched: 0
            }
        );
        let m = Faults::mismatched(0xffff_ff82);
        assert_eq!(
            m,
            Faults {
                absent: 0,
                mismatched: 0x82
            }
        );
        assert_eq!(
            Faults::default(),
            Faults {
                absent: 0,
                mismatched: 0
            }
        );
        assert_eq!(Faults::absent(u32::MAX).absent, (1 << MAX_RANKS) - 1);
    }
}
