//! Routing between our kernels and NCCL (issue 44): a pure function of the
//! table, the size, the element type and the mode.

use p2p_allreduce::abi::{Algorithm, Dtype};
use p2p_allreduce::thresholds::{
    file_bands, route, Backend, FileBand, Mode, Thresholds, ThresholdsFile, Timed, TunedTable,
    FORMAT, FORMAT_V1, NCCL_MUST_WIN_BY,
};
use p2p_allreduce::Link;
use proptest::prelude::*;
use proptest::sample::select;
use std::path::Path;

const GPU: &str = "NVIDIA RTX PRO 6000";

/// A sweep as `tune` measures it: distinct sizes (whole f32 elements),
/// ours always timed, NCCL and its symmetric kernels sometimes absent.
fn sweep() -> impl Strategy<Value = Vec<Timed>> {
    prop::collection::btree_map(
        1usize..(1 << 24),
        (
            select(Algorithm::ALL.to_vec()),
            1.0f64..100.0,
            prop::option::weighted(0.8, 1.0f64..100.0),
            prop::option::weighted(0.5, 1.0f64..100.0),
        ),
        1..24,
    )
    .prop_map(|m| {
        m.into_iter()
            .map(|(k, (algorithm, ours, nccl, sym))| Timed {
                size: k * 4,
                algorithm,
                ours_us: ours,
                nccl_us: nccl,
                nccl_symmetric_us: sym,
            })
            .collect()
    })
}

fn table_of(bands: Vec<FileBand>, format: &str, link: Link, world: usize) -> Thresholds {
    let file = ThresholdsFile {
        format: format.into(),
        tables: vec![TunedTable {
            gpu: GPU.into(),
            gpus: 8,
            links: vec![],
            link: p2p_allreduce::thresholds::link_label(link).into(),
            world,
            dtype: "bf16".into(),
            measured: "property test".into(),
            bands,
        }],
    };
    // Through the file's text, as a group reads it.
    let parsed = ThresholdsFile::parse(&file.to_json()).expect("tune's bands parse");
    Thresholds::default()
        .with_file_entry(&parsed, Path::new("t.json"), GPU, 8, link, world)
        .expect("valid")
        .expect("an entry for this machine")
}

fn time_of(t: &Timed, b: Backend) -> Option<f64> {
    match b {
        Backend::Ours => Some(t.ours_us),
        Backend::Nccl => t.nccl_us,
        Backend::NcclSymmetric => t.nccl_symmetric_us,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// At every measured size and element type, routing picks a
    /// measured backend that no other measured backend beat by more
    /// than the noise allowance, gives NCCL a size only where NCCL
    /// was faster than ours, and in deterministic mode always ours.
    #[test]
    fn routing_never_picks_a_backend_the_table_measured_slower(
        timed in sweep(),
        link in select(vec![Link::NvLink, Link::Pcie, Link::SameDevice]),
        world in 2usize..=8,
    ) {
        let t = table_of(file_bands(&timed).expect("bands"), FORMAT, link, world);
        for m in &timed {
            for dtype in Dtype::ALL {
                if m.size % dtype.size() != 0 {
                    continue;
                }
                let count = m.size / dtype.size();
                let b = route(&t, link, world, count, dtype, Mode::Fastest);
                let tb = time_of(m, b);
                prop_assert!(tb.is_some(), "{b:?} was not measured at {} B", m.size);
                let tb = tb.unwrap_or(f64::MAX);
                for other in Backend::ALL {
                    if let Some(to) = time_of(m, other) {
                        prop_assert!(
                            tb <= to * (1.0 + NCCL_MUST_WIN_BY) * (1.0 + 1e-12),
                            "{b:?} ({tb} us) picked at {} B, {other:?} took {to} us", m.size
                        );
                    }
                }
                if b.is_nccl() {
                    prop_assert!(tb < m.ours_us, "{b:?} {tb} us vs ours {} us", m.ours_us);
                }
                prop_assert_eq!(route(&t, link, world, count, dtype, Mode::Deterministic), Backend::Ours);
                // Our algorithm there is the one measured there.
                prop_assert_eq!(t.choose(p2p_allreduce::AlgoChoice::Auto, m.size, world, link), m.algorithm);
            }
        }
    }

    /// Every size, measured or not, up to usize::MAX, falls in exactly
    /// one band: the first whose limit holds it, the same for our
    /// algorithm and the winner; sizes between two measured sizes go
    /// where the larger one went.
    #[test]
    fn every_size_is_covered_by_one_band(
        timed in sweep(),
        probes in prop::collection::vec(any::<usize>(), 16),
        world in 2usize..=8,
    ) {
        let link = Link::Pcie;
        let t = table_of(file_bands(&timed).expect("bands"), FORMAT, link, world);
        let winners = t.winners(link, world);
        prop_assert_eq!(winners.last().map(|w| w.up_to), Some(usize::MAX));
        prop_assert!(winners.windows(2).all(|w| w[0].up_to < w[1].up_to));
        let merged = t.merged(link, world);
        prop_assert_eq!(merged.last().map(|m| m.0), Some(usize::MAX));
        let mut sorted = timed.clone();
        sorted.sort_by_key(|m| m.size);
        for bytes in probes.into_iter().chain([0, 1, usize::MAX]) {
            let holders: Vec<_> = merged
                .iter()
                .enumerate()
                .filter(|(i, m)| bytes <= m.0 && (*i == 0 || bytes > merged[i - 1].0))
                .collect();
            prop_assert_eq!(holders.len(), 1, "{} B", bytes);
            let (_, (_, algo, w)) = holders[0];
            prop_assert_eq!(t.winner(bytes, world, link), w.winner);
            prop_assert_eq!(t.choose(p2p_allreduce::AlgoChoice::Auto, bytes, world, link), *algo);
            // The next measured size at or above it decides (the last
            // measured size's band reaches beyond).
            let decider = sorted.iter().find(|m| m.size >= bytes).unwrap_or(&sorted[sorted.len() - 1]);
            prop_assert_eq!(w.winner, decider.winner().0, "{} B", bytes);
        }
    }

    /// Files of format 1 (our algorithm per band, no winner) load as
    /// they did: the same bands, every size ours.
    #[test]
    fn format_1_files_still_load(
        limits in prop::collection::btree_set(1u64..(1 << 40), 0..6),
        algos in prop::collection::vec(select(Algorithm::ALL.to_vec()), 7),
        probes in prop::collection::vec(any::<usize>(), 8),
    ) {
        let mut bands: Vec<FileBand> = limits
            .iter()
            .zip(&algos)
            .map(|(&u, a)| FileBand { up_to: Some(u), algorithm: a.name().into(), winner: None, margin: None })
            .collect();
        bands.push(FileBand { up_to: None, algorithm: algos[6].name().into(), winner: None, margin: None });
        let t = table_of(bands.clone(), FORMAT_V1, Link::NvLink, 4);
        prop_assert_eq!(t.bands(Link::NvLink, 4).len(), bands.len());
        for (b, f) in t.bands(Link::NvLink, 4).iter().zip(&bands) {
            prop_assert_eq!(b.algorithm.name(), f.algorithm.as_str());
            prop_assert_eq!(b.up_to as u64, f.up_to.unwrap_or(u64::MAX).min(usize::MAX as u64));
        }
        for bytes in probes {
            prop_assert_eq!(t.winner(bytes, 4, Link::NvLink), Backend::Ours);
            prop_assert_eq!(route(&t, Link::NvLink, 4, bytes, Dtype::F16, Mode::Fastest), Backend::Ours);
        }
    }
}
