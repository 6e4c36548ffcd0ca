//! Unit tests of the thresholds table, its file format and the routing by size band.

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
fn table_json(world: usize, gpus: usize, link: &str, bands: &[(Option<u64>, String)]) -> String {
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
