//! From a request to launches: the group's settings ([`Config`]), the
//! algorithm table ([`Thresholds`]), and the [`Plan`] of one allreduce — its
//! algorithm and the steps (chunks) it runs, each with its entry point and
//! block count. Pure: no driver calls, so every rank computes the same plan
//! from the same arguments, as the barriers need.

use crate::abi::{Algorithm, Dtype, MAX_BLOCKS, MAX_RANKS, PACK_BYTES};
use crate::error::{Error, Result};
use crate::ptx::Entry;
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
        }
    }
}

impl Thresholds {
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
        match choice {
            AlgoChoice::OneStage => Algorithm::OneStage,
            AlgoChoice::TwoStage => Algorithm::TwoStage,
            AlgoChoice::Auto => {
                if bytes <= self.one_stage_max(link, world) {
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
/// each, plus an 8 KiB signal: the default (32 MiB) costs 64 MiB of device
/// memory per rank. Groups for small messages only can use much less, e.g.
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

/// How the inputs reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inputs {
    /// Copied into the group's staging buffers first: any buffer, in place
    /// allowed, messages above `max_bytes` chunked.
    Staged,
    /// Read by the peers where they are (registered buffers, or captured
    /// buffers registered after capture): one launch, no chunking.
    ZeroCopy,
}

/// One allreduce as the ranks asked for it.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub dtype: Dtype,
    /// Elements per rank.
    pub count: usize,
    pub world: usize,
    pub link: Link,
    /// All ranks in one launch on one GPU (`_virtual` entries).
    pub virtual_ranks: bool,
    pub inputs: Inputs,
    pub choice: AlgoChoice,
}

/// One launch of a plan: elements `[offset, offset + len)` of the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub offset: usize,
    pub len: usize,
    pub entry: Entry,
    /// Blocks per rank.
    pub blocks: u32,
}

/// Everything about one allreduce before anything runs: the one algorithm
/// of the whole message (chosen from its total size, so every chunk runs
/// the same one and the return value describes the whole call) and its
/// steps. Every rank computes the same plan from the same request.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub algorithm: Algorithm,
    request: Request,
    /// Elements per step (whole packs), the whole message for zero-copy.
    chunk: usize,
    blocks_cap: u32,
    threads: u32,
}

impl Plan {
    /// The plan of `request` under `config`, or the error that refuses it:
    /// a staged message above `max_bytes` with chunking off
    /// (`MessageTooLarge`), an explicit two-stage over zero-copy inputs
    /// whose scratch is too small (`ScratchTooSmall`; `Auto` runs one-stage
    /// there, with the same bits).
    pub fn new(config: &Config, request: Request) -> Result<Plan> {
        let size = request.dtype.size();
        let bytes = request.count * size;
        let mut algorithm =
            config
                .thresholds
                .choose(request.choice, bytes, request.world, request.link);
        let chunk = match request.inputs {
            Inputs::Staged => {
                if bytes > config.max_bytes && !config.chunking {
                    return Err(Error::MessageTooLarge {
                        bytes,
                        capacity: config.max_bytes,
                    });
                }
                ((config.max_bytes / PACK_BYTES) * request.dtype.lanes()).max(1)
            }
            Inputs::ZeroCopy => {
                if algorithm == Algorithm::TwoStage && bytes > config.max_bytes {
                    if request.choice == AlgoChoice::TwoStage {
                        return Err(Error::ScratchTooSmall {
                            bytes,
                            capacity: config.max_bytes,
                        });
                    }
                    algorithm = Algorithm::OneStage;
                }
                request.count.max(1)
            }
        };
        Ok(Plan {
            algorithm,
            request,
            chunk,
            blocks_cap: config.blocks_cap(request.link),
            threads: config.threads_per_block,
        })
    }

    /// The launches, in order. An empty message is one empty launch: every
    /// rank still meets the others.
    pub fn steps(&self) -> impl Iterator<Item = Step> + '_ {
        let count = self.request.count;
        let n = count.div_ceil(self.chunk).max(1);
        (0..n).map(move |k| {
            let offset = k * self.chunk;
            let len = (count - offset).min(self.chunk);
            let r = &self.request;
            Step {
                offset,
                len,
                entry: Entry {
                    algorithm: self.algorithm,
                    dtype: r.dtype,
                    world: r.world,
                    virtual_ranks: r.virtual_ranks,
                },
                blocks: blocks_for(
                    self.algorithm,
                    r.dtype,
                    len,
                    r.world,
                    self.threads,
                    self.blocks_cap,
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(count: usize, inputs: Inputs, choice: AlgoChoice) -> Request {
        Request {
            dtype: Dtype::F32,
            count,
            world: 2,
            link: Link::NvLink,
            virtual_ranks: false,
            inputs,
            choice,
        }
    }

    #[test]
    fn staged_plans_chunk_on_pack_boundaries_with_one_algorithm() {
        let c = Config {
            max_bytes: 40,
            ..Config::default()
        };
        // 40 bytes of capacity hold two whole f32 packs: 8 elements.
        let p = Plan::new(&c, request(20, Inputs::Staged, AlgoChoice::Auto)).expect("plan");
        let steps: Vec<(usize, usize)> = p.steps().map(|s| (s.offset, s.len)).collect();
        assert_eq!(steps, vec![(0, 8), (8, 8), (16, 4)]);
        assert!(p.steps().all(|s| s.entry.algorithm == p.algorithm));
        let empty = Plan::new(&c, request(0, Inputs::Staged, AlgoChoice::Auto)).expect("plan");
        assert_eq!(empty.steps().map(|s| s.len).collect::<Vec<_>>(), vec![0]);
        for (count, dtype, cap) in [
            (1_000_003usize, Dtype::Bf16, 65_536usize),
            (77, Dtype::F16, 32),
            (64, Dtype::F32, 256),
        ] {
            let c = Config {
                max_bytes: cap,
                ..Config::default()
            };
            let r = Request {
                dtype,
                ..request(count, Inputs::Staged, AlgoChoice::TwoStage)
            };
            let mut next = 0;
            for s in Plan::new(&c, r).expect("plan").steps() {
                assert_eq!(s.offset, next);
                assert_eq!((s.offset * dtype.size()) % PACK_BYTES, 0);
                assert!(s.len * dtype.size() <= cap);
                assert_eq!(s.entry.algorithm, Algorithm::TwoStage);
                next = s.offset + s.len;
            }
            assert_eq!(next, count);
        }
        let off = Config {
            max_bytes: 128,
            chunking: false,
            ..Config::default()
        };
        assert!(matches!(
            Plan::new(&off, request(33, Inputs::Staged, AlgoChoice::Auto)),
            Err(Error::MessageTooLarge {
                bytes: 132,
                capacity: 128
            })
        ));
    }

    #[test]
    fn zero_copy_plans_one_launch_and_refuse_what_does_not_fit() {
        let c = Config {
            max_bytes: 128,
            ..Config::default()
        };
        let p = Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::OneStage)).expect("plan");
        assert_eq!(p.steps().count(), 1);
        assert!(matches!(
            Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::TwoStage)),
            Err(Error::ScratchTooSmall {
                bytes: 4000,
                capacity: 128
            })
        ));
        let mut t = Thresholds::default();
        t.set_one_stage_max(Link::NvLink, 2, 0);
        let c = Config { thresholds: t, ..c };
        let p = Plan::new(&c, request(1000, Inputs::ZeroCopy, AlgoChoice::Auto)).expect("plan");
        assert_eq!(
            p.algorithm,
            Algorithm::OneStage,
            "Auto falls back where scratch is short"
        );
    }

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
