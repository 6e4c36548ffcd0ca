//! All-gather of small byte strings between ranks, for setting up groups
//! across processes (CUDA IPC handles, configuration checks). Users plug in
//! their own store, MPI or TCP by implementing [`Exchange`].

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Ranks whose contribution has not arrived.
fn missing_ranks<T>(slots: &[Option<T>]) -> Vec<usize> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_none())
        .map(|(r, _)| r)
        .collect()
}

/// Every rank calls `all_gather` the same number of times, in the same order.
pub trait Exchange {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Returns every rank's `mine`, indexed by rank.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// Ranks that are threads of one process (tests, or single-process setups
/// that still want the exchange API). Clone one per rank with [`InProcessExchange::ranks`].
#[derive(Clone)]
pub struct InProcessExchange {
    rank: usize,
    shared: Arc<Shared>,
    timeout: Duration,
}

struct Shared {
    world: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

#[derive(Default)]
struct Round {
    round: u64,
    slots: Vec<Option<Vec<u8>>>,
    /// Finished rounds' results, kept until every rank has taken them.
    done: Option<(u64, Vec<Vec<u8>>, usize)>,
}

impl InProcessExchange {
    /// One endpoint per rank of a `world`-rank exchange.
    pub fn ranks(world: usize, timeout: Duration) -> Vec<InProcessExchange> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(Round {
                slots: vec![None; world],
                ..Round::default()
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| InProcessExchange {
                rank,
                shared: shared.clone(),
                timeout,
            })
            .collect()
    }
}

impl Exchange for InProcessExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        // Wait until the previous round's results have been taken by everyone.
        while st.done.is_some() {
            st = self.wait(st, deadline)?;
        }
        let my_round = st.round;
        st.slots[self.rank] = Some(mine.to_vec());
        if st.slots.iter().all(Option::is_some) {
            let all: Vec<Vec<u8>> = st
                .slots
                .iter_mut()
                .map(|s| s.take().unwrap_or_default())
                .collect();
            st.done = Some((my_round, all, 0));
            st.round += 1;
            self.shared.cv.notify_all();
        }
        loop {
            if let Some((r, all, taken)) = &mut st.done {
                if *r == my_round {
                    let out = all.clone();
                    *taken += 1;
                    if *taken == self.shared.world {
                        st.done = None;
                        self.shared.cv.notify_all();
                    }
                    return Ok(out);
                }
            }
            st = self.wait(st, deadline)?;
        }
    }
}

impl InProcessExchange {
    fn wait<'a>(
        &self,
        st: std::sync::MutexGuard<'a, Round>,
        deadline: Instant,
    ) -> Result<std::sync::MutexGuard<'a, Round>> {
        let now = Instant::now();
        if now >= deadline {
            let missing = missing_ranks(&st.slots);
            return Err(Error::RendezvousTimeout {
                missing,
                waited: self.timeout,
            });
        }
        let (g, _) = self
            .shared
            .cv
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|p| p.into_inner());
        Ok(g)
    }
}

/// Ranks in separate processes on one machine meeting in a directory: each
/// round, rank r writes `round-<k>.rank-<r>` (atomically, readable by the
/// owner only) and waits for the others' files. The directory is created
/// with mode 0700 if it does not exist; use a fresh one per group.
pub struct DirExchange {
    dir: PathBuf,
    rank: usize,
    world: usize,
    timeout: Duration,
    round: Mutex<u64>,
}

impl DirExchange {
    pub fn new(dir: &Path, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        if rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is outside a world of {world}"
            )));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::Rendezvous(format!("creating {}: {e}", dir.display())))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // Only this user may read the handles (they grant access to GPU memory).
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
        Ok(DirExchange {
            dir: dir.to_path_buf(),
            rank,
            world,
            timeout,
            round: Mutex::new(0),
        })
    }

    fn path(&self, round: u64, rank: usize) -> PathBuf {
        self.dir.join(format!("round-{round}.rank-{rank}"))
    }
}

impl Exchange for DirExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let round = {
            let mut r = self.round.lock().unwrap_or_else(|p| p.into_inner());
            *r += 1;
            *r
        };
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Error::Rendezvous(format!("{what} {}: {e}", p.display()))
        };
        let tmp = self.dir.join(format!(
            ".round-{round}.rank-{}.{}",
            self.rank,
            std::process::id()
        ));
        {
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create(true).truncate(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            use std::io::Write;
            let mut f = opts.open(&tmp).map_err(|e| io("writing", &tmp, e))?;
            f.write_all(mine).map_err(|e| io("writing", &tmp, e))?;
        }
        let mine_path = self.path(round, self.rank);
        std::fs::rename(&tmp, &mine_path).map_err(|e| io("publishing", &mine_path, e))?;
        let start = Instant::now();
        let mut out: Vec<Option<Vec<u8>>> = vec![None; self.world];
        loop {
            for (r, slot) in out.iter_mut().enumerate() {
                if slot.is_none() {
                    match std::fs::read(self.path(round, r)) {
                        Ok(b) => *slot = Some(b),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(io("reading", &self.path(round, r), e)),
                    }
                }
            }
            if out.iter().all(Option::is_some) {
                return Ok(out.into_iter().map(Option::unwrap_or_default).collect());
            }
            if start.elapsed() > self.timeout {
                let missing = missing_ranks(&out);
                return Err(Error::RendezvousTimeout {
                    missing,
                    waited: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[cfg(test)]
mod tests {
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
}
