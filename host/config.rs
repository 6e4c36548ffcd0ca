//! The settings of a group ([`Config`]), and the words a caller uses for
//! them ([`AlgoChoice`], [`Link`], defined in `host/choice.rs`). `Auto`'s
//! table is in [`crate::thresholds`].

use crate::abi::{
    island_split, Algorithm, PushTwoStagePart, Signal, MAX_BLOCKS, MAX_RANKS, NORM_MAX_CTAS,
    PACK_BYTES,
};
pub use crate::choice::{AlgoChoice, Link};
use crate::ll::LL_PACK_BYTES;
use crate::ptx::ImageChoice;
pub use crate::thresholds::{Backend, Mode, Thresholds};
use std::time::Duration;

/// Automatic block cap for ranks that share one GPU (from the H200
/// virtual-rank sweep, docs/benchmarks.md).
pub const AUTO_BLOCKS_SAME_DEVICE: u32 = 16;
/// Automatic block cap for ranks on distinct GPUs: large messages need many
/// requests in flight to fill NVLink. On 2 x H200, 16 blocks reached 162
/// GB/s bus bandwidth at 64 MiB, 32 and 64 blocks ~320 (git show a6c9fec:docs/benchmarks.md).
pub const AUTO_BLOCKS_CROSS_DEVICE: u32 = 64;

/// Group settings.
///
/// Memory: every rank owns a staging and a scratch buffer of `max_bytes`
/// each, plus a 12 KiB signal and the landing zones of push, push_ll,
/// push_two_stage and push_islands (`2 * world * (push_max_bytes + 2 *
/// push_ll_max_bytes)` plus about `2 * push_two_stage_max_bytes` plus
/// about `2 * world / (world / 2) * push_two_stage_max_bytes`, i.e. 4x for
/// an even world, 6x for 3 ranks): the defaults cost 88 MiB (96 for 3
/// ranks) plus `world` MiB of device memory per rank. Groups for small messages
/// only can use much less, e.g. [`Config::with_max_bytes`]`(1 << 20)` with
/// smaller landing zones.
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
    /// Largest message (bytes) of [`Algorithm::PushTwoStage`] and
    /// [`Algorithm::PushIslands`]: every rank holds a landing zone of about
    /// `2 * push_two_stage_max_bytes` bytes for the first (each source
    /// writes one partition per stage, one slot) and about four times that
    /// for the second (partitions are per island, so twice as long). Larger
    /// messages are sent in chunks (staged) or not by these algorithms
    /// (zero-copy).
    pub push_two_stage_max_bytes: usize,
    /// With the `nccl` feature and NCCL enabled on a `PeerGroup`: messages
    /// larger than this many bytes go to NCCL under `AlgoChoice::Auto`
    /// (`PeerGroup::allreduce_routed`), besides the sizes the table gives
    /// NCCL. `None` (the default): only those. NCCL's results are not
    /// bit-identical to the determinism contract.
    pub nccl_above: Option<usize>,
    /// CTAs over which the fused push_ll ([`crate::fused::NormPlan`]) splits each
    /// row: a thread-block cluster of 1, 2, 4 or 8 (at most
    /// [`NORM_MAX_CTAS`]) CTAs, each taking an aligned range of the row's
    /// chunks, so a row's bytes go through as many SMs. Same bits for every
    /// value (docs/numerics.md). Clusters need sm_90 or newer: on older
    /// devices rows are never split. `None` (the default): chosen from the
    /// row and the rows ([`crate::fused::split_ctas`]); `Some(1)`: one block
    /// per row. An explicit value holds for every call: a cluster takes its
    /// rows one after another, so at many rows a large cluster keeps fewer
    /// rows in flight and can be several times slower than whole rows
    /// (docs/design/fused.md, "Splitting a fused row over a cluster"), where `None` would not split.
    pub fused_ctas: Option<u32>,
    /// Which image of the embedded kernels the group loads: `Auto` (the
    /// default) the build's cubin for the device where there is one, so
    /// no JIT compilation; `Ptx` always the PTX. Same bits either way;
    /// ranks of one group may differ.
    pub kernel_image: ImageChoice,
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
            push_two_stage_max_bytes: 4 << 20,
            nccl_above: None,
            fused_ctas: None,
            kernel_image: ImageChoice::Auto,
            thresholds: Thresholds::default(),
        }
    }
}

impl Config {
    /// The algorithm for a message of `bytes` bytes under these settings:
    /// [`Thresholds::choose`], except that `Auto` never picks a push
    /// algorithm for a message larger than its landing zone
    /// ([`Config::zone_capacity`]).
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, link: Link) -> Algorithm {
        let fits = |a| self.zone_capacity(a).is_none_or(|cap| bytes <= cap);
        self.thresholds
            .choose_fitting(choice, bytes, world, link, fits)
    }

    /// Who runs `count` elements of `dtype` for a group of `world` ranks
    /// over `link` in `mode`: [`crate::thresholds::route`] on this
    /// table. What the groups' `route` and `nccl_wins` answer.
    pub fn route(
        &self,
        link: Link,
        world: usize,
        count: usize,
        dtype: crate::abi::Dtype,
        mode: Mode,
    ) -> Backend {
        crate::thresholds::route(&self.thresholds, link, world, count, dtype, mode)
    }

    /// The largest message (bytes) `algo`'s landing zone holds, or `None`
    /// for the pull algorithms, which have none.
    pub fn zone_capacity(&self, algo: Algorithm) -> Option<usize> {
        match algo {
            Algorithm::Push => Some(self.push_max_bytes),
            Algorithm::PushLl => Some(self.push_ll_max_bytes),
            Algorithm::PushTwoStage | Algorithm::PushIslands => Some(self.push_two_stage_max_bytes),
            Algorithm::OneStage | Algorithm::TwoStage => None,
        }
    }

    /// The layout of one source's part of push_two_stage's zone.
    fn push_two_stage_part(&self, world: usize) -> PushTwoStagePart {
        PushTwoStagePart::for_capacity(
            (self.push_two_stage_max_bytes / PACK_BYTES) as u64,
            world as u64,
        )
    }

    /// The layout of one source's part of push_islands' zone: partitions
    /// are per island ([`island_split`]).
    fn push_islands_part(&self, world: usize) -> PushTwoStagePart {
        PushTwoStagePart::for_capacity(
            (self.push_two_stage_max_bytes / PACK_BYTES) as u64,
            island_split(world) as u64,
        )
    }

    /// Bytes of one source's part of push_ll's landing zone: two lines
    /// (32 bytes) per 16-byte pack.
    fn push_ll_part(&self) -> usize {
        self.push_ll_max_bytes / PACK_BYTES * LL_PACK_BYTES
    }

    /// Bytes of each rank's landing zones (push's, push_ll's,
    /// push_two_stage's, then push_islands') in a group of `world` ranks.
    pub(crate) fn landing_bytes(&self, world: usize) -> usize {
        2 * world * (self.push_max_bytes + self.push_ll_part())
            + world * self.push_two_stage_part(world).bytes() as usize
            + world * self.push_islands_part(world).bytes() as usize
    }

    /// Where `algo`'s landing zone starts in a signal allocation of a
    /// `world`-rank group, and the bytes of one source's part of it
    /// (`LaunchArgs::landing_offset`, `landing_part`; zeros for the pull
    /// algorithms, which have none).
    pub(crate) fn landing(&self, algo: Algorithm, world: usize) -> (u64, u64) {
        let push_zone = Signal::LANDING_OFFSET;
        let ll_zone = push_zone + 2 * world * self.push_max_bytes;
        let push2_zone = ll_zone + 2 * world * self.push_ll_part();
        let islands_zone = push2_zone + world * self.push_two_stage_part(world).bytes() as usize;
        match algo {
            Algorithm::Push => (push_zone as u64, self.push_max_bytes as u64),
            Algorithm::PushLl => (ll_zone as u64, self.push_ll_part() as u64),
            Algorithm::PushTwoStage => (push2_zone as u64, self.push_two_stage_part(world).bytes()),
            Algorithm::PushIslands => (islands_zone as u64, self.push_islands_part(world).bytes()),
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
        if self.push_two_stage_max_bytes < PACK_BYTES
            || self.push_two_stage_max_bytes % PACK_BYTES != 0
        {
            return Err(format!(
                "push_two_stage_max_bytes = {}: use a positive multiple of {PACK_BYTES}",
                self.push_two_stage_max_bytes
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
        if let Some(c) = self.fused_ctas {
            if !c.is_power_of_two() || c as usize > NORM_MAX_CTAS {
                return Err(format!(
                    "fused_ctas = Some({c}): use 1, 2, 4 or 8, or None to choose by the row"
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

/// The `Config` field that sizes `algo`'s landing zone, as an error
/// message names it (push_islands shares push_two_stage's), or
/// `max_bytes` for the algorithms without one.
pub fn zone_setting(algo: Algorithm) -> &'static str {
    match algo {
        Algorithm::Push => "push_max_bytes",
        Algorithm::PushLl => "push_ll_max_bytes",
        Algorithm::PushTwoStage | Algorithm::PushIslands => "push_two_stage_max_bytes",
        Algorithm::OneStage | Algorithm::TwoStage => "max_bytes",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thresholds::Band;

    /// Every setting an error message names exists: the zone errors name
    /// the field a user can set (issue 31: push_islands' message named a
    /// `Config::push_islands_max_bytes` that does not exist).
    #[test]
    fn zone_errors_name_real_config_fields() {
        let c = Config::default();
        for algo in Algorithm::ALL {
            let field = zone_setting(algo);
            let e = crate::Error::ZoneTooSmall {
                algorithm: algo,
                bytes: 1 << 30,
                capacity: 1 << 20,
                setting: field,
            }
            .to_string();
            assert!(e.contains(&format!("Config::{field} ")), "{algo:?}: {e}");
            // The field is real: the same value `zone_capacity` reads.
            let value = match field {
                "push_max_bytes" => c.push_max_bytes,
                "push_ll_max_bytes" => c.push_ll_max_bytes,
                "push_two_stage_max_bytes" => c.push_two_stage_max_bytes,
                "max_bytes" => c.max_bytes,
                other => panic!("{algo:?}: no Config field {other}"),
            };
            assert_eq!(
                c.zone_capacity(algo).unwrap_or(c.max_bytes),
                value,
                "{algo:?}"
            );
            assert!(!e.contains("push_islands_max_bytes"), "{e}");
        }
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
        // Landing zone too small for the message: the next band.
        let small = Config {
            push_ll_max_bytes: 1024,
            ..Config::default()
        };
        assert_eq!(pick(&small, 4096), Algorithm::OneStage);
        // A hand-made table moves the choice, and zone caps still hold.
        let mut t = Config {
            push_two_stage_max_bytes: 1 << 20,
            ..Config::default()
        };
        let bands = vec![
            Band {
                up_to: 8192,
                algorithm: Algorithm::Push,
            },
            Band {
                up_to: usize::MAX,
                algorithm: Algorithm::PushTwoStage,
            },
        ];
        t.thresholds
            .set_bands(Link::Pcie, 8, bands)
            .expect("valid bands");
        let pcie8 = |bytes| t.choose(AlgoChoice::Auto, bytes, 8, Link::Pcie);
        assert_eq!(pcie8(4096), Algorithm::Push);
        assert_eq!(pcie8(8193), Algorithm::PushTwoStage);
        assert_eq!(pcie8(1 << 20), Algorithm::PushTwoStage);
        assert_eq!(pcie8((1 << 20) + 16), Algorithm::TwoStage);
        assert_eq!(
            c.choose(AlgoChoice::PushLl, 1 << 30, 2, Link::Pcie),
            Algorithm::PushLl
        );
    }

    #[test]
    fn landing_zones_do_not_overlap() {
        let c = Config::default();
        for world in 1..=MAX_RANKS {
            let mut zones: Vec<(u64, u64)> = [
                Algorithm::Push,
                Algorithm::PushLl,
                Algorithm::PushTwoStage,
                Algorithm::PushIslands,
            ]
            .into_iter()
            .map(|a| {
                let (off, part) = c.landing(a, world);
                let slots = if matches!(a, Algorithm::PushTwoStage | Algorithm::PushIslands) {
                    1
                } else {
                    2
                };
                (off, off + slots * world as u64 * part)
            })
            .collect();
            zones.sort();
            assert_eq!(zones[0].0, Signal::LANDING_OFFSET as u64);
            for w in zones.windows(2) {
                assert!(w[0].1 <= w[1].0, "{zones:?}");
            }
            assert_eq!(
                zones[3].1,
                (Signal::LANDING_OFFSET + c.landing_bytes(world)) as u64
            );
            // Every message that fits has partitions that fit the part
            // (push_islands: per island, and a crossing partial of f32
            // bits fits the scatter and gather regions together).
            let cap_packs = (c.push_two_stage_max_bytes / PACK_BYTES) as u64;
            for (algo, parts) in [
                (Algorithm::PushTwoStage, world),
                (Algorithm::PushIslands, island_split(world)),
            ] {
                let part = PushTwoStagePart::from_part_bytes(c.landing(algo, world).1);
                let (s, e) = crate::device::reduce::partition(cap_packs, parts as u32, 0);
                assert!(e - s <= part.half);
                assert!(part.gather() + part.half * PACK_BYTES as u64 <= part.tail());
            }
        }
    }
}
