//! The plan of a run from the calibration ([`make_plan`]): calls per pass
//! of every configuration, an equal share of the target calls unless the
//! time budget cannot hold them, and which passes are checked.

use super::*;

/// The plan every rank follows: timed replays per pass, and which passes
/// check, per configuration.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Plan {
    pub(super) per_pass: Vec<u64>,
    pub(super) estimate_s: f64,
}

/// The passes with a checked replay: the first, the last, and the others
/// spread between.
pub(super) fn check_passes(passes: u64, checks: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..checks)
        .map(|k| k * (passes - 1) / (checks - 1).max(1))
        .collect();
    v.dedup();
    v
}

/// Timed replays per pass for every configuration (see the module docs).
pub(super) fn make_plan(args: &SoakArgs, cfgs: &[Cfg], replay_ms: &[f64]) -> Plan {
    let passes = args.passes;
    let min_per_pass = |i: usize| ((MIN_BATCH_MS / replay_ms[i].max(1e-3)).ceil() as u64).max(1);
    let budget_ms = args.budget * 1000.0;
    let mut per_pass = vec![0u64; cfgs.len()];
    // Targets per class, equal shares.
    let classes = [(false, args.allreduces), (true, args.fused)];
    let class_cost = |fused: bool| -> f64 {
        let idx: Vec<usize> = (0..cfgs.len())
            .filter(|&i| cfgs[i].fused() == fused)
            .collect();
        let target = classes.iter().find(|c| c.0 == fused).map_or(0, |c| c.1);
        let each = target.div_ceil(idx.len().max(1) as u64);
        idx.iter()
            .map(|&i| each.div_ceil(cfgs[i].per_graph as u64) as f64 * replay_ms[i])
            .sum()
    };
    let total_cost = class_cost(false) + class_cost(true);
    for (fused, target) in classes {
        let idx: Vec<usize> = (0..cfgs.len())
            .filter(|&i| cfgs[i].fused() == fused)
            .collect();
        if idx.is_empty() {
            continue;
        }
        let each = target.div_ceil(idx.len() as u64);
        // This class's share of the budget.
        let share = if total_cost > budget_ms {
            budget_ms * class_cost(fused) / total_cost.max(1e-9)
        } else {
            f64::INFINITY
        };
        let fair = share / idx.len() as f64;
        let mut spare = 0.0;
        for &i in &idx {
            let want = each.div_ceil(cfgs[i].per_graph as u64);
            let afford = (fair / replay_ms[i]).floor() as u64;
            let replays = want.min(afford.max(passes));
            spare += fair - replays as f64 * replay_ms[i];
            per_pass[i] = replays.div_ceil(passes);
        }
        // Time left by the cheap ones goes to the costly ones still short.
        if spare.is_finite() && spare > 0.0 {
            for &i in &idx {
                let want = each.div_ceil(cfgs[i].per_graph as u64).div_ceil(passes);
                if per_pass[i] < want {
                    let more = ((spare / (replay_ms[i] * passes as f64)).floor() as u64)
                        .min(want - per_pass[i]);
                    per_pass[i] += more;
                    spare -= more as f64 * replay_ms[i] * passes as f64;
                }
            }
        }
    }
    for (i, p) in per_pass.iter_mut().enumerate() {
        *p = (*p).max(min_per_pass(i));
    }
    let estimate_s = per_pass
        .iter()
        .zip(replay_ms)
        .map(|(&n, &ms)| n as f64 * passes as f64 * ms)
        .sum::<f64>()
        / 1000.0;
    Plan {
        per_pass,
        estimate_s,
    }
}

/// Calls the plan runs: (allreduces, fused), with the calibration's and
/// the checks' replays.
pub(super) fn planned_calls(cfgs: &[Cfg], plan: &Plan, args: &SoakArgs) -> (u64, u64) {
    let checks = check_passes(args.passes, args.checks).len() as u64;
    let mut t = (0, 0);
    for (c, &n) in cfgs.iter().zip(&plan.per_pass) {
        let calls = (n * args.passes + CAL_REPLAYS + 1 + checks) * c.per_graph as u64;
        if c.fused() {
            t.1 += calls;
        } else {
            t.0 += calls;
        }
    }
    t
}
