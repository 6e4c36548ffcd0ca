//! The communicator id [`Id`]: 128 bytes, as `ncclUniqueId`, naming a
//! rendezvous directory on this host.

use super::*;

/// Bytes of an [`Id`], as of `ncclUniqueId`.
pub const ID_BYTES: usize = 128;
/// The first bytes of every id (format version 1).
const ID_MAGIC: &[u8; 8] = b"P2PARID1";
/// Room for the directory's path: after the magic and one length byte.
pub const ID_MAX_PATH: usize = ID_BYTES - ID_MAGIC.len() - 1;

/// What ranks share to form one [`Comm::from_rank`] group: 128 bytes, as
/// `ncclUniqueId`, that name a rendezvous directory on this host (absolute
/// path, at most [`ID_MAX_PATH`] bytes). [`Id::new`] creates a fresh private
/// one (mode 0700) in the temporary directory; the ranks meet there through
/// a [`DirExchange`] (files, no server). Pass [`Id::internal`] (or
/// [`Id::to_bytes`]) to every rank unchanged; one id per group.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Id {
    internal: [c_char; ID_BYTES],
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.dir() {
            Ok(d) => f.debug_struct("Id").field("dir", &d).finish(),
            Err(_) => f.debug_struct("Id").field("dir", &"<not an id>").finish(),
        }
    }
}

impl Id {
    /// A fresh rendezvous directory, created (mode 0700) under
    /// `std::env::temp_dir()`, named in a new id. On one rank; the others
    /// get the bytes. `Error::CommId` when the temporary directory's path
    /// is too long for 128 bytes (set `TMPDIR` to a shorter one, or use
    /// [`Id::for_dir`]).
    pub fn new() -> Result<Id> {
        use std::hash::{BuildHasher, Hasher};
        let base = std::env::temp_dir();
        let mut last = None;
        for attempt in 0u32..16 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(attempt);
            let nonce = h.finish();
            let dir = base.join(format!("p2p-allreduce-{}-{nonce:016x}", std::process::id()));
            // Check that it fits before creating anything.
            let id = Id::for_dir(&dir)?;
            let mut b = std::fs::DirBuilder::new();
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                // The peers' IPC handles will lie here: this user only.
                b.mode(0o700);
            }
            match b.create(&dir) {
                Ok(()) => return Ok(id),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(Error::Rendezvous(format!(
                        "creating the id's directory {}: {e}",
                        dir.display()
                    )))
                }
            }
        }
        Err(Error::Rendezvous(format!(
            "no fresh directory under {} after 16 tries: {last:?}",
            base.display()
        )))
    }

    /// An id naming `dir` (absolute, at most [`ID_MAX_PATH`] bytes): the
    /// ranks will meet there (it is created, mode 0700, if missing). Use a
    /// fresh directory per group.
    pub fn for_dir(dir: &Path) -> Result<Id> {
        use std::os::unix::ffi::OsStrExt;
        let path = dir.as_os_str().as_bytes();
        if !dir.is_absolute() {
            return Err(Error::CommId {
                reason: format!("{} is not an absolute path", dir.display()),
            });
        }
        if path.len() > ID_MAX_PATH || path.contains(&0) {
            return Err(Error::CommId {
                reason: format!(
                    "the directory {} takes {} bytes, more than the {ID_MAX_PATH} an id holds (or holds a NUL); \
                     set TMPDIR to a shorter directory or pass one to Id::for_dir",
                    dir.display(),
                    path.len()
                ),
            });
        }
        let mut bytes = [0u8; ID_BYTES];
        bytes[..ID_MAGIC.len()].copy_from_slice(ID_MAGIC);
        bytes[ID_MAGIC.len()] = path.len() as u8;
        bytes[ID_MAGIC.len() + 1..][..path.len()].copy_from_slice(path);
        Ok(Id::from_bytes(bytes))
    }

    /// The id from its 128 bytes as [`Id::internal`] gave them (cudarc's
    /// signature); checked when a communicator is formed from it.
    pub fn uninit(internal: [c_char; ID_BYTES]) -> Id {
        Id { internal }
    }

    /// The 128 bytes to pass to the other ranks (cudarc's signature).
    pub fn internal(&self) -> &[c_char; ID_BYTES] {
        &self.internal
    }

    /// [`Id::internal`] as bytes (for a file or a socket).
    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        self.internal.map(|c| c as u8)
    }

    /// [`Id::uninit`] from bytes.
    pub fn from_bytes(bytes: [u8; ID_BYTES]) -> Id {
        Id {
            internal: bytes.map(|b| b as c_char),
        }
    }

    /// The rendezvous directory this id names, or `Error::CommId` for bytes
    /// that are not an id of this crate (an NCCL id, a truncated file).
    pub fn dir(&self) -> Result<PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        let b = self.to_bytes();
        let bad = |reason: String| Err(Error::CommId { reason });
        if &b[..ID_MAGIC.len()] != ID_MAGIC {
            return bad("it does not start with P2PARID1".into());
        }
        let len = b[ID_MAGIC.len()] as usize;
        if len == 0 || len > ID_MAX_PATH {
            return bad(format!(
                "its path length {len} is outside 1..={ID_MAX_PATH}"
            ));
        }
        let (path, rest) = b[ID_MAGIC.len() + 1..].split_at(len);
        if rest.iter().any(|&x| x != 0) || path.contains(&0) {
            return bad("bytes past its path are not zero".into());
        }
        let dir = PathBuf::from(std::ffi::OsStr::from_bytes(path));
        if !dir.is_absolute() {
            return bad(format!("{} is not an absolute path", dir.display()));
        }
        Ok(dir)
    }
}
