//! Unit tests of the soak: configurations, plan, checked passes and the
//! fused oracle.

use super::*;

#[test]
fn configs_cover_every_algorithm_and_size() {
    let a = SoakArgs::default();
    let c = configs(&a);
    // 4K, 16K, 64K, 256K, 1M, 4M, 8M: 7 sizes x 6 algorithms; 3 x 3 fused.
    assert_eq!(c.iter().filter(|c| !c.fused()).count(), 42);
    assert_eq!(c.iter().filter(|c| c.fused()).count(), 9);
    for algo in Algorithm::ALL {
        let sizes: Vec<usize> = c
            .iter()
            .filter_map(|c| match c.kind {
                Kind::Allreduce { algo: a, count } if a == algo => Some(count * 4),
                _ => None,
            })
            .collect();
        assert_eq!(
            sizes,
            vec![
                4 << 10,
                16 << 10,
                64 << 10,
                256 << 10,
                1 << 20,
                4 << 20,
                8 << 20
            ]
        );
    }
    let cfg = soak_config(&a);
    assert!(cfg.validate().is_ok());
    assert_eq!(cfg.push_ll_max_bytes, 8 << 20);
}

#[test]
fn plans_meet_the_targets_where_the_budget_allows() {
    let a = SoakArgs::default();
    let c = configs(&a);
    // 300 us per replay of 100 small calls, ~30 us per large call.
    let ms: Vec<f64> = c
        .iter()
        .map(|c| c.per_graph as f64 * (0.003 + c.count() as f64 * 4.0 / 3.0e12 * 1e3))
        .collect();
    let p = make_plan(&a, &c, &ms);
    let (ar, fu) = planned_calls(&c, &p, &a);
    assert!(ar >= a.allreduces && fu >= a.fused, "{ar} {fu}");
    assert!(p.estimate_s < a.budget, "{}", p.estimate_s);
    // Every batch holds at least MIN_BATCH_MS of replays.
    for (i, &n) in p.per_pass.iter().enumerate() {
        assert!(n as f64 * ms[i] >= MIN_BATCH_MS - 1e-9);
    }
    // A budget too small: every configuration still runs every pass,
    // the costly ones get fewer calls, and the plan says so.
    let tight = SoakArgs {
        budget: 1.0,
        ..SoakArgs::default()
    };
    let slow: Vec<f64> = ms.iter().map(|m| m * 1000.0).collect();
    let p = make_plan(&tight, &c, &slow);
    let (ar, _) = planned_calls(&c, &p, &tight);
    assert!(ar < tight.allreduces);
    assert!(p.per_pass.iter().all(|&n| n >= 1));
}

#[test]
fn checks_fall_on_the_first_and_last_pass() {
    assert_eq!(check_passes(10, 3), vec![0, 4, 9]);
    assert_eq!(check_passes(10, 2), vec![0, 9]);
    assert_eq!(check_passes(2, 2), vec![0, 1]);
}

#[test]
fn fused_oracle_chains_the_residual() {
    let x = vec![
        vec![1.0f32.to_bits(); HIDDEN],
        vec![2.0f32.to_bits(); HIDDEN],
    ];
    let res = vec![0.5f32.to_bits(); HIDDEN];
    let gam = vec![1.0f32.to_bits(); HIDDEN];
    let (normed, last) = fused_want(&x, &res, &gam, 3);
    assert_eq!(normed.len(), 3);
    // 0.5 + 3 three times.
    assert_eq!(f32::from_bits(last[0]), 9.5);
    assert!(normed.iter().all(|n| n.len() == HIDDEN));
}
