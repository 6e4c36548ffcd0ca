//! The settings of a group ([`Config`]) and of `Auto` ([`Thresholds`]),
//! and the words a caller uses for them ([`AlgoChoice`], [`Link`]).

use crate::abi::{Algorithm, Signal, MAX_BLOCKS, MAX_RANKS, PACK_BYTES};
use crate::ll::LL_PACK_BYTES;
use std::time::Duration;

/// What the caller asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AlgoChoice {
    /// By the [`Thresholds`] for this world size and link: push_ll and
    /// push for the smallest messages, one-stage, then two-stage.
    #[default]
    Auto,
    OneStage,
    TwoStage,
    /// Needs the message to fit `Config::push_max_bytes` (staged calls are
    /// chunked to it).
    Push,
    /// Push with flag-in-data lines (one one-way trip, twice the bytes).
    /// Needs the message to fit `Config::push_ll_max_bytes` (staged calls
    /// are chunked to it).
    PushLl,
}

impl From<Algorithm> for AlgoChoice {
    fn from(a: Algorithm) -> Self {
        match a {
            Algorithm::OneStage => AlgoChoice::OneStage,
            Algorithm::TwoStage => AlgoChoice::TwoStage,
            Algorithm::Push => AlgoChoice::Push,
            Algorithm::PushLl => AlgoChoice::PushLl,
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

/// Where `Auto` switches from one-stage to two-stage: for each link and
/// world size, the largest message (bytes) that still runs one-stage. Both
/// algorithms give identical bits, so a threshold only moves speed, never
/// results. Read and change it with [`Thresholds::one_stage_max`] and
/// [`Thresholds::set_one_stage_max`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thresholds {
    same_device: [usize; MAX_RANKS + 1],
    nvlink: [usize; MAX_RANKS + 1],
    pcie: [usize; MAX_RANKS + 1],
    /// Largest message that `Auto` pushes, per link (all world sizes).
    push: [usize; 3],
    /// Largest message that `Auto` runs as push_ll, per link (all world
    /// sizes); checked before `push`.
    push_ll: [usize; 3],
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
            // World 2 from the 2 x H200 sweep (docs/benchmarks.md: one-stage
            // ahead up to 8 MiB); larger worlds are starting points in the
            // spirit of the published custom-allreduce tables.
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
            // Per link: same device never (on one GPU the system-scope
            // release costs more than the reads it saves: 2.97 vs 2.53 us at
            // 4 KiB, N=2); NVLink up to 64 KiB (2 x H200: 3.84 vs 4.09 us at
            // 4 KiB, even at 128 KiB); PCIe not measured yet, so not by
            // `Auto` (explicit `AlgoChoice::Push` works everywhere).
            push: [0, 64 * K, 0],
            // Per link, checked before `push`: same device never (virtual
            // ranks on one H200: ahead of one-stage at N=2 for some sizes
            // only, behind at N=4 and 8, e.g. 3.90 vs 2.88 us at 4 KiB,
            // N=4); NVLink up to 128 KiB (2 x H200, PeerGroup: 2.87 vs
            // 3.86 us push and 4.07 one-stage at 4 KiB, 4.13 vs 4.54 us
            // one-stage at 128 KiB, behind from 256 KiB); PCIe not measured
            // (explicit `AlgoChoice::PushLl` works everywhere).
            push_ll: [0, 128 * K, 0],
        }
    }
}

fn link_index(link: Link) -> usize {
    match link {
        Link::SameDevice => 0,
        Link::NvLink => 1,
        Link::Pcie => 2,
    }
}

impl Thresholds {
    /// The largest message (bytes) that `Auto` runs as [`Algorithm::Push`]
    /// over `link` (and only if it fits `Config::push_max_bytes`).
    pub fn push_max(&self, link: Link) -> usize {
        self.push[link_index(link)]
    }

    /// Sets where `Auto` stops pushing over `link`.
    pub fn set_push_max(&mut self, link: Link, bytes: usize) {
        self.push[link_index(link)] = bytes;
    }

    /// The largest message (bytes) that `Auto` runs as
    /// [`Algorithm::PushLl`] over `link` (and only if it fits
    /// `Config::push_ll_max_bytes`).
    pub fn push_ll_max(&self, link: Link) -> usize {
        self.push_ll[link_index(link)]
    }

    /// Sets where `Auto` stops using push_ll over `link`.
    pub fn set_push_ll_max(&mut self, link: Link, bytes: usize) {
        self.push_ll[link_index(link)] = bytes;
    }

    fn table(&self, link: Link) -> &[usize; MAX_RANKS + 1] {
        match link {
            Link::SameDevice => &self.same_device,
            Link::NvLink => &self.nvlink,
            Link::Pcie => &self.pcie,
        }
    }

    /// The largest message (bytes) that `Auto` runs one-stage for `world`
    /// ranks over `link` (world 1 and out-of-range worlds: `usize::MAX`).
    pub fn one_stage_max(&self, link: Link, world: usize) -> usize {
        match world {
            2..=MAX_RANKS => self.table(link)[world],
            _ => usize::MAX,
        }
    }

    /// Sets where `Auto` switches for `world` ranks over `link`: messages
    /// up to `bytes` run one-stage. `world` outside 2..=8 is ignored (world
    /// 1 is a copy whatever the algorithm).
    pub fn set_one_stage_max(&mut self, link: Link, world: usize, bytes: usize) {
        if (2..=MAX_RANKS).contains(&world) {
            let t = match link {
                Link::SameDevice => &mut self.same_device,
                Link::NvLink => &mut self.nvlink,
                Link::Pcie => &mut self.pcie,
            };
            t[world] = bytes;
        }
    }

    /// The algorithm for a message of `bytes` bytes: the explicit choice, or
    /// under `Auto` one-stage up to [`Thresholds::one_stage_max`].
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, link: Link) -> Algorithm {
        self.choose_fitting(choice, bytes, world, link, (usize::MAX, usize::MAX))
    }

    /// [`Thresholds::choose`], where `Auto` may push (push_ll) only a
    /// message of at most `caps.0` (`caps.1`) bytes: what fits the group's
    /// landing zones.
    fn choose_fitting(
        &self,
        choice: AlgoChoice,
        bytes: usize,
        world: usize,
        link: Link,
        caps: (usize, usize),
    ) -> Algorithm {
        match choice {
            AlgoChoice::OneStage => Algorithm::OneStage,
            AlgoChoice::TwoStage => Algorithm::TwoStage,
            AlgoChoice::Push => Algorithm::Push,
            AlgoChoice::PushLl => Algorithm::PushLl,
            AlgoChoice::Auto => {
                if world > 1 && bytes <= caps.1 && bytes <= self.push_ll_max(link) {
                    Algorithm::PushLl
                } else if world > 1 && bytes <= caps.0 && bytes <= self.push_max(link) {
                    Algorithm::Push
                } else if bytes <= self.one_stage_max(link, world) {
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
/// requests in flight to fill NVLink. On 2 x H200, 16 blocks reached 162
/// GB/s bus bandwidth at 64 MiB, 32 and 64 blocks ~320 (docs/benchmarks.md).
pub const AUTO_BLOCKS_CROSS_DEVICE: u32 = 64;

/// Group settings.
///
/// Memory: every rank owns a staging and a scratch buffer of `max_bytes`
/// each, plus an 8 KiB signal and the landing zones of push and push_ll
/// (`2 * world * (push_max_bytes + 2 * push_ll_max_bytes)`): the defaults
/// cost 64 MiB plus `world` MiB of device memory per rank. Groups for small messages only can use much less, e.g.
/// [`Config::with_max_bytes`]`(1 << 20)`.
#[derive(Clone, Debug)]
pub struct Config {
    /// Capacity of each rank's staging and scratch buffers in bytes. Larger
    /// staged messages are cut into chunks of this size (see `chunking`);
    /// registered (zero-copy) two-stage allreduces need this much scratch.
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
    /// Capacity (bytes per source) of each rank's landing zone for
    /// [`Algorithm::Push`]: every rank holds `2 * world * push_max_bytes`
    /// bytes of it. Larger messages are pushed in chunks (staged) or not
    /// pushed (zero-copy; `Auto` picks another algorithm).
    pub push_max_bytes: usize,
    /// Capacity (message bytes per source) of each rank's landing zone for
    /// [`Algorithm::PushLl`], whose lines carry 8 data bytes in 16: every
    /// rank holds `4 * world * push_ll_max_bytes` bytes of it. Larger
    /// messages are sent in chunks (staged) or not by push_ll (zero-copy).
    pub push_ll_max_bytes: usize,
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
            push_max_bytes: 256 << 10,
            push_ll_max_bytes: 128 << 10,
            nccl_above: None,
            thresholds: Thresholds::default(),
        }
    }
}

impl Config {
    /// The algorithm for a message of `bytes` bytes under these settings:
    /// [`Thresholds::choose`], except that `Auto` never pushes a message
    /// larger than `push_max_bytes` (push_ll: `push_ll_max_bytes`): it would
    /// not fit the landing zones.
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, link: Link) -> Algorithm {
        let caps = (self.push_max_bytes, self.push_ll_max_bytes);
        self.thresholds
            .choose_fitting(choice, bytes, world, link, caps)
    }

    /// Bytes of one source's part of push_ll's landing zone: two lines
    /// (32 bytes) per 16-byte pack.
    fn push_ll_part(&self) -> usize {
        self.push_ll_max_bytes / PACK_BYTES * LL_PACK_BYTES
    }

    /// Bytes of each rank's landing zones (push's, then push_ll's) in a
    /// group of `world` ranks.
    pub(crate) fn landing_bytes(&self, world: usize) -> usize {
        2 * world * (self.push_max_bytes + self.push_ll_part())
    }

    /// Where `algo`'s landing zone starts in a signal allocation of a
    /// `world`-rank group, and the bytes of one source's part of it
    /// (`LaunchArgs::landing_offset`, `landing_part`; zeros for the pull
    /// algorithms, which have none).
    pub(crate) fn landing(&self, algo: Algorithm, world: usize) -> (u64, u64) {
        let push_zone = Signal::LANDING_OFFSET;
        match algo {
            Algorithm::Push => (push_zone as u64, self.push_max_bytes as u64),
            Algorithm::PushLl => (
                (push_zone + 2 * world * self.push_max_bytes) as u64,
                self.push_ll_part() as u64,
            ),
            Algorithm::OneStage | Algorithm::TwoStage => (0, 0),
        }
    }

    /// The default settings with buffers of `max_bytes` per rank.
    pub fn with_max_bytes(max_bytes: usize) -> Self {
        Config {
            max_bytes,
            ..Config::default()
        }
    }

    /// The largest number of blocks per rank a collective over `link` may
    /// use: `max_blocks` if set, else [`AUTO_BLOCKS_SAME_DEVICE`] for ranks
    /// sharing a GPU (virtual ranks: every rank's blocks share its SMs) and
    /// [`AUTO_BLOCKS_CROSS_DEVICE`] across devices. The kernels use fewer for
    /// small messages ([`crate::plan::blocks_for`]); a launch is also refused when the
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
        if self.push_max_bytes < PACK_BYTES || self.push_max_bytes % PACK_BYTES != 0 {
            return Err(format!(
                "push_max_bytes = {}: use a positive multiple of {PACK_BYTES}",
                self.push_max_bytes
            ));
        }
        if self.push_ll_max_bytes < PACK_BYTES || self.push_ll_max_bytes % PACK_BYTES != 0 {
            return Err(format!(
                "push_ll_max_bytes = {}: use a positive multiple of {PACK_BYTES}",
                self.push_ll_max_bytes
            ));
        }
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
        if self.max_bytes < PACK_BYTES * MAX_RANKS {
            return Err(format!(
                "max_bytes = {}: use at least {} bytes",
                self.max_bytes,
                PACK_BYTES * MAX_RANKS
            ));
        }
        Ok(())
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_switches_at_the_threshold() {
        let t = Thresholds::default();
        let th = t.one_stage_max(Link::SameDevice, 4);
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
    fn auto_runs_push_ll_where_it_fits_and_the_table_says() {
        let c = Config::default();
        let pick = |c: &Config, bytes| c.choose(AlgoChoice::Auto, bytes, 2, Link::NvLink);
        assert_eq!(pick(&c, 4096), Algorithm::PushLl);
        assert_eq!(pick(&c, 128 << 10), Algorithm::PushLl);
        assert_eq!(pick(&c, (128 << 10) + 16), Algorithm::OneStage);
        // World 1 is a copy; the same device never pushes by default.
        assert_eq!(
            c.choose(AlgoChoice::Auto, 4096, 1, Link::NvLink),
            Algorithm::OneStage
        );
        assert_eq!(
            c.choose(AlgoChoice::Auto, 4096, 2, Link::SameDevice),
            Algorithm::OneStage
        );
        // Landing zones too small for the message: push instead.
        let small = Config {
            push_ll_max_bytes: 1024,
            ..Config::default()
        };
        assert_eq!(pick(&small, 4096), Algorithm::Push);
        // A hand-made table moves the choice.
        let mut t = Config::default();
        t.thresholds.set_push_ll_max(Link::NvLink, 0);
        assert_eq!(pick(&t, 4096), Algorithm::Push);
        t.thresholds.set_push_ll_max(Link::Pcie, 64 << 10);
        assert_eq!(
            t.choose(AlgoChoice::Auto, 4096, 8, Link::Pcie),
            Algorithm::PushLl
        );
        assert_eq!(
            c.choose(AlgoChoice::PushLl, 1 << 30, 2, Link::Pcie),
            Algorithm::PushLl
        );
    }
}
