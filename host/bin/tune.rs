//! `p2p-allreduce tune`: times every algorithm at every message size on
//! this machine and writes the thresholds file that `Auto` reads
//! (`p2p_allreduce::thresholds`).
//!
//! Real ranks (`--gpus`, two or more): for each world size w the first w
//! GPUs listed form a `PeerGroup`. Without `--gpus` and with one GPU:
//! virtual ranks on `--device` (Auto's same-device table). Each size's
//! fastest algorithm (median of CUDA-graph replays, every row validated
//! against the CPU reference) becomes a band.
//!
//! With real ranks, NCCL is timed in the same run, the same way (same
//! sizes, element type, graph replays and statistics): plain, and with
//! NCCL >= 2.27 on symmetric windows. Each band records who won it (ours,
//! `nccl`, `nccl_symmetric`) and by how much; NCCL takes a size only by
//! more than `thresholds::NCCL_MUST_WIN_BY`. `--no-nccl` leaves NCCL out
//! (every band ours).

use crate::bench::{self, BenchArgs, Row, AUTO_NCCL, NCCL, NCCL_SYMMETRIC};
use crate::{open_gpu, parse_dtype_arg, parse_size, parse_world_arg, NOTHING_RAN};
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::thresholds::{self, FileBand, ThresholdsFile, Timed, TunedTable};
use p2p_allreduce::{driver, topology, AlgoChoice, Link};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args, Debug, Clone)]
pub struct TuneArgs {
    /// Real ranks on these GPUs, e.g. `0,1`; world w uses the first w.
    /// Without it (one GPU): virtual ranks on `--device`.
    #[arg(long, value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// World sizes to tune [default: 2..=number of --gpus; virtual: 2,4,8].
    #[arg(long, value_delimiter = ',', value_parser = parse_world_arg)]
    pub world: Vec<usize>,
    /// GPU for virtual ranks.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Smallest message in bytes.
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = parse_size)]
    pub minbytes: usize,
    /// Largest message in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_size)]
    pub maxbytes: usize,
    /// Size factor from one measured size to the next.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub stepfactor: usize,
    /// Element type of the measurement (bands are in bytes).
    #[arg(short = 'd', long = "datatype", default_value = "bf16", value_parser = parse_dtype_arg)]
    pub datatype: Dtype,
    /// Timed graph replays per size and algorithm.
    #[arg(short = 'n', long = "iters", default_value_t = 25)]
    pub iters: usize,
    /// File to write [default: $P2P_ALLREDUCE_THRESHOLDS, else
    /// ~/.config/p2p-allreduce/thresholds.json]. Entries of other machines
    /// or worlds in it are kept.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Print the tables, write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Do not time NCCL (every band goes to our kernels).
    #[arg(long)]
    pub no_nccl: bool,
}

/// The algorithms `tune` compares (`Auto` is what it configures).
const CANDIDATES: [AlgoChoice; 6] = [
    AlgoChoice::OneStage,
    AlgoChoice::TwoStage,
    AlgoChoice::Push,
    AlgoChoice::PushLl,
    AlgoChoice::PushTwoStage,
    AlgoChoice::PushIslands,
];

fn usage(msg: &str) -> ExitCode {
    eprintln!("tune: {msg}");
    ExitCode::from(NOTHING_RAN)
}

pub fn run(args: &TuneArgs) -> ExitCode {
    let real = args.gpus.len() >= 2;
    if args.gpus.len() == 1 {
        return usage("--gpus needs two or more GPUs (or leave it out for virtual ranks)");
    }
    let worlds: Vec<usize> = if !args.world.is_empty() {
        args.world.clone()
    } else if real {
        (2..=args.gpus.len()).collect()
    } else {
        vec![2, 4, 8]
    };
    if let Some(w) = worlds
        .iter()
        .find(|&&w| w < 2 || (real && w > args.gpus.len()))
    {
        return usage(&format!(
            "world {w}: use 2..={} (one rank per listed GPU)",
            if real { args.gpus.len() } else { 8 }
        ));
    }
    let path = match (&args.out, thresholds::file_path()) {
        (Some(out), _) => out.clone(),
        (None, Some((default_path, _))) => default_path,
        (None, None) if args.dry_run => PathBuf::new(),
        (None, None) => {
            return usage(
                "no file to write: P2P_ALLREDUCE_THRESHOLDS is `none` and no --out was given",
            )
        }
    };
    tune_all(args, &worlds, real, path)
}

fn tune_all(args: &TuneArgs, worlds: &[usize], real: bool, path: PathBuf) -> ExitCode {
    let first = if real { args.gpus[0] } else { args.device };
    let ctx = match open_gpu("tune", first) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let gpu = match driver::device_info(&ctx) {
        Ok(i) => i.name,
        Err(e) => return usage(&e.to_string()),
    };
    let (count, links) = match link_matrix() {
        Ok(m) => m,
        Err(e) => return usage(&e.to_string()),
    };
    let mut file = if args.dry_run {
        ThresholdsFile::default()
    } else {
        match thresholds::read_file(&path, false) {
            Ok(f) => f.unwrap_or_default(),
            Err(e) => {
                return usage(&format!(
                    "{}: {e} (move it away, or pass --out for another file)",
                    path.display()
                ))
            }
        }
    };
    file.format = thresholds::FORMAT.into();
    for &world in worlds {
        let gpus: Vec<usize> = if real {
            args.gpus[..world].to_vec()
        } else {
            Vec::new()
        };
        let link = if real {
            match group_link(&gpus) {
                Ok(l) => l,
                Err(e) => return usage(&e),
            }
        } else {
            Link::SameDevice
        };
        let bench_args = BenchArgs {
            minbytes: args.minbytes,
            maxbytes: args.maxbytes,
            stepfactor: args.stepfactor,
            datatype: args.datatype,
            iters: args.iters,
            world: vec![world],
            algo: CANDIDATES.to_vec(),
            device: args.device,
            gpus,
            no_nccl: args.no_nccl,
            ..BenchArgs::default()
        };
        println!(
            "== tune: world {world} over {} ==",
            thresholds::link_label(link)
        );
        let rows = match bench::measure(&bench_args) {
            Ok(r) => r,
            Err(code) => return code,
        };
        let bands = match bands_from(&rows) {
            Some(b) => b,
            None => return usage("no row was measured"),
        };
        let table = TunedTable {
            gpu: gpu.clone(),
            gpus: count,
            links: links.clone(),
            link: thresholds::link_label(link).into(),
            world,
            dtype: args.datatype.name().into(),
            measured: format!(
                "{} by p2p-allreduce {} tune -b {} -e {} -f {} -d {} -n {}{}",
                today(),
                env!("CARGO_PKG_VERSION"),
                args.minbytes,
                args.maxbytes,
                args.stepfactor,
                args.datatype.name(),
                args.iters,
                if real {
                    format!(" --gpus {:?}", &args.gpus[..world])
                } else {
                    " (virtual ranks)".into()
                }
            ),
            bands,
        };
        print_table(&table);
        file.upsert(table);
    }
    if args.dry_run {
        println!("(--dry-run: nothing written)");
        return ExitCode::SUCCESS;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Err(e) = std::fs::create_dir_all(dir) {
            return usage(&format!("cannot create {}: {e}", dir.display()));
        }
    }
    match std::fs::write(&path, file.to_json() + "\n") {
        Ok(()) => {
            println!(
                "wrote {} ({} table(s)); groups created from now on use it (`p2p-allreduce info` shows the table in use)",
                path.display(),
                file.tables.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => usage(&format!("cannot write {}: {e}", path.display())),
    }
}

/// Within this fraction of the fastest time, the algorithm of the
/// previous size keeps the size: timing noise (about 1% between runs)
/// must not split a band (one-stage and two-stage differ by less than that
/// at 64 MiB on 2 x H200).
pub const KEEP_WITHIN: f64 = 0.02;

/// Our fastest algorithm at each measured size (the previous size's
/// algorithm where it is within [`KEEP_WITHIN`] of the fastest), with
/// NCCL's times at that size (rows `nccl` and `nccl_symmetric`), merged into
/// bands by [`thresholds::file_bands`]: a band ends at the last size its
/// algorithm and winner won, the last band has no end.
pub fn bands_from(rows: &[Row]) -> Option<Vec<FileBand>> {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let nccl_names = [NCCL, NCCL_SYMMETRIC];
    let mut timed: Vec<Timed> = Vec::new();
    let mut prev: Option<&'static str> = None;
    for s in sizes {
        let at = || rows.iter().filter(|r| r.size == s && r.time_us.is_finite());
        // Our algorithms' rows (not NCCL's, nor bench's auto+nccl).
        let ours = || {
            at().filter(|r| {
                !nccl_names.contains(&r.requested)
                    && r.requested != AUTO_NCCL
                    && thresholds::algorithm_by_name(r.algorithm).is_some()
            })
        };
        let nccl_time = |name: &str| at().find(|r| r.requested == name).map(|r| r.time_us);
        let Some(best) = ours().min_by(|a, b| a.time_us.total_cmp(&b.time_us)) else {
            continue;
        };
        let kept = prev.and_then(|prev| {
            ours().find(|r| r.algorithm == prev && r.time_us <= best.time_us * (1.0 + KEEP_WITHIN))
        });
        let pick = kept.unwrap_or(best);
        prev = Some(pick.algorithm);
        timed.push(Timed {
            size: s,
            algorithm: thresholds::algorithm_by_name(pick.algorithm)?,
            ours_us: pick.time_us,
            nccl_us: nccl_time(NCCL),
            nccl_symmetric_us: nccl_time(NCCL_SYMMETRIC),
        });
    }
    thresholds::file_bands(&timed)
}

fn print_table(t: &TunedTable) {
    println!("Auto for {} ranks of {} over {}:", t.world, t.gpu, t.link);
    println!("  {:<16} {:<16} {:>10}  sizes", "ours", "winner", "margin");
    for b in &t.bands {
        let up_to = b.up_to.map_or("and above".to_string(), |u| {
            format!("up to {}", crate::fmt_bytes(u))
        });
        let margin = b
            .margin
            .map_or("-".to_string(), |m| format!("{:+.1}%", m * 100.0));
        println!(
            "  {:<16} {:<16} {margin:>10}  {up_to}",
            b.algorithm,
            b.winner.as_deref().unwrap_or("ours"),
        );
    }
}

/// The slowest link between the listed GPUs, or why there is none.
fn group_link(gpus: &[usize]) -> Result<Link, String> {
    let ctxs = gpus
        .iter()
        .map(|&g| driver::open_device(g).map_err(|e| format!("GPU {g}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut link = Link::SameDevice;
    for a in &ctxs {
        for b in &ctxs {
            match topology::link_between(a, b) {
                Ok(Some(l)) => link = topology::slowest(link, l),
                Ok(None) => {
                    return Err(format!(
                        "GPUs {} and {} have no peer access",
                        a.ordinal(),
                        b.ordinal()
                    ))
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }
    Ok(link)
}

/// Every GPU of the machine and the link from each to each (the key of a
/// table, as `info` prints it).
fn link_matrix() -> p2p_allreduce::Result<(usize, Vec<Vec<String>>)> {
    let n = driver::device_count()?;
    let ctxs = (0..n)
        .map(driver::open_device)
        .collect::<p2p_allreduce::Result<Vec<_>>>()?;
    let mut m = Vec::with_capacity(n);
    for a in &ctxs {
        let mut row = Vec::with_capacity(n);
        for b in &ctxs {
            row.push(topology::link_name(topology::link_between(a, b)?).to_string());
        }
        m.push(row);
    }
    Ok((n, m))
}

/// Today's date (UTC), e.g. 2026-11-29.
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use p2p_allreduce::abi::Algorithm;

    fn row(size: usize, algorithm: &'static str, time_us: f64) -> Row {
        Row {
            size,
            count: size / 2,
            dtype: "bf16",
            world: 2,
            requested: algorithm,
            algorithm,
            time_us,
            min_us: time_us,
            max_us: time_us,
            algbw_gbps: 0.0,
            busbw_gbps: 0.0,
            wrong: Some(0),
        }
    }

    #[test]
    fn bands_follow_the_fastest_algorithm() {
        let rows = vec![
            row(4096, "push_ll", 2.0),
            row(4096, "one_stage", 3.0),
            row(8192, "push_ll", 2.5),
            row(8192, "one_stage", 3.0),
            row(16384, "push_ll", 4.0),
            row(16384, "one_stage", 3.5),
            row(32768, "two_stage", 5.0),
            row(32768, "one_stage", 6.0),
            // Within 2% of two-stage: no new band for noise.
            row(65536, "one_stage", 9.9),
            row(65536, "two_stage", 10.0),
        ];
        let b = bands_from(&rows).expect("bands");
        let got: Vec<(Option<u64>, &str)> =
            b.iter().map(|b| (b.up_to, b.algorithm.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (Some(8192), "push_ll"),
                (Some(16384), "one_stage"),
                (None, "two_stage")
            ]
        );
        // The bands are a valid table.
        let t = TunedTable {
            gpu: "x".into(),
            gpus: 2,
            links: vec![],
            link: "NVLink".into(),
            world: 2,
            dtype: "bf16".into(),
            measured: "test".into(),
            bands: b,
        };
        let bands = t.bands().expect("valid");
        assert_eq!(bands[0].algorithm, Algorithm::PushLl);
        assert!(bands_from(&[]).is_none());
    }

    #[test]
    fn nccl_rows_decide_the_winner_of_each_band() {
        let mut rows = vec![
            row(4096, "push_ll", 2.0),
            row(4096, NCCL, 9.0),
            row(8192, "push_ll", 3.0),
            row(8192, NCCL, 9.0),
            row(8192, NCCL_SYMMETRIC, 2.0),
            row(16384, "push_ll", 4.0),
            row(16384, NCCL, 3.0),
            // Within 2% of ours: ours keep it.
            row(32768, "one_stage", 5.0),
            row(32768, NCCL, 4.95),
        ];
        // bench's auto+nccl rows are not candidates.
        let mut auto = row(32768, "nccl", 1.0);
        auto.requested = AUTO_NCCL;
        rows.push(auto);
        let b = bands_from(&rows).expect("bands");
        let got: Vec<(Option<u64>, &str, Option<&str>)> = b
            .iter()
            .map(|b| (b.up_to, b.algorithm.as_str(), b.winner.as_deref()))
            .collect();
        assert_eq!(
            got,
            vec![
                (Some(4096), "push_ll", Some("ours")),
                (Some(8192), "push_ll", Some("nccl_symmetric")),
                (Some(16384), "push_ll", Some("nccl")),
                (None, "one_stage", Some("ours")),
            ]
        );
        // Margins (to 0.01%): 9/2 - 1 for ours at 4 KiB; 3/2 - 1 for the symmetric
        // kernels (plain NCCL's 9 is slower than ours' 3); 4/3 - 1 for NCCL.
        let m: Vec<f64> = b.iter().map(|b| b.margin.expect("measured")).collect();
        for (got, want) in m.iter().zip([3.5, 0.5, 1.0 / 3.0, 4.95 / 5.0 - 1.0]) {
            assert!((got - want).abs() <= 0.5e-4, "{m:?}");
        }
        // Without NCCL rows: every band ours, no margin.
        let ours: Vec<Row> = rows
            .into_iter()
            .filter(|r| {
                r.requested != NCCL && r.requested != NCCL_SYMMETRIC && r.requested != AUTO_NCCL
            })
            .collect();
        let b = bands_from(&ours).expect("bands");
        assert!(b
            .iter()
            .all(|b| b.winner.as_deref() == Some("ours") && b.margin.is_none()));
    }

    #[test]
    fn today_is_a_date() {
        let d = today();
        assert_eq!(d.len(), 10, "{d}");
        assert!(d.starts_with("20"), "{d}");
    }
}
