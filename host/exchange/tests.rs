//! Unit tests of the exchanges (threads, files) and the rendezvous directory checks.

use super::*;

#[test]
fn in_process_all_gather_over_several_rounds() {
    let eps = InProcessExchange::ranks(3, Duration::from_secs(5));
    let handles: Vec<_> = eps
        .into_iter()
        .map(|ep| {
            std::thread::spawn(move || {
                (0..4u8)
                    .map(|round| ep.all_gather(&[ep.rank() as u8, round]).expect("gather"))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for h in handles {
        let rounds = h.join().expect("thread");
        for (round, all) in rounds.iter().enumerate() {
            assert_eq!(
                all,
                &vec![
                    vec![0, round as u8],
                    vec![1, round as u8],
                    vec![2, round as u8]
                ]
            );
        }
    }
}

#[test]
fn in_process_missing_rank_times_out() {
    let eps = InProcessExchange::ranks(2, Duration::from_millis(50));
    match eps[0].all_gather(b"x") {
        Err(Error::RendezvousTimeout { missing, .. }) => assert_eq!(missing, vec![1]),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

fn tmp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("p2p-ar-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Two ranks (threads) meet in `dir` for two rounds.
fn two_ranks_meet(dir: &Path) {
    let hs: Vec<_> = (0..2)
        .map(|r| {
            let dir = dir.to_path_buf();
            std::thread::spawn(move || {
                let ex = DirExchange::new(&dir, r, 2, Duration::from_secs(5)).expect("new");
                let a = ex.all_gather(format!("a{r}").as_bytes()).expect("round 1");
                let b = ex.all_gather(format!("b{r}").as_bytes()).expect("round 2");
                (a, b)
            })
        })
        .collect();
    for h in hs {
        let (a, b) = h.join().expect("thread");
        assert_eq!(a, vec![b"a0".to_vec(), b"a1".to_vec()]);
        assert_eq!(b, vec![b"b0".to_vec(), b"b1".to_vec()]);
    }
}

/// Fault matrix (issue 31): the rendezvous directory holds rank 1's
/// records of an earlier run, written by a process that has exited.
/// Rank 0 does not take them: it waits for this run's rank 1 and, when
/// none comes, gets `StaleRecord` naming the file within the timeout
/// plus one second. A later rank 1 is met (the stale files are waited
/// past), and a new group in the same directory works.
#[test]
fn stale_records_of_an_exited_process_are_not_taken() {
    let dir = tmp_dir("stale");
    let dead = exited_pid();
    for round in 1..=3 {
        forge_dir_record(&dir, round, 1, dead, 0, b"old run");
    }
    let timeout = Duration::from_millis(400);
    let ex = DirExchange::new(&dir, 0, 2, timeout).expect("new");
    let t = Instant::now();
    match ex.all_gather(b"x") {
        Err(Error::StaleRecord {
            rank: 1,
            path,
            reason,
            ..
        }) => {
            assert!(path.ends_with("round-1.rank-1"), "{path:?}");
            assert!(
                reason.contains(&format!("process {dead}, which has exited")),
                "{reason}"
            );
        }
        other => panic!("expected StaleRecord, got {other:?}"),
    }
    let took = t.elapsed();
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(1),
        "{took:?}"
    );
    // Rank 0 again, and this run's rank 1 later: met, never the stale data.
    for round in 1..=3 {
        forge_dir_record(&dir, round, 1, dead, 0, b"old run");
    }
    let d0 = dir.clone();
    let r0 = std::thread::spawn(move || {
        let ex = DirExchange::new(&d0, 0, 2, Duration::from_secs(5)).expect("new");
        (ex.all_gather(b"a0"), ex.all_gather(b"b0"))
    });
    std::thread::sleep(Duration::from_millis(100));
    let ex1 = DirExchange::new(&dir, 1, 2, Duration::from_secs(5)).expect("new");
    assert_eq!(
        ex1.all_gather(b"a1").expect("r1"),
        vec![b"a0".to_vec(), b"a1".to_vec()]
    );
    assert_eq!(
        ex1.all_gather(b"b1").expect("r1"),
        vec![b"b0".to_vec(), b"b1".to_vec()]
    );
    let (a, b) = r0.join().expect("thread");
    assert_eq!(a.expect("round 1"), vec![b"a0".to_vec(), b"a1".to_vec()]);
    assert_eq!(b.expect("round 2"), vec![b"b0".to_vec(), b"b1".to_vec()]);
    two_ranks_meet(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fault matrix: a corrupt record (bytes no DirExchange wrote, e.g. of
/// an older version or another program) is not taken: `StaleRecord`
/// saying so within the timeout plus one second; then a group works.
#[test]
fn corrupt_records_are_not_taken() {
    let dir = tmp_dir("corrupt");
    std::fs::create_dir_all(&dir).expect("dir");
    for junk in [&b""[..], b"\x00\x01\x02", &[0xffu8; 200][..]] {
        std::fs::write(dir.join("round-1.rank-1"), junk).expect("write");
        let timeout = Duration::from_millis(300);
        let ex = DirExchange::new(&dir, 0, 2, timeout).expect("new");
        let t = Instant::now();
        match ex.all_gather(b"x") {
            Err(Error::StaleRecord {
                rank: 1, reason, ..
            }) => {
                assert!(reason.contains("corrupt"), "{reason}")
            }
            other => panic!("expected StaleRecord, got {other:?}"),
        }
        assert!(t.elapsed() < timeout + Duration::from_secs(1));
    }
    two_ranks_meet(&dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank seen in round 1 whose process exits before round 2 is
/// reported at once (`PeerExited`), not at the timeout.
#[test]
fn a_peer_that_exits_between_rounds_is_reported_at_once() {
    let dir = tmp_dir("exited");
    let dead = exited_pid();
    let ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(30)).expect("new");
    // Round 1 from a live writer (this process, as rank 1 would be)...
    let me = Writer::this_one();
    forge_dir_record(&dir, 1, 1, me.pid, me.start, b"hello");
    assert_eq!(ex.all_gather(b"x").expect("round 1")[1], b"hello".to_vec());
    // ...whose record of round 2 comes from another process, which has
    // exited: not rank 1's current writer. Make the known writer look
    // exited (a dead pid) and wait: PeerExited well before 30 s.
    ex.known.lock().expect("lock")[1] = Some(Writer {
        pid: dead,
        start: 0,
        nonce: 1,
    });
    let t = Instant::now();
    match ex.all_gather(b"y") {
        Err(Error::PeerExited { rank: 1, pid }) => assert_eq!(pid, dead),
        other => panic!("expected PeerExited, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn proc_stat_lines_parse_past_odd_command_names() {
    let line = "4242 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
    assert_eq!(parse_stat(line), Some(('S', 987654)));
    let me = Writer::this_one();
    assert_eq!(me.alive(), Some(true));
    assert_eq!(
        Writer {
            pid: exited_pid(),
            ..me
        }
        .alive(),
        Some(false)
    );
    // The same id with another start time: another process.
    assert_eq!(
        Writer {
            start: me.start + 1,
            ..me
        }
        .alive(),
        Some(false)
    );
}

#[test]
fn new_removes_only_this_ranks_old_records() {
    let dir = tmp_dir("own");
    forge_dir_record(&dir, 1, 0, 1, 0, b"mine, old");
    forge_dir_record(&dir, 1, 1, 1, 0, b"peer's");
    std::fs::write(dir.join(".round-2.rank-0.99"), b"tmp").expect("tmp");
    let _ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(1)).expect("new");
    assert!(!dir.join("round-1.rank-0").exists());
    assert!(!dir.join(".round-2.rank-0.99").exists());
    assert!(dir.join("round-1.rank-1").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `got` must be `UnsafeRendezvous` about `what` whose reason holds `why`.
fn expect_unsafe<T>(got: Result<T>, what: &str, why: &str) {
    match got {
        Err(
            ref e @ Error::UnsafeRendezvous {
                what: ref w,
                ref reason,
                ..
            },
        ) => {
            assert!(w.contains(what), "{e}");
            assert!(reason.contains(why), "{e}");
            let msg = e.to_string();
            assert!(
                msg.contains("mode 0700"),
                "the message says what to do: {msg}"
            );
        }
        Err(other) => panic!("expected UnsafeRendezvous ({what}: {why}), got {other:?}"),
        Ok(_) => panic!("expected UnsafeRendezvous ({what}: {why}), got Ok"),
    }
}

/// A private directory with rank 0's record of an earlier run in it
/// (which `new` removes) and rank 1's record of this run (which a
/// round would take): so a refused directory shows nothing was read
/// or removed.
fn planted(what: &str) -> PathBuf {
    let dir = tmp_dir(what);
    let me = Writer::this_one();
    forge_dir_record(&dir, 1, 0, me.pid, me.start, b"rank 0, old");
    forge_dir_record(&dir, 1, 1, me.pid, me.start, b"rank 1, now");
    dir
}

fn untouched(dir: &Path) {
    assert!(dir.join("round-1.rank-0").exists(), "new removed a record");
    assert!(dir.join("round-1.rank-1").exists());
}

/// Issue 48: a rendezvous directory owned by another user is refused,
/// nothing in it read or removed. As root (CI), the directory is
/// given to `nobody` (65534); otherwise `/` stands for another user's
/// directory where root owns it.
#[cfg(unix)]
#[test]
fn a_directory_of_another_user_is_refused() {
    use std::os::unix::fs::MetadataExt;
    if this_user() == 0 {
        let dir = planted("other-user");
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).expect("chown");
        let mode = std::fs::metadata(&dir).expect("meta").mode();
        let got = DirExchange::new(&dir, 0, 2, Duration::from_secs(1));
        expect_unsafe(got, "rendezvous directory", "owned by user 65534");
        untouched(&dir);
        assert_eq!(std::fs::metadata(&dir).expect("meta").mode(), mode);
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        let root = Path::new("/");
        match std::fs::metadata(root) {
            Ok(m) if m.uid() != this_user() => {
                let got = DirExchange::new(root, 0, 2, Duration::from_secs(1));
                expect_unsafe(got, "rendezvous directory", "owned by user");
            }
            _ => println!(
                "SKIPPED (not root, so no directory can be given to another user, and / is this user's)"
            ),
        }
    }
}

/// Issue 48: a directory that group or others may write to is refused
/// (0777 and 0770 alike), nothing in it read or removed, its mode left
/// as it was; one of this user's that only its owner may write (0755)
/// is taken and made private (0700).
#[cfg(unix)]
#[test]
fn a_directory_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |d: &Path| std::fs::metadata(d).expect("meta").permissions().mode() & 0o7777;
    for m in [0o777, 0o770, 0o1777] {
        let dir = planted(&format!("mode-{m:o}"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(m)).expect("chmod");
        let got = DirExchange::new(&dir, 0, 2, Duration::from_secs(1));
        expect_unsafe(got, "rendezvous directory", "group or others may write");
        untouched(&dir);
        assert_eq!(mode(&dir), m);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let dir = planted("mode-755");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(1)).expect("new");
    assert_eq!(mode(&dir), 0o700);
    assert!(!dir.join("round-1.rank-0").exists());
    forge_dir_record(&dir, 1, 1, ex.me.pid, ex.me.start, b"rank 1, now");
    assert_eq!(ex.all_gather(b"x").expect("round 1")[1], b"rank 1, now");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 48: a symbolic link as the directory (with or without a
/// trailing `/`) is refused, even to a private directory of this user.
#[cfg(unix)]
#[test]
fn a_symbolic_link_as_the_directory_is_refused() {
    let dir = planted("link-target");
    let link = tmp_dir("link");
    std::os::unix::fs::symlink(&dir, &link).expect("symlink");
    for path in [link.clone(), link.join("")] {
        let got = DirExchange::new(&path, 0, 2, Duration::from_secs(1));
        expect_unsafe(got, "rendezvous directory", "symbolic link");
    }
    untouched(&dir);
    // A missing directory is made private (0700) through missing parents.
    let fresh = tmp_dir("fresh").join("a").join("b");
    DirExchange::new(&fresh, 0, 1, Duration::from_secs(1)).expect("new");
    {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(&fresh)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(m & 0o777, 0o700);
    }
    let _ = std::fs::remove_file(&link);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(tmp_dir("fresh"));
}

/// Issue 48: a record that is a symbolic link (to a valid record of a
/// live writer), that is not a regular file, or (as root) that another
/// user owns is refused at once: the round's error, nothing taken.
#[cfg(unix)]
#[test]
fn records_that_are_links_or_foreign_are_refused() {
    let dir = tmp_dir("record-link");
    let elsewhere = tmp_dir("record-elsewhere");
    let me = Writer::this_one();
    forge_dir_record(&elsewhere, 1, 1, me.pid, me.start, b"planted");
    let ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(30)).expect("new");
    std::os::unix::fs::symlink(elsewhere.join("round-1.rank-1"), dir.join("round-1.rank-1"))
        .expect("symlink");
    let t = Instant::now();
    expect_unsafe(ex.all_gather(b"x"), "rank 1's record", "symbolic link");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // A FIFO as a record: refused without blocking.
    let ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(30)).expect("new");
    let fifo = dir.join("round-1.rank-1");
    std::fs::remove_file(&fifo).expect("rm link");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    expect_unsafe(ex.all_gather(b"x"), "rank 1's record", "not a regular file");
    std::fs::remove_file(&fifo).expect("rm fifo");

    if this_user() == 0 {
        let ex = DirExchange::new(&dir, 0, 2, Duration::from_secs(30)).expect("new");
        forge_dir_record(&dir, 1, 1, me.pid, me.start, b"foreign");
        std::os::unix::fs::chown(dir.join("round-1.rank-1"), Some(65534), Some(65534))
            .expect("chown");
        expect_unsafe(
            ex.all_gather(b"x"),
            "rank 1's record",
            "owned by user 65534",
        );
    } else {
        println!(
            "SKIPPED (a record of another user: not root, so no file can be given to another user)"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

/// Issue 48: a directory replaced after `new` checked it (renamed
/// away, another one made in its place) is refused at the next round.
#[test]
fn a_directory_replaced_between_rounds_is_refused() {
    let dir = tmp_dir("replaced");
    let ex = DirExchange::new(&dir, 0, 1, Duration::from_secs(1)).expect("new");
    assert_eq!(ex.all_gather(b"a").expect("round 1"), vec![b"a".to_vec()]);
    let away = tmp_dir("replaced-away");
    std::fs::rename(&dir, &away).expect("rename");
    std::fs::create_dir(&dir).expect("mkdir");
    expect_unsafe(ex.all_gather(b"b"), "rendezvous directory", "replaced");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&away);
}

#[test]
fn dir_exchange_between_threads_and_timeout() {
    let dir = std::env::temp_dir().join(format!("p2p-ar-exchange-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let hs: Vec<_> = (0..3)
        .map(|r| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let ex = DirExchange::new(&dir, r, 3, Duration::from_secs(5)).expect("new");
                let a = ex.all_gather(format!("a{r}").as_bytes()).expect("round 1");
                let b = ex.all_gather(format!("b{r}").as_bytes()).expect("round 2");
                (a, b)
            })
        })
        .collect();
    for h in hs {
        let (a, b) = h.join().expect("thread");
        assert_eq!(a, vec![b"a0".to_vec(), b"a1".to_vec(), b"a2".to_vec()]);
        assert_eq!(b, vec![b"b0".to_vec(), b"b1".to_vec(), b"b2".to_vec()]);
    }
    let lonely =
        DirExchange::new(&dir.join("lonely"), 0, 2, Duration::from_millis(30)).expect("new");
    assert!(matches!(
        lonely.all_gather(b"x"),
        Err(Error::RendezvousTimeout { .. })
    ));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
