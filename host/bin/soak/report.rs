//! The end of a run ([`finish`]): every rank's report judged
//! ([`Verdict`]: results, memory and handles flat, per-call times within
//! the tolerance, targets reached) and the summary printed.

use super::*;

/// Prints the table and the verdict (on the reporting rank) and returns
/// the exit code.
pub(super) fn finish(
    args: &SoakArgs,
    r: Result<(Vec<RankReport>, Plan, String)>,
    print: bool,
) -> ExitCode {
    let (reports, _plan, describe) = match r {
        Ok(x) => x,
        Err(e) => {
            println!("soak: FAILED to run: {e}");
            return ExitCode::FAILURE;
        }
    };
    let verdict = Verdict::of(args, &reports);
    if !print {
        return verdict.code();
    }
    let lead = &reports[0];
    println!();
    println!(
        "{:<34} {:>6} {:>8} {:>11} {:>9} {:>6} {:>10} {:>10} {:>8}",
        "configuration",
        "graph",
        "replays",
        "calls",
        "checked",
        "wrong",
        "us first",
        "us last",
        "drift"
    );
    for (k, c) in lead.configs.iter().enumerate() {
        let wrong: u64 = reports.iter().map(|r| r.configs[k].wrong).sum();
        let flag = if c.drift_pct.abs() > args.drift_pct {
            " !"
        } else {
            ""
        };
        println!(
            "{:<34} {:>6} {:>8} {:>11} {:>9} {:>6} {:>10.2} {:>10.2} {:>+7.2}%{flag}",
            c.name,
            c.per_graph,
            c.replays,
            c.calls,
            c.checked_calls,
            wrong,
            c.first_us,
            c.last_us,
            c.drift_pct
        );
        for r in &reports {
            if let Some(m) = &r.configs[k].first_mismatch {
                println!("    rank {}: first wrong element: {m}", r.rank);
            }
        }
    }
    println!();
    for line in verdict.lines(args, &reports, &describe) {
        println!("{line}");
    }
    if let Some(path) = &args.json {
        let json = verdict.json(args, &reports, &describe);
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        if path.as_os_str() == "-" {
            println!("{text}");
        } else if let Err(e) = std::fs::write(path, text + "\n") {
            println!("soak: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        } else {
            println!("soak: JSON summary written to {}", path.display());
        }
    }
    verdict.code()
}

/// The soak's findings against its requirements.
pub(super) struct Verdict {
    allreduces: u64,
    fused: u64,
    checked: u64,
    checked_elements: u64,
    wrong: u64,
    /// (config, drift %) of the worst configuration.
    worst: (String, f64),
    first_us: f64,
    last_us: f64,
    rss_growth: i64,
    device_growth: i64,
    handles_grew: bool,
    handles_left: bool,
    failures: Vec<String>,
}

impl Verdict {
    fn of(args: &SoakArgs, reports: &[RankReport]) -> Verdict {
        let lead = &reports[0];
        let sum = |f: &dyn Fn(&CfgResult) -> u64, fused: bool| -> u64 {
            lead.configs
                .iter()
                .filter(|c| (c.op == "fused") == fused)
                .map(f)
                .sum()
        };
        let allreduces = sum(&|c| c.calls, false);
        let fused = sum(&|c| c.calls, true);
        let checked = sum(&|c| c.checked_calls, false) + sum(&|c| c.checked_calls, true);
        let checked_elements: u64 = reports
            .iter()
            .flat_map(|r| &r.configs)
            .map(|c| c.checked_elements)
            .sum();
        let wrong: u64 = reports
            .iter()
            .flat_map(|r| &r.configs)
            .map(|c| c.wrong)
            .sum();
        let worst = lead
            .configs
            .iter()
            .map(|c| (c.name.clone(), c.drift_pct))
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap_or_default();
        // The time of one call of every configuration, added up.
        let first_us: f64 = lead.configs.iter().map(|c| c.first_us).sum();
        let last_us: f64 = lead.configs.iter().map(|c| c.last_us).sum();
        let growth = |f: &dyn Fn(&Snapshot) -> u64| -> i64 {
            reports
                .iter()
                .map(|r| f(&r.last_pass) as i64 - f(&r.first_pass) as i64)
                .max()
                .unwrap_or(0)
        };
        let rss_growth = growth(&|s| s.rss);
        let device_growth = growth(&|s| s.device_used);
        let handles_grew = reports
            .iter()
            .any(|r| r.last_pass.handles() != r.first_pass.handles());
        let handles_left = reports
            .iter()
            .any(|r| r.after_drop.handles() != r.baseline.handles());
        let mut failures = Vec::new();
        if wrong > 0 {
            failures.push(format!("{wrong} wrong elements"));
        }
        if allreduces < args.allreduces {
            failures.push(format!(
                "{allreduces} allreduces, short of the target {}: raise --budget",
                args.allreduces
            ));
        }
        if fused < args.fused {
            failures.push(format!(
                "{fused} fused calls, short of the target {}: raise --budget",
                args.fused
            ));
        }
        for c in &lead.configs {
            if c.drift_pct.abs() > args.drift_pct {
                failures.push(format!(
                    "{}: per-call time {:+.2}% from the first pass to the last (tolerance {}%)",
                    c.name, c.drift_pct, args.drift_pct
                ));
            }
        }
        if rss_growth > (args.rss_mib << 20) as i64 {
            failures.push(format!(
                "host RSS grew by {} from the first pass to the last (tolerance {} MiB)",
                fmt_signed(rss_growth),
                args.rss_mib
            ));
        }
        if device_growth > (args.device_mib << 20) as i64 {
            failures.push(format!(
                "device memory in use grew by {} (tolerance {} MiB)",
                fmt_signed(device_growth),
                args.device_mib
            ));
        }
        if handles_grew {
            failures.push(
                "the driver layer's handle counts changed between the first and the last pass"
                    .into(),
            );
        }
        if handles_left {
            failures.push("handles left after the group was dropped (see the handles line)".into());
        }
        Verdict {
            allreduces,
            fused,
            checked,
            checked_elements,
            wrong,
            worst,
            first_us,
            last_us,
            rss_growth,
            device_growth,
            handles_grew,
            handles_left,
            failures,
        }
    }

    fn code(&self) -> ExitCode {
        if self.failures.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    fn lines(&self, args: &SoakArgs, reports: &[RankReport], describe: &str) -> Vec<String> {
        let lead = &reports[0];
        let reached = |n: u64, t: u64| if n >= t { "reached" } else { "NOT reached" };
        let mut v = vec![
            format!("soak: {describe}"),
            format!(
                "calls: {} allreduces (target {}: {}), {} fused (target {}: {}); {} calls checked against the CPU oracle ({} output elements of every rank compared, outputs poisoned first), {} wrong",
                self.allreduces,
                args.allreduces,
                reached(self.allreduces, args.allreduces),
                self.fused,
                args.fused,
                reached(self.fused, args.fused),
                self.checked,
                self.checked_elements,
                self.wrong
            ),
            format!(
                "time per call, first pass vs last pass (rank 0): one call of every configuration {:.2} vs {:.2} us ({:+.2}%); worst configuration {} {:+.2}% (tolerance {}%)",
                self.first_us,
                self.last_us,
                (self.last_us / self.first_us - 1.0) * 100.0,
                self.worst.0,
                self.worst.1,
                args.drift_pct
            ),
        ];
        for r in reports {
            let who = if reports.len() > 1 {
                format!("rank {} ", r.rank)
            } else {
                String::new()
            };
            v.push(format!(
                "{who}host RSS: {} before the group, {} after the first pass, {} after the last ({}; tolerance {} MiB), {} after the drop",
                fmt_bytes(r.before_group.rss),
                fmt_bytes(r.first_pass.rss),
                fmt_bytes(r.last_pass.rss),
                fmt_signed(r.last_pass.rss as i64 - r.first_pass.rss as i64),
                args.rss_mib,
                fmt_bytes(r.after_drop.rss)
            ));
            v.push(format!(
                "{who}device memory in use: {} before the group, {} after the first pass, {} after the last ({}; tolerance {} MiB), {} after the drop",
                fmt_bytes(r.before_group.device_used),
                fmt_bytes(r.first_pass.device_used),
                fmt_bytes(r.last_pass.device_used),
                fmt_signed(r.last_pass.device_used as i64 - r.first_pass.device_used as i64),
                args.device_mib,
                fmt_bytes(r.after_drop.device_used)
            ));
            let h = |s: &Snapshot| {
                format!(
                    "{} device allocations, {} IPC mappings, {} pinned, {} events",
                    s.device_allocs, s.ipc_mappings, s.host_pinned, s.events
                )
            };
            v.push(format!(
                "{who}handles (driver layer): {} before; {} after the first pass; {} after the last; {} after the drop",
                h(&r.baseline),
                h(&r.first_pass),
                h(&r.last_pass),
                h(&r.after_drop)
            ));
        }
        v.push(format!(
            "timed passes {:.1} s (planned {:.1} s); whole run {:.1} s",
            lead.timed_s, lead.planned_s, lead.wall_s
        ));
        let _ = (
            self.rss_growth,
            self.device_growth,
            self.handles_grew,
            self.handles_left,
        );
        if self.failures.is_empty() {
            v.push("soak: PASS".into());
        } else {
            v.push(format!("soak: FAIL: {}", self.failures.join("; ")));
        }
        v
    }

    fn json(&self, args: &SoakArgs, reports: &[RankReport], describe: &str) -> serde_json::Value {
        serde_json::json!({
            "describe": describe,
            "procs": args.procs,
            "passes": args.passes,
            "budget_s": args.budget,
            "allreduces": {"calls": self.allreduces, "target": args.allreduces},
            "fused": {"calls": self.fused, "target": args.fused},
            "checked_calls": self.checked,
            "checked_elements": self.checked_elements,
            "wrong": self.wrong,
            "time": {
                "first_us_all_configs": self.first_us,
                "last_us_all_configs": self.last_us,
                "worst_config": self.worst.0,
                "worst_drift_pct": self.worst.1,
                "tolerance_pct": args.drift_pct,
            },
            "tolerances": {"rss_mib": args.rss_mib, "device_mib": args.device_mib},
            "ranks": reports,
            "pass": self.failures.is_empty(),
            "failures": self.failures,
        })
    }
}

pub(super) fn fmt_signed(b: i64) -> String {
    if b < 0 {
        format!("-{}", fmt_bytes(b.unsigned_abs()))
    } else {
        format!("+{}", fmt_bytes(b as u64))
    }
}
