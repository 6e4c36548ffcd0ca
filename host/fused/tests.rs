//! Unit tests of the fused call's plan and shape checks.

use super::*;
use crate::abi::norm_reg_path_split;

fn plan(c: &Config, rows: usize, hidden: usize, choice: AlgoChoice) -> Result<NormPlan> {
    NormPlan::new(
        c,
        Dtype::Bf16,
        rows,
        hidden,
        2,
        Link::NvLink,
        choice,
        Inputs::Staged,
        1,
    )
}

#[test]
fn plans_take_whole_rows_and_refuse_what_cannot_run() {
    let c = Config::with_max_bytes(1 << 20);
    // Auto: push_ll, as the allreduce of the same bytes on two NVLink
    // GPUs (the built-in table), since the rows fit its zone.
    let p = plan(&c, 3, 7168, AlgoChoice::Auto).expect("plan");
    assert_eq!(p.algorithm, Algorithm::PushLl);
    assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 3)]);
    assert_eq!(p.blocks, 3);
    // Row chunks of what the staging buffers hold.
    let p = plan(&c, 300, 7168, AlgoChoice::TwoStage).expect("plan");
    let rows_per_step = (1 << 20) / (7168 * 2);
    assert_eq!(p.rows_per_step, rows_per_step);
    let steps: Vec<_> = p.steps().collect();
    assert_eq!(steps.iter().map(|s| s.1).sum::<usize>(), 300);
    assert!(steps.iter().all(|s| s.1 <= rows_per_step));
    // No rows: one launch of nothing.
    let p = plan(&c, 0, 7168, AlgoChoice::Auto).expect("plan");
    assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 0)]);
    assert!(matches!(
        plan(&c, 1, 0, AlgoChoice::Auto),
        Err(Error::NormShape(_))
    ));
    assert!(matches!(
        plan(&c, 1, NORM_MAX_HIDDEN + 1, AlgoChoice::Auto),
        Err(Error::NormShape(_))
    ));
    assert!(matches!(
        plan(&c, 1, 64, AlgoChoice::Push),
        Err(Error::NormAlgorithm(Algorithm::Push))
    ));
    // push_ll: chunks of what its landing zone holds.
    let p = plan(&c, 30, 7168, AlgoChoice::PushLl).expect("plan");
    assert_eq!(p.algorithm, Algorithm::PushLl);
    assert_eq!(p.rows_per_step, c.push_ll_max_bytes / (7168 * 2));
    assert_eq!(
        p.steps().map(|s| s.1).sum::<usize>(),
        30,
        "every row in some step"
    );
    // Rows beyond push_ll's zone: Auto falls back to the pull ones.
    let big = plan(&c, 64, 7168, AlgoChoice::Auto).expect("plan");
    assert_ne!(big.algorithm, Algorithm::PushLl);
    // One rank: no allreduce runs, and push_ll sends and waits for
    // nothing, so Auto takes it where the rows fit its zone and the
    // register path; else one-stage, as the allreduce.
    let one_rank = |rows, hidden| {
        NormPlan::new(
            &c,
            Dtype::Bf16,
            rows,
            hidden,
            1,
            Link::SameDevice,
            AlgoChoice::Auto,
            Inputs::Staged,
            1,
        )
        .expect("plan")
        .algorithm
    };
    assert_eq!(one_rank(3, 7168), Algorithm::PushLl);
    assert_eq!(one_rank(3, 7), Algorithm::OneStage, "off the register path");
    assert_eq!(one_rank(64, 7168), Algorithm::OneStage, "beyond the zone");
    let tiny = Config::with_max_bytes(256);
    assert!(matches!(
        plan(&tiny, 1, 4096, AlgoChoice::OneStage),
        Err(Error::MessageTooLarge { .. })
    ));
    let no_chunks = Config {
        chunking: false,
        ..Config::with_max_bytes(1 << 20)
    };
    assert!(matches!(
        plan(&no_chunks, 300, 7168, AlgoChoice::OneStage),
        Err(Error::MessageTooLarge { .. })
    ));
}

#[test]
fn push_ll_takes_register_path_rows_with_just_enough_warps() {
    let c = Config::with_max_bytes(1 << 20);
    let at = |dtype, hidden, choice| {
        NormPlan::new(
            &c,
            dtype,
            2,
            hidden,
            2,
            Link::NvLink,
            choice,
            Inputs::Staged,
            1,
        )
    };
    // 7168 bf16: 896 chunks, two per thread: 448 threads (14 warps).
    let p = at(Dtype::Bf16, 7168, AlgoChoice::PushLl).expect("plan");
    assert_eq!((p.algorithm, p.threads), (Algorithm::PushLl, 448));
    assert_eq!(
        at(Dtype::Bf16, 4096, AlgoChoice::Auto)
            .expect("plan")
            .threads,
        256
    );
    assert_eq!(
        at(Dtype::F16, 8, AlgoChoice::OneStage)
            .expect("plan")
            .threads,
        32
    );
    // f32: one chunk per thread.
    assert_eq!(
        at(Dtype::F32, 4096, AlgoChoice::TwoStage)
            .expect("plan")
            .threads,
        512
    );
    // Off the register path (not whole chunks, or more chunks than
    // the block holds): the configured block, and no push_ll.
    for (dtype, hidden) in [
        (Dtype::Bf16, 7),
        (Dtype::Bf16, 8200),
        (Dtype::F32, 4104),
        (Dtype::F32, 5120),
    ] {
        let p = at(dtype, hidden, AlgoChoice::Auto).expect("plan");
        assert_ne!(p.algorithm, Algorithm::PushLl, "{dtype:?} {hidden}");
        assert_eq!(p.threads, c.threads_per_block);
        let r = at(dtype, hidden, AlgoChoice::PushLl);
        assert!(
            matches!(r, Err(Error::NormPushLlShape { hidden: h, .. }) if h == hidden),
            "{dtype:?} {hidden}: {r:?}"
        );
        assert_eq!(
            at(dtype, hidden, AlgoChoice::OneStage)
                .expect("plan")
                .algorithm,
            Algorithm::OneStage
        );
    }
    // The largest register-path rows take push_ll.
    assert!(at(Dtype::Bf16, 8192, AlgoChoice::PushLl).is_ok());
    assert!(at(Dtype::F32, 4096, AlgoChoice::PushLl).is_ok());
}

#[test]
fn plan_threads_keep_register_path_rows_on_it() {
    // The kernel takes the register path with the launch's block
    // (`blockDim.x = plan.threads`), and the fused push_ll has no other:
    // whatever block the plan picks must keep a register-path row on it.
    for max in [32u32, 64, 96, 256, 512, 1024] {
        let c = Config {
            threads_per_block: max,
            ..Config::with_max_bytes(1 << 20)
        };
        for dtype in Dtype::ALL {
            for hidden in 0..=16_400usize {
                let p = NormPlan::new(
                    &c,
                    dtype,
                    1,
                    hidden.max(1),
                    2,
                    Link::NvLink,
                    AlgoChoice::OneStage,
                    Inputs::Staged,
                    1,
                )
                .expect("plan");
                let lanes = dtype.lanes();
                let on = norm_reg_path(lanes, p.hidden as u64, max as u64);
                assert!(p.threads % 32 == 0 && (32..=max).contains(&p.threads));
                if on {
                    assert!(
                        norm_reg_path(lanes, p.hidden as u64, p.threads as u64),
                        "{dtype:?} hidden {hidden}: {} threads leave the register path",
                        p.threads
                    );
                    // No more warps than the row's chunks need.
                    assert!(
                        p.threads == 32
                            || !norm_reg_path(lanes, p.hidden as u64, p.threads as u64 - 32)
                    );
                } else {
                    assert_eq!(p.threads, max, "{dtype:?} hidden {hidden}");
                }
            }
        }
    }
}

#[test]
fn push_ll_rows_split_over_clusters_where_blocks_are_spare() {
    let plan_on = |c: &Config, rows, hidden, link, clusters| {
        NormPlan::new(
            c,
            Dtype::Bf16,
            rows,
            hidden,
            2,
            link,
            AlgoChoice::PushLl,
            Inputs::Staged,
            if clusters { NORM_MAX_CTAS as u32 } else { 1 },
        )
        .expect("plan")
    };
    let c = Config::with_max_bytes(1 << 20);
    // 7168 bf16 (896 chunks) on NVLink (64 blocks): 8 CTAs of 128
    // chunks (the last one idle), 64 threads each.
    let p = plan_on(&c, 1, 7168, Link::NvLink, true);
    assert_eq!((p.ctas, p.blocks, p.threads), (8, 8, 64));
    let p = plan_on(&c, 8, 7168, Link::NvLink, true);
    assert_eq!((p.ctas, p.blocks), (8, 64));
    // Same device (16 blocks): fewer CTAs per row as rows grow, never 2.
    for (rows, ctas, blocks) in [(1, 8, 8), (2, 8, 16), (3, 4, 12), (4, 4, 16), (5, 1, 5)] {
        let p = plan_on(&c, rows, 7168, Link::SameDevice, true);
        assert_eq!((p.ctas, p.blocks), (ctas, blocks), "{rows} rows");
    }
    // Two ranks keep rows whole that 256 threads hold (4096 bf16);
    // more ranks split them, down to 32 chunks per CTA.
    assert_eq!(plan_on(&c, 1, 4096, Link::NvLink, true).ctas, 1);
    for (world, hidden, ctas) in [
        (4, 4096, 8),
        (8, 2048, 8),
        (8, 1024, 4),
        (8, 64, 1),
        (1, 7168, 1),
    ] {
        let p = NormPlan::new(
            &c,
            Dtype::Bf16,
            1,
            hidden,
            world,
            Link::NvLink,
            AlgoChoice::PushLl,
            Inputs::Staged,
            NORM_MAX_CTAS as u32,
        )
        .expect("plan");
        assert_eq!(p.ctas, ctas, "world {world} hidden {hidden}");
    }
    // f32 4096 (512 chunks, one per thread: 512 threads) splits at w2.
    let f32_row = NormPlan::new(
        &c,
        Dtype::F32,
        1,
        4096,
        2,
        Link::NvLink,
        AlgoChoice::PushLl,
        Inputs::Staged,
        NORM_MAX_CTAS as u32,
    )
    .expect("plan");
    assert_eq!(f32_row.ctas, 8);
    // No clusters, or another algorithm: one block per row.
    let p = plan_on(&c, 1, 7168, Link::NvLink, false);
    assert_eq!((p.ctas, p.blocks, p.threads), (1, 1, 448));
    let one = NormPlan::new(
        &c,
        Dtype::Bf16,
        1,
        7168,
        2,
        Link::NvLink,
        AlgoChoice::OneStage,
        Inputs::Staged,
        1,
    )
    .expect("plan");
    assert_eq!(one.ctas, 1);
    // Explicit: as asked, within the block cap.
    for k in [1u32, 2, 4, 8] {
        let c = Config {
            fused_ctas: Some(k),
            ..Config::with_max_bytes(1 << 20)
        };
        let p = plan_on(&c, 5, 8, Link::SameDevice, true);
        assert_eq!((p.ctas, p.blocks % k), (k, 0), "fused_ctas {k}");
        let capped = Config {
            max_blocks: Some(3),
            ..c.clone()
        };
        assert_eq!(plan_on(&capped, 1, 7168, Link::NvLink, true).ctas, k.min(2));
    }
    assert_eq!(
        split_ctas(None, 896, 2, 0, 2, 64, 8),
        8,
        "no rows: one launch of nothing"
    );
}

#[test]
fn split_plans_keep_every_cta_on_the_register_path() {
    // The kernel checks `norm_reg_path_split` with the launch's block
    // and cluster; whatever the plan picks must pass it.
    for k in [1u32, 2, 4, 8] {
        let c = Config {
            fused_ctas: Some(k),
            ..Config::with_max_bytes(1 << 20)
        };
        for dtype in Dtype::ALL {
            for hidden in (8..=8192usize).step_by(8) {
                let Ok(p) = NormPlan::new(
                    &c,
                    dtype,
                    1,
                    hidden,
                    2,
                    Link::NvLink,
                    AlgoChoice::PushLl,
                    Inputs::Staged,
                    NORM_MAX_CTAS as u32,
                ) else {
                    continue;
                };
                let lanes = dtype.lanes();
                let (t, ctas) = (p.threads as u64, p.ctas);
                assert!(
                    norm_reg_path_split(lanes, hidden as u64, t, ctas),
                    "{dtype:?} hidden {hidden} ctas {ctas}: {t} threads"
                );
                assert!(t == 32 || !norm_reg_path_split(lanes, hidden as u64, t - 32, ctas));
                assert_eq!(p.blocks % p.ctas, 0);
            }
        }
    }
}

#[test]
fn zero_copy_plans_are_one_launch() {
    let c = Config::with_max_bytes(1 << 20);
    let zc = |rows, choice| {
        NormPlan::new(
            &c,
            Dtype::Bf16,
            rows,
            7168,
            2,
            Link::NvLink,
            choice,
            Inputs::ZeroCopy,
            1,
        )
    };
    // One-stage reads the inputs where they are: any number of rows.
    let p = zc(300, AlgoChoice::OneStage).expect("plan");
    assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 300)]);
    assert_eq!(p.blocks, c.blocks_cap(Link::NvLink));
    // Two-stage needs the sums to fit the scratch.
    let fits = (1 << 20) / (7168 * 2);
    assert_eq!(
        zc(fits, AlgoChoice::TwoStage)
            .expect("plan")
            .steps()
            .count(),
        1
    );
    assert!(matches!(
        zc(fits + 1, AlgoChoice::TwoStage),
        Err(Error::ScratchTooSmall { .. })
    ));
    // push_ll needs the rows to fit its landing zone.
    let ll_fits = c.push_ll_max_bytes / (7168 * 2);
    assert_eq!(
        zc(ll_fits, AlgoChoice::PushLl)
            .expect("plan")
            .steps()
            .count(),
        1
    );
    assert!(matches!(
        zc(ll_fits + 1, AlgoChoice::PushLl),
        Err(Error::ZoneTooSmall {
            algorithm: Algorithm::PushLl,
            ..
        })
    ));
    assert_eq!(
        zc(0, AlgoChoice::Auto)
            .expect("plan")
            .steps()
            .collect::<Vec<_>>(),
        vec![(0, 0)]
    );
}

/// Issue 31: a zero-copy fused call under `Auto` whose rows exceed the
/// scratch ran into `ScratchTooSmall` where the table says two-stage;
/// it runs one-stage (one launch, the same bits), as the README and the
/// groups' docs promise. An explicit two-stage is still refused.
#[test]
fn auto_zero_copy_runs_one_stage_where_the_scratch_is_short() {
    let mut t = crate::thresholds::Thresholds::default();
    t.set_bands(
        Link::NvLink,
        2,
        vec![crate::thresholds::Band {
            up_to: usize::MAX,
            algorithm: Algorithm::TwoStage,
        }],
    )
    .expect("valid bands");
    let c = Config {
        thresholds: t,
        ..Config::with_max_bytes(64 << 10)
    };
    let zc = |rows, choice| {
        NormPlan::new(
            &c,
            Dtype::F32,
            rows,
            4096,
            2,
            Link::NvLink,
            choice,
            Inputs::ZeroCopy,
            1,
        )
    };
    // 64 x 4096 f32 = 1 MiB of rows, 64 KiB of scratch.
    let p = zc(64, AlgoChoice::Auto).expect("Auto must run, not refuse");
    assert_eq!(p.algorithm, Algorithm::OneStage);
    assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 64)]);
    // Rows that fit: two-stage, as the table says.
    assert_eq!(
        zc(4, AlgoChoice::Auto).expect("plan").algorithm,
        Algorithm::TwoStage
    );
    assert!(matches!(
        zc(64, AlgoChoice::TwoStage),
        Err(Error::ScratchTooSmall {
            bytes: 1_048_576,
            capacity: 65_536
        })
    ));
    // The other shape, with the built-in table and the default
    // config: 4096 x 8192 bf16 at world 8 (64 MiB > 32 MiB of scratch).
    let d = Config::default();
    for link in [Link::NvLink, Link::Pcie, Link::SameDevice] {
        let p = NormPlan::new(
            &d,
            Dtype::Bf16,
            4096,
            8192,
            8,
            link,
            AlgoChoice::Auto,
            Inputs::ZeroCopy,
            1,
        )
        .expect("Auto must run, not refuse");
        assert_ne!(p.algorithm, Algorithm::TwoStage, "{link:?}");
        assert_eq!(p.steps().count(), 1);
    }
}
