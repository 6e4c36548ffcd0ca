//! How `Auto` picks an algorithm: a table of size bands per link and world
//! size ([`Thresholds`]), built in from our own measurements or loaded
//! from a thresholds file that `p2p-allreduce tune` wrote on the machine
//! it runs on ([`ThresholdsFile`]).
//!
//! Every algorithm gives identical bits, so a table moves speed, never
//! results; but every rank of a group must use the same table (they must
//! launch the same kernel), which `ProcessGroup::new` checks.
//!
//! Which file: the path in `P2P_ALLREDUCE_THRESHOLDS` if that is set
//! (`none` or empty: no file), else `$XDG_CONFIG_HOME/p2p-allreduce/thresholds.json`,
//! else `$HOME/.config/p2p-allreduce/thresholds.json`. A group created with
//! the built-in table looks there for a table of its GPU model, link and
//! world size; a group given a table of its own ([`Thresholds::set_bands`])
//! never does.
//!
//! Beside our algorithm, each band records which backend won it when
//! `tune` timed NCCL in the same run ([`Backend`]: ours, `nccl`,
//! `nccl_symmetric`) and by how much ([`WinnerBand`]). Where to send a
//! message is then a pure function of the table, its size, its element
//! type and the caller's [`Mode`]: [`route`]. The built-in table gives
//! every band to our kernels (on 2 x H200 they beat NCCL at every size,
//! docs/benchmarks.md).

use crate::abi::{Algorithm, Dtype, MAX_RANKS};
use crate::choice::{AlgoChoice, Link};
use std::path::{Path, PathBuf};

mod file;

pub use file::{file_bands, file_path, read_file, FileBand, ThresholdsFile, Timed, TunedTable};

/// The environment variable that names the thresholds file.
pub const ENV_VAR: &str = "P2P_ALLREDUCE_THRESHOLDS";
/// The `format` field of files this build writes: bands with the winner
/// among ours, `nccl` and `nccl_symmetric`, and its margin.
pub const FORMAT: &str = "p2p-allreduce-thresholds/2";
/// The format of files written before NCCL was measured (our algorithm per
/// band only): still read, every band ours.
pub const FORMAT_V1: &str = "p2p-allreduce-thresholds/1";
/// Formats this build reads.
pub const FORMATS_READ: [&str; 2] = [FORMAT_V1, FORMAT];

/// NCCL must beat our kernels by more than this fraction to take a size:
/// within it ours keep the size (timing noise is about 1% between runs,
/// and our bits are the same at every size while NCCL's are not).
pub const NCCL_MUST_WIN_BY: f64 = 0.02;

/// Who runs a message: our kernels, or NCCL (on plain buffers, or on
/// buffers in symmetric windows, NCCL >= 2.27).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    Ours,
    Nccl,
    NcclSymmetric,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Ours, Backend::Nccl, Backend::NcclSymmetric];
    /// The name in thresholds files and `info`: `ours`, `nccl`,
    /// `nccl_symmetric`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Ours => "ours",
            Backend::Nccl => "nccl",
            Backend::NcclSymmetric => "nccl_symmetric",
        }
    }
    /// The backend called `name`.
    pub fn by_name(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }
    /// Whether this is one of NCCL's.
    pub fn is_nccl(self) -> bool {
        self != Backend::Ours
    }
}

/// What the caller wants from routing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// The backend the table measured fastest for the size: NCCL where it
    /// won (its bits depend on its algorithm, channels and world; not the
    /// determinism contract), ours elsewhere.
    #[default]
    Fastest,
    /// Our kernels at every size: the same bits on every rank, for every
    /// algorithm, size and batch (docs/numerics.md).
    Deterministic,
}

/// Messages of at most `up_to` bytes (and more than the previous band's)
/// are won by `winner`, by `margin`: how much slower the best of the others
/// was, as a fraction (0.1: 10% slower), the smallest over the band's
/// measured sizes; negative where ours kept a size within
/// [`NCCL_MUST_WIN_BY`]; `None` where NCCL was not measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WinnerBand {
    pub up_to: usize,
    pub winner: Backend,
    pub margin: Option<f64>,
}

impl WinnerBand {
    /// One band, ours at every size, nothing measured.
    pub fn ours_everywhere() -> Vec<WinnerBand> {
        vec![WinnerBand {
            up_to: usize::MAX,
            winner: Backend::Ours,
            margin: None,
        }]
    }
}

/// Messages of at most `up_to` bytes (and more than the previous band's)
/// run `algorithm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Band {
    pub up_to: usize,
    pub algorithm: Algorithm,
}

/// Where a [`Thresholds`] table came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// This build's defaults (from the runs in docs/benchmarks.md).
    BuiltIn,
    /// A thresholds file; `table` describes the entry used.
    File { path: PathBuf, table: String },
    /// Set by the caller ([`Thresholds::set_bands`]).
    Custom,
}

/// `Auto`'s table: for each link and world size, bands of message sizes,
/// each with the algorithm that ran fastest there. A message of `b` bytes
/// runs the algorithm of the first band with `b <= up_to`; where that
/// algorithm needs a landing zone the message does not fit, the next band
/// whose algorithm fits is taken (two-stage if none).
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// `bands[link][world]`: `up_to` strictly increasing, the last
    /// `usize::MAX`.
    bands: [[Vec<Band>; MAX_RANKS + 1]; 3],
    /// `winners[link][world]`: who wins each size (same rules).
    winners: [[Vec<WinnerBand>; MAX_RANKS + 1]; 3],
    origin: Origin,
}

fn link_index(link: Link) -> usize {
    match link {
        Link::SameDevice => 0,
        Link::NvLink => 1,
        Link::Pcie => 2,
    }
}

const LINKS: [Link; 3] = [Link::SameDevice, Link::NvLink, Link::Pcie];

/// The table's name for a link (`info`, thresholds files).
pub fn link_label(link: Link) -> &'static str {
    match link {
        Link::SameDevice => "same",
        Link::NvLink => "NVLink",
        Link::Pcie => "PCIe",
    }
}

fn link_by_label(s: &str) -> Option<Link> {
    LINKS
        .into_iter()
        .find(|l| link_label(*l).eq_ignore_ascii_case(s))
}

/// The algorithm called `name` ([`Algorithm::name`]).
pub fn algorithm_by_name(name: &str) -> Option<Algorithm> {
    Algorithm::ALL.into_iter().find(|a| a.name() == name)
}

impl Default for Thresholds {
    fn default() -> Self {
        const K: usize = 1024;
        const M: usize = 1024 * 1024;
        // Where one-stage stops, per world size 0..=8 (0 and 1 unused).
        // Same device: the H200 virtual-rank bf16 sweep (docs/design/history.md):
        // one-stage is faster up to 8 MiB for N=2, 1 MiB for N=4 and
        // 256 KiB for N=8; odd world sizes interpolated.
        let same = [0, 0, 8 * M, 2 * M, M, M, 512 * K, 256 * K, 256 * K];
        // NVLink world 2 from the 2 x H200 sweep (one-stage ahead up to
        // 8 MiB); larger worlds are starting points in the spirit of the
        // published custom-allreduce tables.
        let nvlink = [0, 0, 8 * M, M, 512 * K, 512 * K, 256 * K, 256 * K, 256 * K];
        // On PCIe every one-stage rank pulls (N-1)x the message over a
        // shared bus. The push algorithms are not measured on PCIe yet:
        // `p2p-allreduce tune` measures them on the machine.
        let pcie = [
            0,
            0,
            512 * K,
            128 * K,
            64 * K,
            32 * K,
            32 * K,
            32 * K,
            32 * K,
        ];
        let pull = |one_stage_max: usize| {
            vec![
                Band {
                    up_to: one_stage_max,
                    algorithm: Algorithm::OneStage,
                },
                Band {
                    up_to: usize::MAX,
                    algorithm: Algorithm::TwoStage,
                },
            ]
        };
        let mut t = Thresholds {
            bands: Default::default(),
            // Ours everywhere: no measurement in docs/benchmarks.md has
            // NCCL ahead (2 x H200: Auto 2.2x..3.4x faster at 4 KiB, ahead
            // at every size to 64 MiB).
            winners: std::array::from_fn(|_| {
                std::array::from_fn(|_| WinnerBand::ours_everywhere())
            }),
            origin: Origin::BuiltIn,
        };
        for (l, maxes) in [same, nvlink, pcie].into_iter().enumerate() {
            for (world, &one_stage_max) in maxes.iter().enumerate() {
                t.bands[l][world] = if world < 2 {
                    // A copy, whatever the algorithm.
                    vec![Band {
                        up_to: usize::MAX,
                        algorithm: Algorithm::OneStage,
                    }]
                } else {
                    pull(one_stage_max)
                };
            }
        }
        // push_ll first on NVLink (2 x H200, PeerGroup: 2.87 us vs 4.07
        // one-stage at 4 KiB, 4.13 vs 4.54 at 128 KiB, behind from 256 KiB).
        // Never by default on one device (virtual ranks on one H200: behind
        // one-stage at N=4 and 8), nor on PCIe (not measured).
        for world in 2..=MAX_RANKS {
            t.bands[link_index(Link::NvLink)][world].insert(
                0,
                Band {
                    up_to: 128 * K,
                    algorithm: Algorithm::PushLl,
                },
            );
        }
        t
    }
}

impl Thresholds {
    /// The bands for `world` ranks over `link` (worlds past 8: those of 8).
    pub fn bands(&self, link: Link, world: usize) -> &[Band] {
        &self.bands[link_index(link)][world.min(MAX_RANKS)]
    }

    /// Who wins each size for `world` ranks over `link` (worlds past 8:
    /// those of 8).
    pub fn winners(&self, link: Link, world: usize) -> &[WinnerBand] {
        &self.winners[link_index(link)][world.min(MAX_RANKS)]
    }

    /// The backend the table measured fastest for a message of `bytes`
    /// bytes (ours for one rank: a copy).
    pub fn winner(&self, bytes: usize, world: usize, link: Link) -> Backend {
        if world < 2 {
            return Backend::Ours;
        }
        self.winners(link, world)
            .iter()
            .find(|b| bytes <= b.up_to)
            .map_or(Backend::Ours, |b| b.winner)
    }

    /// The table for `world` ranks over `link` as one list: each size band
    /// (at most `up_to` bytes, more than the previous) with our algorithm
    /// there and who wins it. The band limits are those of both lists.
    pub fn merged(&self, link: Link, world: usize) -> Vec<(usize, Algorithm, WinnerBand)> {
        let (bands, winners) = (self.bands(link, world), self.winners(link, world));
        let mut limits: Vec<usize> = bands
            .iter()
            .map(|b| b.up_to)
            .chain(winners.iter().map(|w| w.up_to))
            .collect();
        limits.sort_unstable();
        limits.dedup();
        limits
            .into_iter()
            .map(|up_to| {
                let algorithm = bands
                    .iter()
                    .find(|b| up_to <= b.up_to)
                    .map_or(Algorithm::TwoStage, |b| b.algorithm);
                let w = winners
                    .iter()
                    .find(|w| up_to <= w.up_to)
                    .copied()
                    .unwrap_or(WinnerBand {
                        up_to,
                        winner: Backend::Ours,
                        margin: None,
                    });
                (up_to, algorithm, WinnerBand { up_to, ..w })
            })
            .collect()
    }

    /// Where this table came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Replaces who wins each size for `world` (1..=8) ranks over `link`
    /// (rules of [`Thresholds::set_bands`]; a negative margin only with
    /// ours winning, and never below `-NCCL_MUST_WIN_BY`).
    pub fn set_winners(
        &mut self,
        link: Link,
        world: usize,
        winners: Vec<WinnerBand>,
    ) -> Result<(), String> {
        check_winners(&winners)?;
        if !(1..=MAX_RANKS).contains(&world) {
            return Err(format!("world {world}: use 1..={MAX_RANKS}"));
        }
        self.winners[link_index(link)][world] = winners;
        self.origin = Origin::Custom;
        Ok(())
    }

    /// Replaces the bands for `world` (1..=8) ranks over `link`. The bands
    /// must have strictly increasing `up_to`, the last `usize::MAX`; the
    /// error says what is wrong. The table is then the caller's: groups
    /// no longer look for a thresholds file.
    pub fn set_bands(&mut self, link: Link, world: usize, bands: Vec<Band>) -> Result<(), String> {
        check_bands(&bands)?;
        if !(1..=MAX_RANKS).contains(&world) {
            return Err(format!("world {world}: use 1..={MAX_RANKS}"));
        }
        self.bands[link_index(link)][world] = bands;
        self.origin = Origin::Custom;
        Ok(())
    }

    /// The algorithm for a message of `bytes` bytes: the explicit choice,
    /// or under `Auto` the first band that holds the message.
    pub fn choose(&self, choice: AlgoChoice, bytes: usize, world: usize, link: Link) -> Algorithm {
        self.choose_fitting(choice, bytes, world, link, |_| true)
    }

    /// [`Thresholds::choose`], where `Auto` takes only an algorithm for
    /// which `fits` holds (what fits the group's landing zones), trying
    /// the later bands in order, and two-stage if none fits.
    pub(crate) fn choose_fitting(
        &self,
        choice: AlgoChoice,
        bytes: usize,
        world: usize,
        link: Link,
        fits: impl Fn(Algorithm) -> bool,
    ) -> Algorithm {
        if let Some(explicit) = choice.explicit() {
            return explicit;
        }
        if world < 2 {
            return Algorithm::OneStage;
        }
        self.bands(link, world)
            .iter()
            .skip_while(|b| bytes > b.up_to)
            .map(|b| b.algorithm)
            .find(|a| fits(*a))
            .unwrap_or(Algorithm::TwoStage)
    }

    /// A fingerprint of the bands `Auto` uses for `world` ranks over
    /// `link`: ranks compare it so that they never pick different kernels.
    pub(crate) fn fingerprint(&self, link: Link, world: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for b in self.bands(link, world) {
            v.extend_from_slice(&(b.up_to as u64).to_le_bytes());
            v.push(b.algorithm as u8);
        }
        // Who runs each size too: ranks that routed one size differently
        // would wait for each other in two different collectives.
        v.push(0xff);
        for b in self.winners(link, world) {
            v.extend_from_slice(&(b.up_to as u64).to_le_bytes());
            v.push(b.winner as u8);
        }
        v
    }

    /// This table with the bands of the entry in `file` for a group of
    /// `world` ranks over `link` on GPUs named `gpu` (an exact match of
    /// the GPU count `gpus` preferred), or `None` if the file has none.
    pub fn with_file_entry(
        &self,
        file: &ThresholdsFile,
        path: &Path,
        gpu: &str,
        gpus: usize,
        link: Link,
        world: usize,
    ) -> Result<Option<Thresholds>, String> {
        if !(1..=MAX_RANKS).contains(&world) {
            return Err(format!("world {world}: use 1..={MAX_RANKS}"));
        }
        let matching = |e: &&TunedTable| {
            e.gpu == gpu && link_by_label(&e.link) == Some(link) && e.world == world
        };
        let entry = file
            .tables
            .iter()
            .filter(matching)
            .find(|e| e.gpus == gpus)
            .or_else(|| file.tables.iter().find(matching));
        let Some(e) = entry else {
            return Ok(None);
        };
        let bands = e.bands()?;
        let winners = e.winners()?;
        let mut t = self.clone();
        t.bands[link_index(link)][world] = bands;
        t.winners[link_index(link)][world] = winners;
        t.origin = Origin::File {
            path: path.to_path_buf(),
            table: format!(
                "{} x {}, {} ranks over {}, {}",
                e.gpus, e.gpu, e.world, e.link, e.measured
            ),
        };
        Ok(Some(t))
    }
}

fn check_bands(bands: &[Band]) -> Result<(), String> {
    if bands.is_empty() {
        return Err("no bands: give at least one, up to usize::MAX".into());
    }
    for w in bands.windows(2) {
        if w[0].up_to >= w[1].up_to {
            return Err(format!(
                "band limits must increase: {} then {}",
                w[0].up_to, w[1].up_to
            ));
        }
    }
    if bands[bands.len() - 1].up_to != usize::MAX {
        return Err("the last band must reach usize::MAX (null in a file)".into());
    }
    Ok(())
}

fn check_winners(bands: &[WinnerBand]) -> Result<(), String> {
    check_bands(
        &bands
            .iter()
            .map(|b| Band {
                up_to: b.up_to,
                algorithm: Algorithm::OneStage,
            })
            .collect::<Vec<_>>(),
    )?;
    for b in bands {
        match b.margin {
            Some(m) if !m.is_finite() => {
                return Err(format!(
                    "margin {m} of {}: use a finite number",
                    b.winner.name()
                ))
            }
            Some(m) if m < 0.0 && b.winner.is_nccl() => {
                return Err(format!(
                    "{} wins with margin {m}: NCCL takes a band only by a positive margin",
                    b.winner.name()
                ))
            }
            Some(m) if m < -NCCL_MUST_WIN_BY - 1e-9 => {
                return Err(format!(
                "ours win with margin {m}: ours keep a size only within {NCCL_MUST_WIN_BY} of NCCL"
            ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The backend for `count` elements of `dtype` in a group of `world` ranks
/// over `link`, by `table`, in `mode`: ours in [`Mode::Deterministic`] and
/// for one rank, else the band's measured winner ([`Thresholds::winner`];
/// the bands are in bytes, whatever element type was measured). A pure
/// function: every rank of a group (same table, which groups check) gets
/// the same answer for the same call.
pub fn route(
    table: &Thresholds,
    link: Link,
    world: usize,
    count: usize,
    dtype: Dtype,
    mode: Mode,
) -> Backend {
    match mode {
        Mode::Deterministic => Backend::Ours,
        Mode::Fastest => table.winner(count.saturating_mul(dtype.size()), world, link),
    }
}

/// The table `Auto` uses by default for `world` ranks over `link` on a
/// machine of `gpus` GPUs named `gpu`: the thresholds file's entry for it
/// if there is one, else the built-in table. A file that exists but cannot
/// be read or parsed is an error (also a missing file that
/// `P2P_ALLREDUCE_THRESHOLDS` names).
pub fn for_machine(gpu: &str, gpus: usize, link: Link, world: usize) -> crate::Result<Thresholds> {
    let built_in = Thresholds::default();
    let Some((path, required)) = file_path() else {
        return Ok(built_in);
    };
    let bad = |reason: String| crate::Error::ThresholdsFile {
        path: path.clone(),
        reason,
    };
    let Some(file) = read_file(&path, required).map_err(bad)? else {
        return Ok(built_in);
    };
    Ok(built_in
        .with_file_entry(&file, &path, gpu, gpus, link, world)
        .map_err(bad)?
        .unwrap_or(built_in))
}

/// Who wins each size as one line, e.g. `ours <= 64 KiB (by 12.0%),
/// nccl_symmetric <= 1048576 B (by 4.0%), ours`.
pub fn describe_winners(bands: &[WinnerBand]) -> String {
    bands
        .iter()
        .map(|b| {
            let by = b
                .margin
                .map_or(String::new(), |m| format!(" (by {:.1}%)", m * 100.0));
            if b.up_to == usize::MAX {
                format!("{}{by}", b.winner.name())
            } else {
                format!("{} <= {} B{by}", b.winner.name(), b.up_to)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A band list as one line, e.g. `push_ll <= 128 KiB, one_stage <= 8 MiB,
/// two_stage`.
pub fn describe_bands(bands: &[Band]) -> String {
    bands
        .iter()
        .map(|b| {
            if b.up_to == usize::MAX {
                b.algorithm.name().to_string()
            } else {
                format!("{} <= {} B", b.algorithm.name(), b.up_to)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests;
