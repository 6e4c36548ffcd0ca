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

use crate::abi::{Algorithm, MAX_RANKS};
use crate::choice::{AlgoChoice, Link};
use serde::{Deserialize, Deserializer, Serialize};
use std::path::{Path, PathBuf};

/// The environment variable that names the thresholds file.
pub const ENV_VAR: &str = "P2P_ALLREDUCE_THRESHOLDS";
/// The `format` field of files this build reads and writes.
pub const FORMAT: &str = "p2p-allreduce-thresholds/1";

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thresholds {
    /// `bands[link][world]`: `up_to` strictly increasing, the last
    /// `usize::MAX`.
    bands: [[Vec<Band>; MAX_RANKS + 1]; 3],
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

    /// Where this table came from.
    pub fn origin(&self) -> &Origin {
        &self.origin
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
        let mut t = self.clone();
        t.bands[link_index(link)][world] = bands;
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

/// A band in a file: `up_to` null (or missing) means no limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileBand {
    pub up_to: Option<u64>,
    pub algorithm: String,
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
        if format != FORMAT {
            return Err(format!(
                "format {format:?}, this build reads {FORMAT:?}: run `p2p-allreduce tune` again"
            ));
        }
        let file: ThresholdsFile = from_json(text)?;
        for t in &file.tables {
            t.bands()?;
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
            },
            FileBand {
                up_to: None,
                algorithm: "push_two_stage".into(),
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
        }]);
        let e = ThresholdsFile::parse(&open_ended.to_json()).expect_err("no last band");
        assert!(e.contains("usize::MAX"), "{e}");
        let unknown = file_with(vec![FileBand {
            up_to: None,
            algorithm: "ring".into(),
        }]);
        let e = ThresholdsFile::parse(&unknown.to_json()).expect_err("unknown algorithm");
        assert!(e.contains("ring"), "{e}");
        let e = ThresholdsFile::parse("{\"format\":\"x\",\"tables\":[]}").expect_err("format");
        assert!(e.contains("tune"), "{e}");
        assert!(ThresholdsFile::parse("not json").is_err());
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
