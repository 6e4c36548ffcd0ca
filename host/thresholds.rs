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
use serde::{Deserialize, Deserializer, Serialize};
use std::path::{Path, PathBuf};

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
        // Same device: the H200 virtual-rank bf16 sweep (docs/design.md, history):
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

/// One measured size: the median microseconds of our best algorithm there
/// and of NCCL's two ways (`None`: not measured, e.g. NCCL absent, or its
/// symmetric windows with NCCL < 2.27).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    pub size: usize,
    pub algorithm: Algorithm,
    pub ours_us: f64,
    pub nccl_us: Option<f64>,
    pub nccl_symmetric_us: Option<f64>,
}

impl Timed {
    /// Who wins this size and by how much ([`WinnerBand::margin`]): the
    /// faster NCCL if it beats ours by more than [`NCCL_MUST_WIN_BY`],
    /// else ours.
    pub fn winner(&self) -> (Backend, Option<f64>) {
        let nccl = [
            (Backend::Nccl, self.nccl_us),
            (Backend::NcclSymmetric, self.nccl_symmetric_us),
        ]
        .into_iter()
        .filter_map(|(b, t)| t.filter(|t| t.is_finite()).map(|t| (b, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((best, t)) = nccl else {
            return (Backend::Ours, None);
        };
        if !self.ours_us.is_finite() {
            return (best, None);
        }
        if self.ours_us > t * (1.0 + NCCL_MUST_WIN_BY) {
            // The runner-up: ours, or the other NCCL.
            let other = [
                (Backend::Nccl, self.nccl_us),
                (Backend::NcclSymmetric, self.nccl_symmetric_us),
            ]
            .into_iter()
            .filter(|(b, _)| *b != best)
            .filter_map(|(_, x)| x.filter(|x| x.is_finite()))
            .fold(self.ours_us, f64::min);
            (best, Some(other / t - 1.0))
        } else {
            (Backend::Ours, Some(t / self.ours_us - 1.0))
        }
    }
}

/// The file bands of a measurement: a band per run of sizes with the same
/// algorithm and winner, ending at the last size of the run (the last band
/// open-ended), the margin the smallest over its sizes. `timed` in any
/// order; `None` if empty.
pub fn file_bands(timed: &[Timed]) -> Option<Vec<FileBand>> {
    let mut timed = timed.to_vec();
    timed.sort_by_key(|t| t.size);
    let mut bands: Vec<FileBand> = Vec::new();
    let mut prev: Option<(Algorithm, Backend)> = None;
    for t in &timed {
        let (winner, margin) = t.winner();
        let key = (t.algorithm, winner);
        match bands.last_mut() {
            Some(last) if prev == Some(key) => {
                last.up_to = Some(t.size as u64);
                last.margin = match (last.margin, margin) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            _ => bands.push(FileBand {
                up_to: Some(t.size as u64),
                algorithm: t.algorithm.name().into(),
                winner: Some(winner.name().into()),
                margin,
            }),
        }
        prev = Some(key);
    }
    let last = bands.last_mut()?;
    last.up_to = None;
    // Margins to 0.01%: more is noise, and the file stays readable.
    for b in &mut bands {
        b.margin = b.margin.map(|m| (m * 1e4).round() / 1e4);
    }
    Some(bands)
}

/// A thresholds file: what `p2p-allreduce tune` writes (JSON, the fields
/// below in this order; members a reader does not know are ignored).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ThresholdsFile {
    /// [`FORMAT`].
    pub format: String,
    pub tables: Vec<TunedTable>,
}

/// One measured table: the machine (GPU model, count, link matrix), the
/// group it was measured with (link, world), and its bands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TunedTable {
    /// The device name, as `cuDeviceGetName` gives it.
    pub gpu: String,
    /// GPUs visible on the machine when it was measured.
    pub gpus: usize,
    /// Link from GPU i (row) to GPU j, as `p2p-allreduce info` prints it
    /// (missing or `null` in a file: empty).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub links: Vec<Vec<String>>,
    /// The group's slowest link: "same", "NVLink" or "PCIe".
    pub link: String,
    pub world: usize,
    /// Element type of the measurement (the bands are in bytes).
    pub dtype: String,
    /// Free text: date, commit, command.
    pub measured: String,
    pub bands: Vec<FileBand>,
}

/// A band in a file: `up_to` null (or missing) means no limit;
/// `algorithm` is ours that ran fastest there, `winner` who won among
/// `ours`, `nccl` and `nccl_symmetric` (missing, as in format 1: ours),
/// `margin` by how much ([`WinnerBand::margin`]; missing: not measured).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileBand {
    pub up_to: Option<u64>,
    pub algorithm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f64>,
}

impl TunedTable {
    /// The table's bands, checked.
    pub fn bands(&self) -> Result<Vec<Band>, String> {
        let bands = self
            .bands
            .iter()
            .map(|b| {
                Ok(Band {
                    up_to: b
                        .up_to
                        .map_or(usize::MAX, |v| usize::try_from(v).unwrap_or(usize::MAX)),
                    algorithm: algorithm_by_name(&b.algorithm).ok_or_else(|| {
                        format!(
                            "unknown algorithm {:?} (use one of {})",
                            b.algorithm,
                            Algorithm::ALL.map(|a| a.name()).join(", ")
                        )
                    })?,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        check_bands(&bands).map_err(|e| {
            format!(
                "table for {} ranks of {} over {}: {e}",
                self.world, self.gpu, self.link
            )
        })?;
        Ok(bands)
    }
}

impl TunedTable {
    /// Who wins each band, checked (bands without a winner: ours).
    pub fn winners(&self) -> Result<Vec<WinnerBand>, String> {
        let bands = self
            .bands
            .iter()
            .map(|b| {
                let winner = match &b.winner {
                    None => Backend::Ours,
                    Some(w) => Backend::by_name(w).ok_or_else(|| {
                        format!(
                            "unknown winner {w:?} (use one of {})",
                            Backend::ALL.map(|b| b.name()).join(", ")
                        )
                    })?,
                };
                Ok(WinnerBand {
                    up_to: b
                        .up_to
                        .map_or(usize::MAX, |v| usize::try_from(v).unwrap_or(usize::MAX)),
                    winner,
                    margin: b.margin,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        check_winners(&bands).map_err(|e| {
            format!(
                "table for {} ranks of {} over {}: {e}",
                self.world, self.gpu, self.link
            )
        })?;
        Ok(bands)
    }
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<String>>, D::Error> {
    Option::deserialize(d).map(Option::unwrap_or_default)
}

/// `text` as a `T`. The error names the line and column, and the member
/// (e.g. `tables[0].gpus`) where it went wrong.
fn from_json<'de, T: Deserialize<'de>>(text: &'de str) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
        if e.is_syntax() || e.is_eof() {
            format!("invalid JSON: {e}")
        } else if path == "." {
            e.to_string()
        } else {
            format!("{path}: {e}")
        }
    })?;
    // Nothing but white space after the document.
    de.end().map_err(|e| format!("invalid JSON: {e}"))?;
    Ok(value)
}

impl ThresholdsFile {
    /// Reads a file's text; the error says what is wrong and where.
    pub fn parse(text: &str) -> Result<Self, String> {
        // The format first, so that a file of another format is refused
        // as such rather than by its first unknown member.
        #[derive(Deserialize)]
        #[serde(rename = "ThresholdsFile")]
        struct Format {
            format: String,
        }
        let Format { format } = from_json(text)?;
        if !FORMATS_READ.contains(&format.as_str()) {
            return Err(format!(
                "format {format:?}, this build reads {}: run `p2p-allreduce tune` again",
                FORMATS_READ.map(|f| format!("{f:?}")).join(" and ")
            ));
        }
        let mut file: ThresholdsFile = from_json(text)?;
        if format == FORMAT_V1 {
            // Format 1 knows no winner or margin: members it ignores.
            for b in file.tables.iter_mut().flat_map(|t| t.bands.iter_mut()) {
                (b.winner, b.margin) = (None, None);
            }
        }
        for t in &file.tables {
            t.bands()?;
            t.winners()?;
            if link_by_label(&t.link).is_none() {
                return Err(format!("link {:?}: use same, NVLink or PCIe", t.link));
            }
        }
        Ok(file)
    }
    /// The file's text (what `parse` reads back).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("strings, counts and lists always serialize")
    }
    /// Adds `table`, replacing an entry of the same GPU, count, link and
    /// world.
    pub fn upsert(&mut self, table: TunedTable) {
        self.tables.retain(|t| {
            !(t.gpu == table.gpu
                && t.gpus == table.gpus
                && t.link == table.link
                && t.world == table.world)
        });
        self.tables.push(table);
    }
}

/// The thresholds file to use, and whether the environment named it:
/// `None` when `P2P_ALLREDUCE_THRESHOLDS` is `none` or empty, or no
/// configuration directory is known.
pub fn file_path() -> Option<(PathBuf, bool)> {
    match std::env::var_os(ENV_VAR) {
        Some(v) if v.is_empty() || v == "none" => None,
        Some(v) => Some((PathBuf::from(v), true)),
        None => {
            let dir = std::env::var_os("XDG_CONFIG_HOME")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME")
                        .filter(|v| !v.is_empty())
                        .map(|h| PathBuf::from(h).join(".config"))
                })?;
            Some((dir.join("p2p-allreduce").join("thresholds.json"), false))
        }
    }
}

/// Reads the thresholds file at `path`: `Ok(None)` if it does not exist
/// and `required` is false.
pub fn read_file(path: &Path, required: bool) -> Result<Option<ThresholdsFile>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => ThresholdsFile::parse(&text).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(None),
        Err(e) => Err(e.to_string()),
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
mod tests {
    use super::*;

    fn band(up_to: usize, algorithm: Algorithm) -> Band {
        Band { up_to, algorithm }
    }

    #[test]
    fn auto_switches_at_the_band_limits() {
        let t = Thresholds::default();
        let th = t.bands(Link::SameDevice, 4)[0].up_to;
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
        assert_eq!(
            t.choose(AlgoChoice::Auto, 4096, 2, Link::NvLink),
            Algorithm::PushLl
        );
        assert_eq!(
            t.choose(AlgoChoice::Auto, (128 << 10) + 1, 2, Link::NvLink),
            Algorithm::OneStage
        );
    }

    #[test]
    fn bands_that_do_not_fit_pass_to_the_next() {
        let mut t = Thresholds::default();
        t.set_bands(
            Link::Pcie,
            8,
            vec![
                band(4096, Algorithm::PushLl),
                band(1 << 20, Algorithm::PushTwoStage),
                band(usize::MAX, Algorithm::TwoStage),
            ],
        )
        .expect("valid bands");
        assert_eq!(t.origin(), &Origin::Custom);
        let pick = |bytes, fits: fn(Algorithm) -> bool| {
            t.choose_fitting(AlgoChoice::Auto, bytes, 8, Link::Pcie, fits)
        };
        assert_eq!(pick(4096, |_| true), Algorithm::PushLl);
        assert_eq!(pick(4097, |_| true), Algorithm::PushTwoStage);
        assert_eq!(
            pick(100, |a| a != Algorithm::PushLl),
            Algorithm::PushTwoStage
        );
        assert_eq!(pick(100, |a| a == Algorithm::OneStage), Algorithm::TwoStage);
        assert!(t
            .set_bands(Link::Pcie, 8, vec![band(10, Algorithm::Push)])
            .is_err());
        assert!(t
            .set_bands(
                Link::Pcie,
                8,
                vec![band(10, Algorithm::Push), band(10, Algorithm::OneStage)]
            )
            .is_err());
    }

    fn file_with(bands: Vec<FileBand>) -> ThresholdsFile {
        ThresholdsFile {
            format: FORMAT.into(),
            tables: vec![TunedTable {
                gpu: "NVIDIA RTX PRO 6000".into(),
                gpus: 8,
                links: vec![],
                link: "PCIe".into(),
                world: 8,
                dtype: "bf16".into(),
                measured: "hand-made".into(),
                bands,
            }],
        }
    }

    #[test]
    fn a_hand_made_file_changes_autos_choice() {
        let file = file_with(vec![
            FileBand {
                up_to: Some(65536),
                algorithm: "push_ll".into(),
                winner: None,
                margin: None,
            },
            FileBand {
                up_to: None,
                algorithm: "push_two_stage".into(),
                winner: None,
                margin: None,
            },
        ]);
        let text = file.to_json();
        let parsed = ThresholdsFile::parse(&text).expect("round trip");
        assert_eq!(parsed, file);
        let base = Thresholds::default();
        assert_eq!(
            base.choose(AlgoChoice::Auto, 4096, 8, Link::Pcie),
            Algorithm::OneStage
        );
        let path = Path::new("/tmp/t.json");
        let t = base
            .with_file_entry(&parsed, path, "NVIDIA RTX PRO 6000", 8, Link::Pcie, 8)
            .expect("valid")
            .expect("entry for this machine");
        assert_eq!(
            t.choose(AlgoChoice::Auto, 4096, 8, Link::Pcie),
            Algorithm::PushLl
        );
        assert_eq!(
            t.choose(AlgoChoice::Auto, 1 << 30, 8, Link::Pcie),
            Algorithm::PushTwoStage
        );
        assert!(matches!(t.origin(), Origin::File { .. }));
        assert_ne!(
            t.fingerprint(Link::Pcie, 8),
            base.fingerprint(Link::Pcie, 8)
        );
        // Another GPU, link or world: no entry.
        for (gpu, link, world) in [
            ("NVIDIA H200", Link::Pcie, 8),
            ("NVIDIA RTX PRO 6000", Link::NvLink, 8),
            ("NVIDIA RTX PRO 6000", Link::Pcie, 4),
        ] {
            assert_eq!(
                base.with_file_entry(&parsed, path, gpu, 8, link, world),
                Ok(None)
            );
        }
    }

    #[test]
    fn bad_files_are_refused_with_a_reason() {
        let open_ended = file_with(vec![FileBand {
            up_to: Some(4096),
            algorithm: "push_ll".into(),
            winner: None,
            margin: None,
        }]);
        let e = ThresholdsFile::parse(&open_ended.to_json()).expect_err("no last band");
        assert!(e.contains("usize::MAX"), "{e}");
        let unknown = file_with(vec![FileBand {
            up_to: None,
            algorithm: "ring".into(),
            winner: None,
            margin: None,
        }]);
        let e = ThresholdsFile::parse(&unknown.to_json()).expect_err("unknown algorithm");
        assert!(e.contains("ring"), "{e}");
        let e = ThresholdsFile::parse("{\"format\":\"x\",\"tables\":[]}").expect_err("format");
        assert!(e.contains(FORMAT) && e.contains(FORMAT_V1), "{e}");
        assert!(e.contains("tune"), "{e}");
        assert!(ThresholdsFile::parse("not json").is_err());
    }

    use proptest::prelude::*;

    /// A file of one table with the given members, as JSON.
    fn table_json(
        world: usize,
        gpus: usize,
        link: &str,
        bands: &[(Option<u64>, String)],
    ) -> String {
        ThresholdsFile {
            format: FORMAT.into(),
            tables: vec![TunedTable {
                gpu: "NVIDIA H200".into(),
                gpus,
                links: vec![],
                link: link.into(),
                world,
                dtype: "bf16".into(),
                measured: "fuzz".into(),
                bands: bands
                    .iter()
                    .map(|(up_to, algorithm)| FileBand {
                        up_to: *up_to,
                        algorithm: algorithm.clone(),
                        winner: None,
                        margin: None,
                    })
                    .collect(),
            }],
        }
        .to_json()
    }

    fn algorithm_name() -> impl Strategy<Value = String> {
        prop_oneof![
            proptest::sample::select(Algorithm::ALL.map(|a| a.name().to_string()).to_vec()),
            "[a-z_]{0,12}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 1000,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Issue 48: any text is a file or a reason, never a panic.
        #[test]
        fn any_text_parses_or_says_why(text in prop_oneof![
            ".{0,200}",
            "[{}\\[\\]\":,0-9a-z_ -]{0,200}",
        ]) {
            let _ = ThresholdsFile::parse(&text);
        }

        /// Files of any world, GPU count, link and bands (limits of any
        /// size, in any order, unknown algorithms), cut anywhere: each is
        /// a table or a reason; a table that parses is used for any group
        /// asked about without a panic, and its choice (of two or more
        /// ranks) is one of its bands'.
        #[test]
        fn any_file_is_a_table_or_a_reason(
            world in prop_oneof![0usize..=MAX_RANKS + 2, any::<usize>()],
            gpus in any::<usize>(),
            link in prop_oneof![Just("NVLink".to_string()), Just("same".to_string()), "[A-Za-z]{0,6}"],
            bands in proptest::collection::vec(
                (proptest::option::of(prop_oneof![any::<u64>(), 0u64..(1 << 24)]), algorithm_name()),
                0..5,
            ),
            ask_world in prop_oneof![0usize..=MAX_RANKS + 2, any::<usize>()],
            ask_same in any::<bool>(),
            bytes in any::<usize>(),
            cut in any::<prop::sample::Index>(),
        ) {
            let text = table_json(world, gpus, &link, &bands);
            let cut_at = cut.index(text.len() + 1);
            if text.is_char_boundary(cut_at) {
                let got = ThresholdsFile::parse(&text[..cut_at]);
                prop_assert!(cut_at == text.len() || got.is_err(), "a cut file parsed");
            }
            let Ok(file) = ThresholdsFile::parse(&text) else { return Ok(()) };
            let ask_world = if ask_same { world } else { ask_world };
            let base = Thresholds::default();
            for l in LINKS {
                match base.with_file_entry(&file, Path::new("f.json"), "NVIDIA H200", gpus, l, ask_world) {
                    Ok(Some(t)) => {
                        // (A group of one rank copies: one-stage, whatever the table.)
                        let a = t.choose(AlgoChoice::Auto, bytes, ask_world, l);
                        prop_assert!(
                            ask_world < 2 || file.tables[0].bands.iter().any(|b| b.algorithm == a.name()),
                            "{:?} is none of the file's bands", a
                        );
                    }
                    Ok(None) => {}
                    Err(e) => prop_assert!(!e.is_empty()),
                }
            }
        }
    }

    fn timed(size: usize, ours: f64, nccl: Option<f64>, sym: Option<f64>) -> Timed {
        Timed {
            size,
            algorithm: Algorithm::OneStage,
            ours_us: ours,
            nccl_us: nccl,
            nccl_symmetric_us: sym,
        }
    }

    #[test]
    fn nccl_takes_a_size_only_by_more_than_the_noise() {
        // NCCL 10% faster: NCCL, by ours/nccl - 1.
        let (w, m) = timed(4096, 11.0, Some(10.0), None).winner();
        assert_eq!(w, Backend::Nccl);
        assert!((m.expect("measured") - 0.1).abs() < 1e-12);
        // Symmetric fastest, plain NCCL second: the margin is over the
        // runner-up (plain NCCL), not over ours.
        let (w, m) = timed(4096, 20.0, Some(11.0), Some(10.0)).winner();
        assert_eq!(w, Backend::NcclSymmetric);
        assert!((m.expect("measured") - 0.1).abs() < 1e-12);
        // Within NCCL_MUST_WIN_BY: ours, with a negative margin.
        let (w, m) = timed(4096, 10.1, Some(10.0), None).winner();
        assert_eq!(w, Backend::Ours);
        assert!(m.expect("measured") < 0.0);
        // Ours faster; NCCL unmeasured.
        assert_eq!(timed(4096, 5.0, Some(10.0), None).winner().0, Backend::Ours);
        assert_eq!(timed(4096, 5.0, None, None).winner(), (Backend::Ours, None));
    }

    #[test]
    fn file_bands_split_where_the_algorithm_or_the_winner_changes() {
        let mut t = vec![
            timed(4096, 3.0, Some(9.0), None),
            timed(8192, 3.0, Some(9.0), None),
            timed(16384, 12.0, Some(10.0), Some(9.0)),
            timed(32768, 12.0, Some(10.0), Some(11.0)),
            timed(65536, 12.0, Some(10.0), None),
        ];
        t[1].algorithm = Algorithm::PushLl;
        // Unsorted input is sorted.
        t.swap(0, 4);
        let bands = file_bands(&t).expect("bands");
        let got: Vec<(Option<u64>, &str, Option<&str>)> = bands
            .iter()
            .map(|b| (b.up_to, b.algorithm.as_str(), b.winner.as_deref()))
            .collect();
        assert_eq!(
            got,
            vec![
                (Some(4096), "one_stage", Some("ours")),
                (Some(8192), "push_ll", Some("ours")),
                (Some(16384), "one_stage", Some("nccl_symmetric")),
                (None, "one_stage", Some("nccl")),
            ]
        );
        // The margin is the band's smallest: 11/10 - 1 at 32 KiB (the
        // symmetric runner-up), not 12/10 - 1 at 64 KiB.
        assert!((bands[3].margin.expect("measured") - 0.1).abs() < 1e-12);
        assert!(file_bands(&[]).is_none());
        // A file of them routes as measured.
        let mut file = file_with(bands);
        file.tables[0].world = 2;
        let parsed = ThresholdsFile::parse(&file.to_json()).expect("round trip");
        assert_eq!(parsed, file);
        let table = Thresholds::default()
            .with_file_entry(
                &parsed,
                Path::new("t.json"),
                "NVIDIA RTX PRO 6000",
                8,
                Link::Pcie,
                2,
            )
            .expect("valid")
            .expect("entry");
        let r = |bytes: usize| route(&table, Link::Pcie, 2, bytes / 2, Dtype::Bf16, Mode::Fastest);
        assert_eq!(r(4096), Backend::Ours);
        assert_eq!(r(16384), Backend::NcclSymmetric);
        assert_eq!(r(16386), Backend::Nccl);
        assert_eq!(r(1 << 30), Backend::Nccl);
        for bytes in [4096, 16384, 1 << 30] {
            assert_eq!(
                route(
                    &table,
                    Link::Pcie,
                    2,
                    bytes / 2,
                    Dtype::Bf16,
                    Mode::Deterministic
                ),
                Backend::Ours
            );
        }
        // One rank is a copy: ours.
        assert_eq!(
            route(&table, Link::Pcie, 1, 1 << 20, Dtype::F32, Mode::Fastest),
            Backend::Ours
        );
        // The routing is part of what ranks compare.
        assert_ne!(
            table.fingerprint(Link::Pcie, 2),
            Thresholds::default().fingerprint(Link::Pcie, 2)
        );
        // Bad winners and margins are refused with a reason.
        for (winner, margin, want) in [
            ("ring", None, "ring"),
            ("nccl", Some(-0.5), "positive margin"),
            ("ours", Some(-0.5), "within"),
        ] {
            let mut f = file.clone();
            f.tables[0].bands[0].winner = Some(winner.into());
            f.tables[0].bands[0].margin = margin;
            let e = ThresholdsFile::parse(&f.to_json()).expect_err(want);
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn the_built_in_table_gives_nccl_nothing() {
        let t = Thresholds::default();
        for link in LINKS {
            for world in 1..=MAX_RANKS {
                assert_eq!(t.winners(link, world), WinnerBand::ours_everywhere());
                for bytes in [0, 4096, 1 << 20, usize::MAX] {
                    assert_eq!(t.winner(bytes, world, link), Backend::Ours);
                }
            }
        }
    }

    /// A file that is not UTF-8 is a reason, not a panic.
    #[test]
    fn a_file_of_bytes_that_are_not_text_is_a_reason() {
        let dir = std::env::temp_dir().join(format!("p2p-ar-thr-bytes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("thresholds.json");
        std::fs::write(&path, [0xff, 0xfe, b'{', 0x80]).expect("write");
        assert!(read_file(&path, true).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file as the hand-written writer before serde laid it out.
    const OLD_LAYOUT: &str = r#"{
  "format": "p2p-allreduce-thresholds/1",
  "tables": [
    {
      "gpu": "NVIDIA H200",
      "gpus": 2,
      "links": [["same", "NVLink"], ["NVLink", "same"]],
      "link": "NVLink",
      "world": 2,
      "dtype": "bf16",
      "measured": "2026-11-29, aa0a5a0, tune --gpus 0,1",
      "bands": [
      {"up_to": 131072, "algorithm": "push_ll"},
      {"up_to": null, "algorithm": "one_stage"}
      ]
    }
  ]
}"#;

    /// A file exactly as `tune` wrote it before NCCL was measured (format
    /// 1, serde's layout): it still loads, every band ours.
    const FORMAT_1_FILE: &str = r#"{
  "format": "p2p-allreduce-thresholds/1",
  "tables": [
    {
      "gpu": "NVIDIA H200",
      "gpus": 2,
      "links": [
        [
          "same",
          "NVLink"
        ],
        [
          "NVLink",
          "same"
        ]
      ],
      "link": "NVLink",
      "world": 2,
      "dtype": "bf16",
      "measured": "2026-12-01 by p2p-allreduce 0.1.0 tune -b 4096 -e 67108864 -f 2 -d bf16 -n 25 --gpus [0, 1]",
      "bands": [
        {
          "up_to": 131072,
          "algorithm": "push_ll"
        },
        {
          "up_to": 8388608,
          "algorithm": "one_stage"
        },
        {
          "up_to": null,
          "algorithm": "two_stage"
        }
      ]
    }
  ]
}
"#;

    #[test]
    fn files_of_format_1_still_load_with_every_band_ours() {
        let file = ThresholdsFile::parse(FORMAT_1_FILE).expect("format 1");
        assert_eq!(file.format, FORMAT_V1);
        let t = Thresholds::default()
            .with_file_entry(
                &file,
                Path::new("old.json"),
                "NVIDIA H200",
                2,
                Link::NvLink,
                2,
            )
            .expect("valid")
            .expect("entry");
        assert_eq!(
            describe_bands(t.bands(Link::NvLink, 2)),
            "push_ll <= 131072 B, one_stage <= 8388608 B, two_stage"
        );
        for bytes in [4096, 1 << 20, 1 << 30] {
            assert_eq!(t.winner(bytes, 2, Link::NvLink), Backend::Ours);
        }
        assert_eq!(
            describe_winners(t.winners(Link::NvLink, 2)),
            "ours <= 131072 B, ours <= 8388608 B, ours"
        );
        // Members format 1 did not know are ignored in a format-1 file.
        let with_winner = FORMAT_1_FILE.replace(
            r#""algorithm": "push_ll""#,
            r#""algorithm": "push_ll", "winner": "nccl", "margin": 0.5"#,
        );
        let f = ThresholdsFile::parse(&with_winner).expect("format 1 with unknown members");
        assert_eq!(
            f.tables[0].winners().expect("winners")[0].winner,
            Backend::Ours
        );
        // Rewritten, it is format 2 and reads back the same.
        let mut up = file.clone();
        up.format = FORMAT.into();
        assert_eq!(ThresholdsFile::parse(&up.to_json()), Ok(up));
    }

    #[test]
    fn old_files_read_and_malformed_ones_name_the_line_and_member() {
        let file = ThresholdsFile::parse(OLD_LAYOUT).expect("old layout");
        let t = &file.tables[0];
        assert_eq!((t.gpu.as_str(), t.gpus, t.world), ("NVIDIA H200", 2, 2));
        assert_eq!(t.links[0], ["same", "NVLink"]);
        assert_eq!(t.bands[0].up_to, Some(131072));
        assert_eq!(t.bands[1].up_to, None);
        assert_eq!(ThresholdsFile::parse(&file.to_json()), Ok(file.clone()));
        // Without the optional members (links, a last band's up_to), and
        // with members this build does not know.
        let lean = OLD_LAYOUT
            .replace(
                r#""links": [["same", "NVLink"], ["NVLink", "same"]],"#,
                r#""note": 1,"#,
            )
            .replace(r#""up_to": null, "#, "");
        let parsed = ThresholdsFile::parse(&lean).expect("optional members");
        assert!(parsed.tables[0].links.is_empty());
        assert_eq!(parsed.tables[0].bands, file.tables[0].bands);
        // A wrong type, a missing member, broken syntax, trailing text.
        for (text, want) in [
            (
                OLD_LAYOUT.replace(r#""gpus": 2"#, r#""gpus": "2""#),
                ["line 6", "tables[0].gpus"],
            ),
            (
                OLD_LAYOUT.replace(r#""up_to": 131072"#, r#""up_to": -1"#),
                ["line 13", "tables[0].bands[0].up_to"],
            ),
            (
                OLD_LAYOUT.replace(r#""dtype": "bf16","#, ""),
                ["line 16", "missing field `dtype`"],
            ),
            (
                OLD_LAYOUT.replace(r#""world": 2,"#, r#""world": 2"#),
                ["line 10", "invalid JSON"],
            ),
            (OLD_LAYOUT.to_string() + " x", ["line 18", "invalid JSON"]),
        ] {
            let e = ThresholdsFile::parse(&text).expect_err(want[1]);
            for w in want {
                assert!(e.contains(w), "{e:?} lacks {w:?}");
            }
        }
    }
}
