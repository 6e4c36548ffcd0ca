//! Unit tests of the communicator: its id, the thread gather, the routing and the CPU-side checks.

use super::gather::{mismatch, share};
use super::route::{unserved, Unserved};
use super::*;

#[test]
fn an_id_names_a_fresh_private_directory_and_round_trips_through_its_bytes() {
    let a = Id::new().unwrap();
    let b = Id::new().unwrap();
    assert_ne!(a, b, "every id is a fresh directory");
    let dir = a.dir().unwrap();
    assert!(dir.is_dir(), "{dir:?}");
    assert!(dir.starts_with(std::env::temp_dir()), "{dir:?}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
    }
    // As an engine passes it: internal() -> another rank -> uninit().
    let back = Id::uninit(*a.internal());
    assert_eq!(back, a);
    assert_eq!(back.dir().unwrap(), dir);
    // And through a file of bytes (mistral.rs's shape).
    let file = dir.join("id");
    std::fs::write(&file, a.to_bytes()).unwrap();
    let read: [u8; ID_BYTES] = std::fs::read(&file).unwrap().try_into().unwrap();
    assert_eq!(Id::from_bytes(read).dir().unwrap(), dir);
    assert!(format!("{a:?}").contains(&*dir.to_string_lossy()));
    for d in [a.dir().unwrap(), b.dir().unwrap()] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn an_id_holds_a_path_of_up_to_its_room_and_refuses_a_longer_or_relative_one() {
    let longest = format!("/{}", "d".repeat(ID_MAX_PATH - 1));
    let id = Id::for_dir(Path::new(&longest)).unwrap();
    assert_eq!(id.dir().unwrap(), PathBuf::from(&longest));
    let too_long = format!("/{}", "d".repeat(ID_MAX_PATH));
    assert!(matches!(
        Id::for_dir(Path::new(&too_long)),
        Err(Error::CommId { reason }) if reason.contains("TMPDIR")
    ));
    assert!(matches!(
        Id::for_dir(Path::new("relative/dir")),
        Err(Error::CommId { .. })
    ));
}

#[test]
fn bytes_that_are_not_an_id_are_a_typed_error() {
    let good = Id::for_dir(Path::new("/tmp/x")).unwrap().to_bytes();
    // An NCCL id (random bytes), all zeros, a bad length, junk after the
    // path, a relative path.
    let mut nccl = [0u8; ID_BYTES];
    for (i, b) in nccl.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37).wrapping_add(11);
    }
    let mut bad_len = good;
    bad_len[8] = (ID_MAX_PATH + 1) as u8;
    let mut zero_len = good;
    zero_len[8] = 0;
    let mut junk = good;
    junk[ID_BYTES - 1] = 1;
    let mut relative = good;
    relative[9] = b'x';
    for (what, b) in [
        ("nccl", nccl),
        ("zeros", [0; ID_BYTES]),
        ("length", bad_len),
        ("empty", zero_len),
        ("junk", junk),
        ("relative", relative),
    ] {
        let e = Id::from_bytes(b).dir().unwrap_err();
        assert!(matches!(e, Error::CommId { .. }), "{what}: {e:?}");
        assert!(e.to_string().contains("Id::new()"), "{what}: {e}");
    }
    assert!(format!("{:?}", Id::from_bytes(nccl)).contains("not an id"));
}

#[test]
fn sums_of_kernel_types_go_to_the_kernels_and_the_rest_to_nccl() {
    assert_eq!(
        route::<f32>(ReduceOp::Sum, |_| false),
        Engine::Kernels(Dtype::F32)
    );
    assert_eq!(
        route::<half::f16>(ReduceOp::Sum, |_| false),
        Engine::Kernels(Dtype::F16)
    );
    assert_eq!(
        route::<half::bf16>(ReduceOp::Sum, |_| false),
        Engine::Kernels(Dtype::Bf16)
    );
    for op in [ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
        assert_eq!(
            route::<half::bf16>(op, |_| false),
            Engine::Nccl(Unserved::Op(op))
        );
        assert_eq!(route::<i32>(op, |_| false), Engine::Nccl(Unserved::Op(op)));
    }
    assert_eq!(
        route::<f64>(ReduceOp::Sum, |_| false),
        Engine::Nccl(Unserved::Type("f64"))
    );
    assert_eq!(
        route::<u8>(ReduceOp::Sum, |_| false),
        Engine::Nccl(Unserved::Type("u8"))
    );
}

/// Issue 44's table: a size it gives to NCCL goes to the NCCL fallback,
/// asked only for what the kernels could serve, with the kernels' dtype.
#[test]
fn sizes_the_table_gives_to_nccl_go_to_nccl() {
    let asked = std::cell::Cell::new(None);
    let wins = |d: Dtype| {
        asked.set(Some(d));
        true
    };
    assert_eq!(
        route::<half::bf16>(ReduceOp::Sum, wins),
        Engine::Nccl(Unserved::Size)
    );
    assert_eq!(asked.get(), Some(Dtype::Bf16));
    asked.set(None);
    assert_eq!(
        route::<f64>(ReduceOp::Sum, wins),
        Engine::Nccl(Unserved::Type("f64"))
    );
    assert_eq!(
        route::<f32>(ReduceOp::Max, wins),
        Engine::Nccl(Unserved::Op(ReduceOp::Max))
    );
    assert_eq!(
        asked.get(),
        None,
        "the table is asked only for what the kernels serve"
    );
}

#[test]
fn element_and_op_codes_are_those_of_nccl_h() {
    let types = [
        (i8::NCCL_TYPE, 0),
        (u8::NCCL_TYPE, 1),
        (i32::NCCL_TYPE, 2),
        (u32::NCCL_TYPE, 3),
        (i64::NCCL_TYPE, 4),
        (u64::NCCL_TYPE, 5),
        (half::f16::NCCL_TYPE, 6),
        (f32::NCCL_TYPE, 7),
        (f64::NCCL_TYPE, 8),
        (half::bf16::NCCL_TYPE, 9),
    ];
    for (got, want) in types {
        assert_eq!(got, want);
    }
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];
    let codes: Vec<i32> = ops.iter().map(|o| o.nccl_code()).collect();
    assert_eq!(codes, vec![0, 1, 2, 3, 4]);
}

#[test]
fn an_unserved_call_names_the_call_why_and_what_to_do() {
    let e = unserved::<half::bf16>(ReduceOp::Max, "because".into());
    let s = e.to_string();
    assert!(s.contains("ReduceOp::Max over bf16"), "{s}");
    assert!(s.contains("because"), "{s}");
    // Without the feature the fix is the feature; with it, NCCL itself.
    if cfg!(feature = "nccl") {
        assert!(s.contains("make the NCCL fallback available"), "{s}");
    } else {
        assert!(s.contains("cargo feature `nccl`"), "{s}");
    }
    let e = unserved::<f64>(ReduceOp::Sum, "x".into());
    assert!(e.to_string().contains("ReduceOp::Sum over f64"), "{e}");
    #[cfg(not(feature = "nccl"))]
    assert!(NO_NCCL.contains("feature `nccl` is off"));
}

/// Engines move each rank's communicator into its thread and share
/// it (mistral.rs keeps an `Arc<Comm>` in its ops).
#[test]
fn a_communicator_is_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Comm>();
    send_sync::<Id>();
}

#[test]
fn a_communicator_of_no_ranks_is_refused_before_any_cuda_call() {
    assert!(matches!(
        Comm::from_devices(Vec::new()),
        Err(Error::WorldSize(0))
    ));
}

/// Runs one thread per call through one gather round, rank r passing
/// `calls[r]`, the ranks arriving in reverse order.
fn round(
    g: &Gather<u32>,
    calls: &[u32],
    launch: fn(&[u32], usize) -> Vec<Result<Route>>,
) -> Vec<Result<Route>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = calls
            .iter()
            .enumerate()
            .map(|(r, &c)| {
                s.spawn(move || {
                    // Arrive in reverse rank order, so the launching
                    // thread is rank 0's, not the first spawned.
                    std::thread::sleep(Duration::from_millis(5 * (calls.len() - r) as u64));
                    g.join(r, c, launch)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_last_rank_to_come_launches_every_ranks_call_in_rank_order() {
    let g = Gather::new(3, Duration::from_secs(10));
    fn launch(calls: &[u32], me: usize) -> Vec<Result<Route>> {
        assert_eq!(calls, &[10, 11, 12], "rank order");
        assert_eq!(me, 0, "rank 0 came last");
        // A distinct result per rank, to see each gets its own.
        calls
            .iter()
            .map(|&c| {
                Ok(if c == 11 {
                    Route::Nccl
                } else {
                    Route::Kernel(crate::Algorithm::OneStage)
                })
            })
            .collect()
    }
    for _ in 0..3 {
        let got = round(&g, &[10, 11, 12], launch);
        assert!(matches!(got[0], Ok(Route::Kernel(_))));
        assert!(matches!(got[1], Ok(Route::Nccl)));
        assert!(matches!(got[2], Ok(Route::Kernel(_))));
    }
}

#[test]
fn a_rank_in_two_calls_at_once_is_refused() {
    let g = Gather::new(2, Duration::from_secs(10));
    std::thread::scope(|s| {
        let first = s.spawn(|| g.join(0, 1u32, |_, me| share(Ok(Route::Nccl), 2, me)));
        // Wait until rank 0's first call is there, then call again as
        // rank 0 from this thread.
        while g.state.lock().unwrap().calls[0].is_none() {
            std::thread::yield_now();
        }
        let again = g.join(0, 2u32, |_, _| panic!("never launched"));
        assert!(matches!(&again, Err(Error::Config(m)) if m.contains("already in a collective")));
        // Rank 1 completes the first call.
        let one = g.join(1, 1u32, |calls, me| {
            assert_eq!(calls, &[1, 1]);
            share(Ok(Route::Nccl), 2, me)
        });
        assert!(matches!(one, Ok(Route::Nccl)));
        assert!(matches!(first.join().unwrap(), Ok(Route::Nccl)));
    });
}

#[test]
fn a_failed_launch_reaches_every_rank_typed() {
    let g = Gather::new(2, Duration::from_secs(10));
    fn launch(_: &[u32], me: usize) -> Vec<Result<Route>> {
        share(Err(Error::NoDriver), 2, me)
    }
    let got = round(&g, &[1, 1], launch);
    assert!(matches!(got[0], Err(Error::NoDriver)), "{:?}", got[0]);
    match &got[1] {
        Err(Error::CommGroupCallFailed { rank: 0, reason }) => {
            assert!(reason.contains("no CUDA driver"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // A refused capture is each rank's own error, in the same words.
    let shared = share(
        Err(Error::CaptureInvalidated {
            cause: "isolation".into(),
        }),
        3,
        2,
    );
    for r in shared {
        assert!(matches!(r, Err(Error::CaptureInvalidated { cause }) if cause == "isolation"));
    }
}

#[test]
fn a_rank_that_never_calls_times_out_the_others_and_the_comm_stays_broken() {
    let g = Gather::new(3, Duration::from_millis(100));
    let t0 = Instant::now();
    let got: Vec<Result<Route>> = std::thread::scope(|s| {
        let hs: Vec<_> = [0usize, 2]
            .into_iter()
            .map(|r| {
                let g = &g;
                s.spawn(move || g.join(r, 0u32, |_, _| panic!("never launched")))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
    let mut timed_out = 0;
    for r in &got {
        match r {
            Err(Error::CommTimeout { missing, .. }) => {
                assert!(missing.contains(&1), "{missing:?}");
                timed_out += 1;
            }
            Err(Error::Poisoned(why)) => assert!(why.contains("timed out"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(timed_out >= 1);
    // The late rank, and every later call, is refused at once.
    let late = g.join(1, 0u32, |_, _| panic!("never launched"));
    assert!(matches!(late, Err(Error::Poisoned(_))), "{late:?}");
}

#[test]
fn calls_that_differ_between_ranks_are_a_mismatch_on_every_rank() {
    let a = Call::AllReduce {
        dtype: Dtype::Bf16,
        count: 4096,
        input: 0x1000,
        output: 0x2000,
    };
    // Pointers differ between ranks: not a mismatch.
    let a2 = Call::AllReduce {
        dtype: Dtype::Bf16,
        count: 4096,
        input: 0x9000,
        output: 0x9000,
    };
    assert_eq!(a.shape(), a2.shape());
    let b = Call::AllReduce {
        dtype: Dtype::Bf16,
        count: 4097,
        input: 0x1000,
        output: 0x2000,
    };
    let n = Call::AddRmsNorm {
        dtype: Dtype::Bf16,
        rows: 1,
        hidden: 4096,
        eps_bits: 1e-6f32.to_bits(),
        ptrs: [0x1000, 0x2000, 0x3000, 0x4000],
    };
    assert_ne!(a.shape(), b.shape());
    assert_ne!(a.shape(), n.shape());
    assert!(n.shape().contains("1 rows x 4096 bf16"), "{}", n.shape());
    assert!(mismatch(&[a, a2, a]).is_none());
    // Rank 2 asks for one element more: every rank hears of it.
    let got = mismatch(&[a, a2, b]).expect("a mismatch");
    for (r, g) in got.iter().enumerate() {
        match g {
            Err(Error::CommCallMismatch {
                rank,
                other,
                mine,
                theirs,
            }) => {
                assert_eq!(*rank, r);
                let want_other = if r == 2 { 0 } else { 2 };
                assert_eq!(*other, want_other, "rank {r}");
                let (m, t) = if r == 2 {
                    ("4097", "4096")
                } else {
                    ("4096", "4097")
                };
                assert!(
                    mine.contains(m) && theirs.contains(t),
                    "rank {r}: {mine} / {theirs}"
                );
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // A fused call against a plain one.
    let got = mismatch(&[n, a]).expect("a mismatch");
    assert!(
        matches!(&got[1], Err(Error::CommCallMismatch { mine, .. }) if mine.starts_with("all_reduce of"))
    );
}
