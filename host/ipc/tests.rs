//! Unit tests of the IPC records, their checks and the opening of peer buffers.

use super::*;
use crate::exchange::InProcessExchange;
use std::time::Duration;

fn id(rank: usize, world: usize, host: &str, boot: &str) -> Identity {
    Identity {
        build: crate::ptx::build_id(),
        world,
        rank,
        pid: 1000 + rank as u32,
        host: host.into(),
        boot: boot.into(),
    }
}

/// Runs `introduce_as` on every rank (threads of this process, one
/// forged identity each) and returns each rank's result.
fn meet(ids: Vec<Identity>) -> Vec<Result<Vec<Identity>>> {
    let eps = InProcessExchange::ranks(ids.len(), Duration::from_secs(5));
    let hs: Vec<_> = eps
        .into_iter()
        .zip(ids)
        .map(|(ep, me)| std::thread::spawn(move || introduce_as(&ep, &me)))
        .collect();
    hs.into_iter().map(|h| h.join().expect("thread")).collect()
}

#[test]
fn identity_records_round_trip_and_are_text() {
    let me = Identity::of_this_process(1, 3);
    assert_eq!(me.pid, std::process::id());
    assert_eq!(me.build, crate::ptx::build_id());
    let text = String::from_utf8(me.encode()).expect("text");
    assert!(
        text.starts_with("p2p-allreduce identity 1\nbuild="),
        "{text}"
    );
    assert!(
        text.contains("\nrank=1\n") && text.contains("\nworld=3\n"),
        "{text}"
    );
    assert_eq!(Identity::decode(&me.encode(), 1, 0).expect("decode"), me);
    // A hostname with a newline or '=' cannot break the record.
    let odd = Identity {
        host: "a\nrank=7=x".into(),
        ..id(0, 2, "", "")
    };
    let back = Identity::decode(&odd.encode(), 0, 1).expect("decode");
    assert_eq!((back.rank, back.host.as_str()), (0, "a_rank_7_x"));
}

/// Issue 31: a group whose ranks are on different hosts is refused at
/// the first round, on every rank, naming both hosts (CUDA IPC handles
/// cannot be opened on another host).
#[test]
fn ranks_on_two_hosts_are_refused_on_every_rank() {
    let got = meet(vec![
        id(0, 3, "node-a", "11111111-aaaa"),
        id(1, 3, "node-a", "11111111-aaaa"),
        id(2, 3, "node-b", "22222222-bbbb"),
    ]);
    for (r, g) in got.iter().enumerate() {
        match g {
            Err(Error::CrossHost {
                rank,
                host,
                peer,
                peer_host,
            }) => {
                assert_eq!(*rank, r);
                let msg = g.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                assert!(msg.contains("NCCL"), "{msg}");
                if r < 2 {
                    assert_eq!(
                        (*peer, peer_host.as_str()),
                        (2, "node-b (boot id 22222222)")
                    );
                    assert_eq!(host, "node-a (boot id 11111111)");
                } else {
                    assert_eq!(*peer, 0);
                    assert_eq!(host, "node-b (boot id 22222222)");
                }
            }
            other => panic!("rank {r}: expected CrossHost, got {other:?}"),
        }
    }
    // Without boot ids, hostnames decide.
    let got = meet(vec![id(0, 2, "node-a", ""), id(1, 2, "node-b", "")]);
    assert!(got
        .iter()
        .all(|g| matches!(g, Err(Error::CrossHost { .. }))));
}

#[test]
fn one_host_meets_even_with_two_hostnames() {
    // Containers of one host: different hostnames, one boot id.
    let got = meet(vec![
        id(0, 2, "container-1", "33333333-cccc"),
        id(1, 2, "container-2", "33333333-cccc"),
    ]);
    for g in got {
        let ids = g.expect("one host");
        assert_eq!(ids.iter().map(|i| i.rank).collect::<Vec<_>>(), vec![0, 1]);
    }
}

/// A record from another build (or another identity version) is a
/// typed mismatch on every rank, before any CUDA call.
#[test]
fn another_build_is_refused() {
    let mut other = id(1, 2, "h", "b");
    other.build ^= 1;
    for g in meet(vec![id(0, 2, "h", "b"), other]) {
        match g {
            Err(Error::GroupMismatch { what, .. }) => {
                assert!(what.contains("another build"), "{what}")
            }
            other => panic!("expected GroupMismatch, got {other:?}"),
        }
    }
}

#[test]
fn foreign_and_old_records_are_typed() {
    let junk = Identity::decode(b"\x00\x01garbage", 1, 0);
    assert!(matches!(junk, Err(Error::Rendezvous(_))), "{junk:?}");
    let v2 = b"p2p-allreduce identity 2\nbuild=0\n";
    assert!(matches!(
        Identity::decode(v2, 1, 0),
        Err(Error::GroupMismatch { other: 1, .. })
    ));
    // An older p2p-allreduce sends its IPC record (magic, version) first.
    let mut old = MAGIC.to_le_bytes().to_vec();
    old.extend_from_slice(&6u32.to_le_bytes());
    old.resize(RECORD, 0);
    match Identity::decode(&old, 1, 0) {
        Err(Error::GroupMismatch { what, .. }) => assert!(what.contains("older"), "{what}"),
        other => panic!("{other:?}"),
    }
    let cut = b"p2p-allreduce identity 1\nbuild=00000000000000ff\nworld=2\n";
    assert!(matches!(
        Identity::decode(cut, 1, 0),
        Err(Error::Rendezvous(_))
    ));
}

/// Fault matrix (issue 31): the rendezvous directory holds rank 1's
/// identity record from another build, written by a live process: the
/// survivor gets `GroupMismatch` at once (well within the timeout), no
/// CUDA touched; then a new group in the same directory meets.
#[test]
fn a_record_of_another_build_in_the_directory_is_refused_at_once() {
    use crate::exchange::{forge_dir_record, DirExchange};
    let dir = std::env::temp_dir().join(format!("p2p-ar-build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut other = Identity::of_this_process(1, 2);
    other.build ^= 0x5a5a;
    other.pid += 1;
    // Written by this (live) process, as a peer running now would.
    let start = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s[s.rfind(')')? + 1..].to_string();
            rest.split_whitespace().nth(19)?.parse::<u64>().ok()
        })
        .unwrap_or(0);
    forge_dir_record(&dir, 1, 1, std::process::id(), start, &other.encode());
    let timeout = Duration::from_secs(5);
    let ex = DirExchange::new(&dir, 0, 2, timeout).expect("new");
    let t = std::time::Instant::now();
    match introduce(&ex) {
        Err(Error::GroupMismatch {
            rank: 0,
            other: 1,
            what,
        }) => {
            assert!(what.contains("another build"), "{what}")
        }
        other => panic!("expected GroupMismatch, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // A new group in the same directory: both ranks fresh (the new
    // rank 1 replaces its records first, as a restarted rank does).
    let exs: Vec<DirExchange> = [1usize, 0]
        .iter()
        .map(|&r| DirExchange::new(&dir, r, 2, timeout).expect("new"))
        .collect();
    let hs: Vec<_> = exs
        .into_iter()
        .map(|ex| {
            std::thread::spawn(move || {
                let r = ex.rank();
                let mut me = Identity::of_this_process(r, 2);
                me.pid += r as u32; // two ranks of one test process
                introduce_as(&ex, &me)
            })
        })
        .collect();
    for h in hs {
        let ids = h.join().expect("thread").expect("a new group meets");
        assert_eq!(ids.len(), 2);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// --- Issue 48: the decoders fed what a broken or hostile peer could
// send. Each returns a value or a typed error, never panics.

use proptest::prelude::*;

/// A record of this build with the given settings and handles.
fn ipc_record(world: u32, rank: u32, pid: u32, words: [u64; 6], fill: u8) -> Record {
    Record {
        world,
        rank,
        pid,
        bus: "0000:1b:00.0".into(),
        max_bytes: words[0],
        timeout_ns: words[1],
        launch: words[2],
        push_max: words[3],
        push_ll_max: words[4],
        push2_max: words[5],
        handles: [[fill; HANDLE], [fill ^ 1; HANDLE], [fill ^ 2; HANDLE]],
    }
}

/// Identity::decode's errors are `Rendezvous` (not a record) or
/// `GroupMismatch` (another version), naming the sender.
fn identity_error_is_typed(r: &Result<Identity>) -> std::result::Result<(), TestCaseError> {
    match r {
        Ok(_) => Ok(()),
        Err(Error::Rendezvous(m)) => {
            prop_assert!(m.contains("rank 1"), "{m}");
            Ok(())
        }
        Err(Error::GroupMismatch {
            rank: 0, other: 1, ..
        }) => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!("untyped: {e:?}"))),
    }
}

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn identity_decode_of_random_bytes_is_typed(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        identity_error_is_typed(&Identity::decode(&b, 1, 0))?;
    }

    /// Text records with random values (numbers past u64 and u32,
    /// non-hex builds, lines missing or swapped) and any version.
    #[test]
    fn identity_decode_of_random_text_is_typed(
        version in prop_oneof![Just("1".to_string()), "[0-9]{1,25}", ".{0,6}"],
        values in proptest::collection::vec(prop_oneof![
            "[0-9a-f]{0,24}", "[0-9]{1,30}", "-[0-9]{1,3}", ".{0,12}"
        ], 6),
        keep in 0usize..=7,
        swap in any::<bool>(),
    ) {
        let mut keys = ["build", "world", "rank", "pid", "host", "boot"];
        if swap {
            keys.swap(1, 2);
        }
        let mut text = format!("{HELLO_MAGIC} {version}\n");
        for (k, v) in keys.iter().zip(&values).take(keep) {
            text.push_str(&format!("{k}={v}\n"));
        }
        let got = Identity::decode(text.as_bytes(), 1, 0);
        identity_error_is_typed(&got)?;
        if let Ok(id) = &got {
            // Taken only as a whole record of this version whose numbers fit.
            prop_assert_eq!(version.trim().parse::<u32>().ok(), Some(HELLO_VERSION));
            prop_assert!(keep >= 6 && !swap);
            // (`lines` drops a '\r' before each '\n'.)
            let num = |v: &str| v.strip_suffix('\r').unwrap_or(v).parse::<u64>().ok();
            prop_assert_eq!(Some(id.world as u64), num(&values[1]));
            prop_assert_eq!(Some(id.pid as u64), num(&values[3]));
        }
    }

    /// A record of this build cut anywhere is refused (or, cut inside
    /// its last value, taken with that value shortened).
    #[test]
    fn identity_records_cut_anywhere_are_typed(cut in 0usize..200, rank in 0usize..8) {
        let me = Identity::of_this_process(rank, 8);
        let full = me.encode();
        let cut = cut.min(full.len());
        let got = Identity::decode(&full[..cut], 1, 0);
        identity_error_is_typed(&got)?;
        if let Ok(id) = got {
            prop_assert!(cut >= full.len() - me.boot.len() - 1, "taken when cut at {}", cut);
            prop_assert_eq!(id.rank, rank);
        }
    }

    /// The IPC record: random bytes of any length, records of this
    /// layout with another version or magic, cut records. Only a whole
    /// record of this version decodes, whatever its numbers.
    #[test]
    fn ipc_record_decode_is_typed(
        b in proptest::collection::vec(any::<u8>(), 0..RECORD + 40),
        version in any::<u32>(),
        words in any::<[u64; 6]>(),
        ids in any::<[u32; 3]>(),
        cut in 0usize..=RECORD,
    ) {
        let typed = |r: &Result<Record>| match r {
            Ok(_) | Err(Error::Rendezvous(_)) => Ok(()),
            Err(e) => Err(TestCaseError::fail(format!("untyped: {e:?}"))),
        };
        typed(&Record::decode(&b, 1))?;
        let rec = ipc_record(ids[0], ids[1], ids[2], words, 7).encode();
        let back = Record::decode(&rec, 1)
            .map_err(|e| TestCaseError::fail(format!("a record of this build: {e}")))?;
        prop_assert_eq!(
            (back.world, back.rank, back.pid, back.max_bytes, back.push2_max),
            (ids[0], ids[1], ids[2], words[0], words[5])
        );
        let mut other = rec.clone();
        other[4..8].copy_from_slice(&version.to_le_bytes());
        let got = Record::decode(&other, 1);
        typed(&got)?;
        prop_assert_eq!(got.is_ok(), version == VERSION);
        let got = Record::decode(&rec[..cut], 1);
        typed(&got)?;
        prop_assert_eq!(got.is_ok(), cut == RECORD);
    }

    /// Records whose numbers are anything (a world or rank past u32
    /// as usize, settings of u64::MAX) are refused by the checks as a
    /// typed error before anything is opened, or agree with this rank's.
    #[test]
    fn ipc_record_checks_are_typed(
        world in 1usize..=MAX_RANKS,
        theirs in any::<([u32; 2], [u64; 6])>(),
        same in any::<bool>(),
    ) {
        let mine = ipc_record(world as u32, 0, 1, mine_words(), 1);
        let words = if same { mine_words() } else { theirs.1 };
        let all: Vec<Vec<u8>> = (0..world)
            .map(|p| {
                let (w, r) = if p == 1 { (theirs.0[0], theirs.0[1]) } else { (world as u32, p as u32) };
                ipc_record(w, r, 100 + p as u32, if p == 1 { words } else { mine_words() }, 3).encode()
            })
            .collect();
        let got = check_records(&all, 0, world, &mine);
        match &got {
            Ok(recs) => prop_assert_eq!(recs.len(), world),
            Err(Error::GroupMismatch { rank: 0, .. }) | Err(Error::Rendezvous(_)) => {}
            Err(e) => return Err(TestCaseError::fail(format!("untyped: {e:?}"))),
        }
        if world > 1 {
            let agrees = (theirs.0[0] as usize, theirs.0[1]) == (world, 1) && words == mine_words();
            prop_assert_eq!(got.is_ok(), agrees);
        }
    }

    /// A use of a mapping is allowed exactly when it lies inside it,
    /// for every offset and length (`offset + bytes` past u64::MAX too).
    #[test]
    fn check_mapped_is_exact_and_never_overflows(
        offset in prop_oneof![any::<u64>(), 0u64..4096, Just(u64::MAX)],
        bytes in prop_oneof![any::<u64>(), 0u64..4096, Just(u64::MAX)],
        mapped in prop_oneof![any::<u64>(), 0u64..8192],
        edge in proptest::option::of(-1i64..=1),
    ) {
        // Half the cases at the mapping's end: one byte short, exact, one byte past.
        let mapped = match (edge, offset.checked_add(bytes)) {
            (Some(d), Some(end)) => end.saturating_add_signed(d),
            _ => mapped,
        };
        let got = check_mapped(0, 1, "staging buffer", offset, bytes, mapped);
        let inside = offset as u128 + bytes as u128 <= mapped as u128;
        prop_assert_eq!(got.is_ok(), inside);
        if let Err(e) = got {
            let msg = e.to_string();
            prop_assert!(
                matches!(e, Error::PeerBufferTooSmall { rank: 0, peer: 1, .. }),
                "{}", msg
            );
            prop_assert!(msg.contains(&mapped.to_string()) && msg.contains(&bytes.to_string()), "{}", msg);
        }
    }
}

fn mine_words() -> [u64; 6] {
    [1 << 20, 5, 6, 7, 8, 9]
}

/// The record of a peer that is too old to send an identity, and
/// records whose identity numbers lie past their types, are typed.
#[test]
fn identity_numbers_past_their_types_are_refused() {
    let me = Identity::of_this_process(1, 2);
    let text = String::from_utf8(me.encode()).expect("text");
    let big_pid = text.replace(&format!("pid={}", me.pid), "pid=4294967296");
    match Identity::decode(big_pid.as_bytes(), 1, 0) {
        Err(Error::Rendezvous(m)) => assert!(m.contains("pid=4294967296"), "{m}"),
        other => panic!("{other:?}"),
    }
    let big_world = text.replace("world=2", "world=18446744073709551616");
    assert!(matches!(
        Identity::decode(big_world.as_bytes(), 1, 0),
        Err(Error::Rendezvous(_))
    ));
}

#[test]
fn ranks_in_one_process_or_out_of_place_are_refused() {
    let mut twin = id(1, 2, "h", "b");
    twin.pid = 1000;
    for g in meet(vec![id(0, 2, "h", "b"), twin]) {
        assert!(
            matches!(&g, Err(Error::GroupMismatch { what, .. }) if what.contains("one process")),
            "{g:?}"
        );
    }
    let mut wrong = id(1, 2, "h", "b");
    wrong.rank = 0;
    for g in meet(vec![id(0, 2, "h", "b"), wrong]) {
        assert!(matches!(g, Err(Error::GroupMismatch { .. })), "{g:?}");
    }
}
