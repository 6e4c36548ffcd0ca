//! The thresholds file: its format (serde, versions 1 and 2), where it is
//! found, and the file bands `tune` writes from its measurements.

use super::*;
use serde::{Deserialize, Deserializer, Serialize};

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
