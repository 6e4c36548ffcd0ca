//! Choosing the algorithm and the launch shape. One table, overridable.

use crate::abi::{Algorithm, Dtype, MAX_BLOCKS, MAX_RANKS};
use std::time::Duration;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AlgoChoice {
    /// One-stage up to the threshold for this world size and link, two-stage above.
    #[default]
    Auto,
    OneStage,
    TwoStage,
}

impl From<Algorithm> for AlgoChoice {
    fn from(a: Algorithm) -> Self {
        match a {
            Algorithm::OneStage => AlgoChoice::OneStage,
            Algorithm::TwoStage => AlgoChoice::TwoStage,
        }
    }
}

/// How the ranks reach each other's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// Virtual ranks, or several ranks on one GPU.
    SameDevice,
    NvLink,
    Pcie,
}

/// Largest message (bytes) for which `Auto` picks one-stage, indexed by
/// world size. Both algorithms give identical bits, so a threshold only
/// moves speed, never results.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thresholds {
    pub same_device: [usize; MAX_RANKS + 1],
    pub nvlink: [usize; MAX_RANKS + 1],
    pub pcie: [usize; MAX_RANKS + 1],
}

impl Default for Thresholds {
    fn default() -> Self {
        const K: usize = 1024;
        const M: usize = 1024 * 1024;
        Thresholds {
            // From the H200 virtual-rank bf16 sweep (docs/benchmarks.md): one-stage
            // is faster up to 8 MiB for N=2, 1 MiB for N=4 and 256 KiB for N=8;
            // odd world sizes interpolated.
            same_device: [0, usize::MAX, 8 * M, 2 * M, M, M, 512 * K, 256 * K, 256 * K],
            // Starting points in the spirit of the published custom-allreduce
            // tables; to be re-tuned on real multi-GPU machines.
            nvlink: [
                0,
                usize::MAX,
                8 * M,
                M,
                512 * K,
                512 * K,
                256 * K,
                256 * K,
                256 * K,
            ],
            // On PCIe every one-stage rank pulls (N-1)x the message over a shared bus.
            pcie: [
                0,
                usize::MAX,
                512 * K,
                128 * K,
                64 * K,
                32 * K,
                32 * K,
                32 * K,
                32 * K,
            ],
        }
    }
}

impl Thresholds {
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, link: Link) -> Algorithm {
        match choice {
            AlgoChoice::OneStage => Algorithm::OneStage,
            AlgoChoice::TwoStage => Algorithm::TwoStage,
            AlgoChoice::Auto => {
                let t = match link {
                    Link::SameDevice => &self.same_device,
                    Link::NvLink => &self.nvlink,
                    Link::Pcie => &self.pcie,
                };
                if world <= 1 || bytes <= t[world.min(MAX_RANKS)] {
                    Algorithm::OneStage
                } else {
                    Algorithm::TwoStage
                }
            }
        }
    }
}

/// Automatic block cap for ranks that share one GPU (from the H200
/// virtual-rank sweep, docs/benchmarks.md).
pub const AUTO_BLOCKS_SAME_DEVICE: u32 = 16;
/// Automatic block cap for ranks on distinct GPUs: large messages need many
/// requests in flight to fill NVLink (2 x H200 sweep, docs/benchmarks.md).
pub const AUTO_BLOCKS_CROSS_DEVICE: u32 = MAX_BLOCKS as u32;

/// Group settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// Capacity of each rank's staging and scratch buffers in bytes. Larger
    /// messages are cut into chunks of this size (see `chunking`).
    pub max_bytes: usize,
    /// How long a block waits for a peer before it writes an error record
    /// and leaves the kernel. `Duration::ZERO` waits forever.
    pub timeout: Duration,
    /// Threads per block (a multiple of 32, at least 32).
    pub threads_per_block: u32,
    /// Blocks per rank at most (1..=[`MAX_BLOCKS`]). `None` (the default):
    /// chosen by the link, see [`Config::blocks_cap`]. Fewer blocks mean
    /// fewer flags to exchange (small messages); more blocks keep more
    /// requests in flight over NVLink or PCIe (large messages).
    pub max_blocks: Option<u32>,
    /// Process messages larger than `max_bytes` in chunks; if false they
    /// are refused with `Error::MessageTooLarge`.
    pub chunking: bool,
    pub thresholds: Thresholds,
    /// With the `nccl` feature and NCCL enabled on a `PeerGroup`: messages
    /// larger than this many bytes go to NCCL under `AlgoChoice::Auto`.
    /// `None` (the default) never hands over: NCCL's results are not
    /// bit-identical to the determinism contract.
    pub nccl_above: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_bytes: 32 << 20,
            timeout: Duration::from_secs(10),
            threads_per_block: 512,
            max_blocks: None,
            chunking: true,
            nccl_above: None,
            thresholds: Thresholds::default(),
        }
    }
}

impl Config {
    /// The largest number of blocks per rank a collective over `link` may
    /// use: `max_blocks` if set, else [`AUTO_BLOCKS_SAME_DEVICE`] for ranks
    /// sharing a GPU (virtual ranks: every rank's blocks share its SMs) and
    /// [`AUTO_BLOCKS_CROSS_DEVICE`] across devices. The kernels use fewer for
    /// small messages ([`blocks_for`]); a launch is also refused when the
    /// blocks could not all be resident at once.
    pub fn blocks_cap(&self, link: Link) -> u32 {
        self.max_blocks.unwrap_or(match link {
            Link::SameDevice => AUTO_BLOCKS_SAME_DEVICE,
            Link::NvLink | Link::Pcie => AUTO_BLOCKS_CROSS_DEVICE,
        })
    }

    /// Checks the settings; the error says which one is out of range and
    /// what to use. Groups call this when they are created.
    pub fn validate(&self) -> Result<(), String> {
        if self.threads_per_block < 32
            || self.threads_per_block > 1024
            || self.threads_per_block % 32 != 0
        {
            return Err(format!(
                "threads_per_block = {}: use a multiple of 32 in 32..=1024",
                self.threads_per_block
            ));
        }
        if let Some(b) = self.max_blocks {
            if b == 0 || b as usize > MAX_BLOCKS {
                return Err(format!(
                    "max_blocks = Some({b}): use 1..={MAX_BLOCKS}, or None to choose by link"
                ));
            }
        }
        if self.max_bytes < crate::abi::PACK_BYTES * MAX_RANKS {
            return Err(format!(
                "max_bytes = {}: use at least {} bytes",
                self.max_bytes,
                crate::abi::PACK_BYTES * MAX_RANKS
            ));
        }
        Ok(())
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Blocks per rank for one collective: enough threads for the work of one
/// rank (the whole message for one-stage, one partition for two-stage), at
/// least one, at most `max_blocks`. Few blocks for small messages means few
/// flags to exchange. Every rank computes the same value from the same
/// inputs, which the barrier protocol requires.
pub fn blocks_for(
    algo: Algorithm,
    dtype: Dtype,
    count: usize,
    world: usize,
    threads: u32,
    max_blocks: u32,
) -> u32 {
    let packs = count.div_ceil(dtype.lanes()).max(1);
    let work = match algo {
        Algorithm::OneStage => packs,
        Algorithm::TwoStage => packs.div_ceil(world.max(1)),
    };
    (work.div_ceil(threads as usize) as u32).clamp(1, max_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_switches_at_the_threshold() {
        let t = Thresholds::default();
        let th = t.same_device[4];
        assert_eq!(
            t.choose(AlgoChoice::Auto, th, 4, Link::SameDevice),
            Algorithm::OneStage
        );
        assert_eq!(
            t.choose(AlgoChoice::Auto, th + 1, 4, Link::SameDevice),
            Algorithm::TwoStage
        );
        assert_eq!(
            t.choose(AlgoChoice::Auto, usize::MAX, 1, Link::Pcie),
            Algorithm::OneStage
        );
        assert_eq!(
            t.choose(AlgoChoice::TwoStage, 16, 2, Link::Pcie),
            Algorithm::TwoStage
        );
    }

    #[test]
    fn blocks_stay_in_range() {
        for count in [0usize, 1, 7, 8, 4096, 1 << 20, 1 << 26] {
            for world in 1..=8 {
                for algo in Algorithm::ALL {
                    let b = blocks_for(algo, Dtype::Bf16, count, world, 512, 16);
                    assert!((1..=16).contains(&b), "{algo:?} {count} {world} -> {b}");
                }
            }
        }
        assert_eq!(
            blocks_for(Algorithm::OneStage, Dtype::F32, 4, 2, 512, 16),
            1
        );
        assert_eq!(
            blocks_for(Algorithm::OneStage, Dtype::F32, 4 * 512 * 3, 2, 512, 16),
            3
        );
    }
}
