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
///
/// The records hold CUDA IPC handles, and the kernels write where the
/// peers' records point, so the directory must be private (on a host
/// shared with other users, in a shared `/tmp`): `DirExchange::new` refuses
/// (`Error::UnsafeRendezvous`) a directory that is a symbolic link, is not
/// owned by this process's user, or that group or others may write to,
/// and makes one it keeps readable by its owner only (mode 0700). Record
/// files are opened without following symbolic links and taken only when
/// they are regular files owned by this user (else the same error, and
/// nothing is read from them). Each round checks that the directory is
/// still the one `new` checked.
///
/// Records left in the directory by an earlier run are not taken for this
/// run's: every file starts with a header naming its writer (process id,
/// the process's start time, and a number drawn for each `DirExchange`),
/// and a file is taken only from a live process (a file whose writer has
/// exited is stale), with the same writer in every round. A file that is
/// not a `DirExchange` record (corrupt) is not taken either. Such files are
/// waited past: if the rank's own record does not come within the
/// timeout, the error is `Error::StaleRecord`, naming the file and why it
/// was not taken (plain `RendezvousTimeout` where nothing was there). A
/// rank whose writer exits after an earlier round is reported at once
/// (`Error::PeerExited`), not at the timeout.
///
/// Few records are left behind: `DirExchange::new` removes this rank's
/// records of earlier runs; when round k completes, this rank's record of
/// round k - 1 is removed (every peer has read it: each wrote round k
/// after reading all of round k - 1); a round that fails removes this
/// exchange's records (the rendezvous is over).
pub struct DirExchange {
    dir: PathBuf,
    rank: usize,
    world: usize,
    timeout: Duration,
    round: Mutex<u64>,
    me: Writer,
    /// The writer of each rank's records, from the first round it was seen.
    known: Mutex<Vec<Option<Writer>>>,
    /// The directory `new` checked (device and inode).
    id: DirId,
}

/// Who wrote a record: a process (id and start time, so a reused id is
/// told apart) and the `DirExchange` in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Writer {
    pid: u32,
    /// The process's start time (clock ticks since boot, `/proc/<pid>/stat`
    /// field 22); 0 where unknown.
    start: u64,
    /// Drawn for each `DirExchange`.
    nonce: u64,
}

/// The header of every record file.
const DIR_MAGIC: &[u8; 8] = b"P2PDXR01";
const DIR_HEADER: usize = 8 + 4 + 4 + 8 + 8;

impl Writer {
    fn this_one() -> Writer {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        Writer {
            pid: std::process::id(),
            start: process_start(std::process::id()).unwrap_or(0),
            nonce: h.finish(),
        }
    }
    fn header(&self) -> [u8; DIR_HEADER] {
        let mut b = [0u8; DIR_HEADER];
        b[..8].copy_from_slice(DIR_MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[16..24].copy_from_slice(&self.start.to_le_bytes());
        b[24..32].copy_from_slice(&self.nonce.to_le_bytes());
        b
    }
    /// The writer and payload of a record file, or `None` for a file that
    /// is not one.
    fn parse(b: &[u8]) -> Option<(Writer, &[u8])> {
        if b.len() < DIR_HEADER || &b[..8] != DIR_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Some((
            Writer {
                pid: u32_at(8),
                start: u64_at(16),
                nonce: u64_at(24),
            },
            &b[DIR_HEADER..],
        ))
    }
    /// Whether the writer's process still runs: `Some(false)` where it has
    /// exited (no such process, a zombie, or another process under the same
    /// id), `None` where this system cannot tell (no `/proc`).
    fn alive(&self) -> Option<bool> {
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(stat) => {
                let (state, start) = parse_stat(&stat)?;
                Some(!matches!(state, 'Z' | 'X') && (self.start == 0 || start == self.start))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Path::new("/proc/self/stat").exists().then_some(false)
            }
            Err(_) => None,
        }
    }
}

/// The state and start time of a `/proc/<pid>/stat` line (the fields
/// after the command name, which may hold spaces and parentheses).
fn parse_stat(stat: &str) -> Option<(char, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields 4..=21 lie between the state (3) and the start time (22).
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// The start time of process `pid` (`/proc/<pid>/stat`), if readable.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat).map(|(_, start)| start)
}

/// Which directory a path named when it was checked: (device, inode).
type DirId = (u64, u64);

/// The effective user id of this process (who owns what it creates).
#[cfg(unix)]
fn this_user() -> u32 {
    // SAFETY: geteuid takes nothing, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// `Error::UnsafeRendezvous` for the rendezvous directory `dir`.
fn unsafe_dir(dir: &Path, reason: String) -> Error {
    Error::UnsafeRendezvous {
        what: "the rendezvous directory".into(),
        path: dir.to_path_buf(),
        reason,
    }
}

/// Why a file of `uid` and `mode` may not serve as a rendezvous directory
/// (or, `dir` false, as a record) of this user: `None` where it may.
#[cfg(unix)]
fn not_private(uid: u32, mode: u32, dir: bool) -> Option<String> {
    let me = this_user();
    if uid != me {
        return Some(format!(
            "is owned by user {uid}, not by this process's user {me}"
        ));
    }
    if dir && mode & 0o022 != 0 {
        return Some(format!(
            "has mode {:04o}: group or others may write to it",
            mode & 0o7777
        ));
    }
    None
}

/// Creates `dir` (mode 0700, with any missing parents) where it is
/// missing, checks that it is a private directory of this user (see
/// [`DirExchange`]) and makes it readable by its owner only; returns which
/// directory it is.
fn private_dir(dir: &Path) -> Result<DirId> {
    let failed =
        |what: &str, e: std::io::Error| Error::Rendezvous(format!("{what} {}: {e}", dir.display()));
    match std::fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                b.mode(0o700);
            }
            b.create(dir).map_err(|e| failed("creating", e))?;
        }
        Err(e) => return Err(failed("reading", e)),
    }
    let id = checked_dir(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::symlink_metadata(dir).map_err(|e| failed("reading", e))?;
        // Only this user may read the handles (they grant access to GPU memory).
        if m.mode() & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| failed("making private (mode 0700)", e))?;
        }
    }
    Ok(id)
}

/// Checks that `dir` is a directory, not a symbolic link, owned by this
/// user and writable by no one else; returns which directory it is.
fn checked_dir(dir: &Path) -> Result<DirId> {
    let m = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::Rendezvous(format!("reading {}: {e}", dir.display())))?;
    if m.file_type().is_symlink() {
        return Err(unsafe_dir(dir, "is a symbolic link".into()));
    }
    if !m.is_dir() {
        return Err(unsafe_dir(dir, "is not a directory".into()));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let Some(why) = not_private(m.uid(), m.mode(), true) {
            return Err(unsafe_dir(dir, why));
        }
        Ok((m.dev(), m.ino()))
    }
    #[cfg(not(unix))]
    Ok((0, 0))
}

/// Removes the file `path` (a link itself, never what it points to) if it is there.
fn remove_if_there(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::Rendezvous(format!(
            "removing {}: {e}",
            path.display()
        ))),
    }
}

/// Rank `rank`'s record file `path`, if there: opened without following a
/// symbolic link, and read only when it is a regular file owned by this
/// user (`Error::UnsafeRendezvous` otherwise, nothing read).
fn read_record(path: &Path, rank: usize) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    let refuse = |reason: String| Error::UnsafeRendezvous {
        what: format!("rank {rank}'s record"),
        path: path.to_path_buf(),
        reason,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // No link followed; a FIFO planted as a record does not block the open.
        opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK);
    }
    let mut f = match opts.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        #[cfg(unix)]
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refuse("is a symbolic link".into()))
        }
        Err(e) => {
            return Err(Error::Rendezvous(format!(
                "reading {}: {e}",
                path.display()
            )))
        }
    };
    let m = f
        .metadata()
        .map_err(|e| Error::Rendezvous(format!("reading {}: {e}", path.display())))?;
    if !m.is_file() {
        return Err(refuse("is not a regular file".into()));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if let Some(why) = not_private(m.uid(), m.mode(), false) {
            return Err(refuse(why));
        }
    }
    let mut b = Vec::new();
    f.read_to_end(&mut b)
        .map_err(|e| Error::Rendezvous(format!("reading {}: {e}", path.display())))?;
    Ok(Some(b))
}

/// Why a rank's file was not taken.
enum NotTaken {
    /// Not taken (stale, corrupt, another rendezvous): wait on.
    Skip(String),
    /// The writer seen in earlier rounds has exited.
    Exited(u32),
}

impl DirExchange {
    /// Rank `rank` of `world` meeting in `dir` (created, mode 0700, where
    /// missing); `timeout` bounds each round. `Error::UnsafeRendezvous`
    /// for a directory others could write records into (see the type).
    pub fn new(dir: &Path, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        if rank >= world {
            return Err(Error::Config(format!(
                "rank {rank} is outside a world of {world}"
            )));
        }
        // Without a trailing `/`, which would make lstat follow a link.
        let dir: PathBuf = dir.components().collect();
        let id = private_dir(&dir)?;
        // This rank's records of an earlier run (of this or an exited
        // process) must not be taken for this run's by a fast peer.
        let own = format!(".rank-{rank}");
        let tmp = format!(".rank-{rank}.");
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| Error::Rendezvous(format!("listing {}: {e}", dir.display())))?;
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if (name.starts_with("round-") && name.ends_with(&own))
                || (name.starts_with(".round-") && name.contains(&tmp))
            {
                remove_if_there(&e.path())?;
            }
        }
        Ok(DirExchange {
            dir,
            rank,
            world,
            timeout,
            round: Mutex::new(0),
            me: Writer::this_one(),
            known: Mutex::new(vec![None; world]),
            id,
        })
    }

    fn path(&self, round: u64, rank: usize) -> PathBuf {
        self.dir.join(format!("round-{round}.rank-{rank}"))
    }

    /// Rank `r`'s record in `bytes`, if this run's.
    fn take<'b>(
        &self,
        r: usize,
        bytes: &'b [u8],
        known: &mut [Option<Writer>],
    ) -> Result<&'b [u8], NotTaken> {
        let Some((w, payload)) = Writer::parse(bytes) else {
            return Err(NotTaken::Skip(format!(
                "a corrupt record ({} bytes that no DirExchange wrote)",
                bytes.len()
            )));
        };
        match known[r] {
            Some(k) if k == w => Ok(payload),
            Some(k) => Err(match k.alive() {
                Some(false) => NotTaken::Exited(k.pid),
                _ => NotTaken::Skip(format!(
                    "a record of another rendezvous (process {}), not of rank {r}'s current one (process {})",
                    w.pid, k.pid
                )),
            }),
            None => match w.alive() {
                Some(false) => Err(NotTaken::Skip(format!(
                    "a record of process {}, which has exited",
                    w.pid
                ))),
                _ => {
                    known[r] = Some(w);
                    Ok(payload)
                }
            },
        }
    }
}

/// One exchange round after a step that may fail on this rank alone:
/// returns this rank's own error, else `PeerSetupFailed` naming the first
/// rank whose step failed, else the step's value.
pub(crate) fn agree_setup<T>(
    exchange: &dyn Exchange,
    step: &'static str,
    local: Result<T>,
) -> Result<T> {
    const OK: &[u8] = b"setup ok";
    const FAILED: &[u8] = b"setup failed: ";
    let mine = match &local {
        Ok(_) => OK.to_vec(),
        Err(e) => [FAILED, e.to_string().as_bytes()].concat(),
    };
    let all = exchange.all_gather(&mine)?;
    let value = local?;
    for (peer, said) in all.iter().enumerate() {
        if said.as_slice() != OK {
            let reason = match said.strip_prefix(FAILED) {
                Some(r) => String::from_utf8_lossy(r).into_owned(),
                None => format!("it sent {} bytes that are not a setup status", said.len()),
            };
            return Err(Error::PeerSetupFailed {
                rank: exchange.rank(),
                peer,
                step,
                reason,
            });
        }
    }
    Ok(value)
}

/// Writes `payload` as rank `rank`'s record of round `round` in `dir`,
/// as written by process `pid` (start time `start`, 0: unknown): for tests
/// of stale and foreign records.
#[cfg(test)]
pub(crate) fn forge_dir_record(
    dir: &Path,
    round: u64,
    rank: usize,
    pid: u32,
    start: u64,
    payload: &[u8],
) {
    let w = Writer {
        pid,
        start,
        nonce: 7,
    };
    let mut b = w.header().to_vec();
    b.extend_from_slice(payload);
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(dir.join(format!("round-{round}.rank-{rank}")), b).expect("forge");
}

/// The id of a process that has exited (a child started and waited for).
#[cfg(test)]
pub(crate) fn exited_pid() -> u32 {
    let mut c = std::process::Command::new("true")
        .spawn()
        .or_else(|_| std::process::Command::new("/bin/true").spawn())
        .expect("start `true`");
    let pid = c.id();
    c.wait().expect("wait");
    pid
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
        self.gather_round(round, mine).inspect_err(|_| {
            // A failed round ends the rendezvous: no peer may take this
            // exchange's records for a later one.
            for k in round.saturating_sub(1)..=round {
                let _ = std::fs::remove_file(self.path(k, self.rank));
            }
        })
    }
}

impl DirExchange {
    /// Round `round` of [`Exchange::all_gather`].
    fn gather_round(&self, round: u64, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Error::Rendezvous(format!("{what} {}: {e}", p.display()))
        };
        // Still the directory `new` checked (not replaced since, nor
        // opened up to others).
        if checked_dir(&self.dir)? != self.id {
            return Err(unsafe_dir(
                &self.dir,
                "was replaced by another directory after the rendezvous began".into(),
            ));
        }
        let tmp = self.dir.join(format!(
            ".round-{round}.rank-{}.{}",
            self.rank,
            std::process::id()
        ));
        remove_if_there(&tmp)?;
        {
            let mut opts = std::fs::OpenOptions::new();
            // A new file: never one (or a link) already there.
            opts.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600).custom_flags(libc::O_NOFOLLOW);
            }
            use std::io::Write;
            let mut f = opts.open(&tmp).map_err(|e| io("writing", &tmp, e))?;
            f.write_all(&self.me.header())
                .and_then(|()| f.write_all(mine))
                .map_err(|e| io("writing", &tmp, e))?;
        }
        let mine_path = self.path(round, self.rank);
        std::fs::rename(&tmp, &mine_path).map_err(|e| io("publishing", &mine_path, e))?;
        let start = Instant::now();
        let mut out: Vec<Option<Vec<u8>>> = vec![None; self.world];
        out[self.rank] = Some(mine.to_vec());
        // Why each rank's file, if any, was not taken (the last reason).
        let mut skipped: Vec<Option<String>> = vec![None; self.world];
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let mut polls = 0u64;
        loop {
            polls += 1;
            for (r, slot) in out.iter_mut().enumerate() {
                if slot.is_some() {
                    continue;
                }
                let path = self.path(round, r);
                if let Some(b) = read_record(&path, r)? {
                    match self.take(r, &b, &mut known) {
                        Ok(payload) => *slot = Some(payload.to_vec()),
                        Err(NotTaken::Skip(why)) => skipped[r] = Some(why),
                        Err(NotTaken::Exited(pid)) => {
                            return Err(Error::PeerExited { rank: r, pid })
                        }
                    }
                }
            }
            if out.iter().all(Option::is_some) {
                if round > 1 {
                    let _ = std::fs::remove_file(self.path(round - 1, self.rank));
                }
                return Ok(out.into_iter().map(Option::unwrap_or_default).collect());
            }
            // A rank seen in an earlier round whose process has exited will
            // not come: say so now (every 50 polls, about 0.1 s).
            if polls % 50 == 0 {
                for (r, slot) in out.iter().enumerate() {
                    if let (None, Some(w)) = (slot, known[r]) {
                        if w.alive() == Some(false) {
                            return Err(Error::PeerExited {
                                rank: r,
                                pid: w.pid,
                            });
                        }
                    }
                }
            }
            if start.elapsed() > self.timeout {
                let missing = missing_ranks(&out);
                if let Some(&r) = missing.iter().find(|&&r| skipped[r].is_some()) {
                    return Err(Error::StaleRecord {
                        rank: r,
                        path: self.path(round, r),
                        reason: skipped[r].take().unwrap_or_default(),
                        waited: self.timeout,
                    });
                }
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
mod tests;
