//! Registered (zero-copy) input buffers: owned by the caller, allocated by
//! a group, read by the peers where they are.

use crate::driver::DeviceAlloc;
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use std::marker::PhantomData;
use std::sync::Arc;

/// Registered (zero-copy) input buffers, one per rank, owned by this value.
/// Peers read them directly, so the collective needs no copy. Write your
/// data into `ptr(rank)` (e.g. as the output of your own kernel, or with
/// [`RegisteredBuffers::copy_from`]) before the allreduce on the same stream.
///
/// Their pointer tables name the scratch and signal buffers of the group
/// that allocated them, so only that group accepts them
/// (`Error::ForeignRegistered` otherwise, also after that group is gone).
pub struct RegisteredBuffers<T: DeviceElement> {
    pub(crate) bufs: Vec<DeviceAlloc>,
    /// One pointer table per launching member of the group (one for
    /// virtual ranks, one per rank otherwise).
    pub(crate) tables: Vec<DeviceAlloc>,
    pub(crate) len: usize,
    pub(crate) group: u64,
    pub(crate) ctxs: Vec<Arc<CudaContext>>,
    pub(crate) _t: PhantomData<T>,
}

impl<T: DeviceElement> std::fmt::Debug for RegisteredBuffers<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffers")
            .field("dtype", &T::DTYPE)
            .field("ranks", &self.bufs.len())
            .field("len", &self.len)
            .field("group", &self.group)
            .finish()
    }
}

impl<T: DeviceElement> RegisteredBuffers<T> {
    /// Elements per rank.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Number of ranks (one buffer each).
    pub fn ranks(&self) -> usize {
        self.bufs.len()
    }
    /// Device pointer of rank `rank`'s buffer (16-byte aligned), on that
    /// rank's device.
    ///
    /// # Panics
    /// If `rank >= self.ranks()`, like slice indexing
    /// ([`RegisteredBuffers::copy_from`] returns `Error::RankOutOfRange`
    /// instead).
    pub fn ptr(&self, rank: usize) -> u64 {
        assert!(
            rank < self.bufs.len(),
            "RegisteredBuffers: rank {rank} out of range for {} ranks",
            self.bufs.len()
        );
        self.bufs[rank].ptr()
    }

    pub(crate) fn check_owner(&self, group: u64, count: usize) -> Result<()> {
        if self.group != group {
            return Err(Error::ForeignRegistered);
        }
        if count > self.len {
            return Err(Error::BufferTooSmall {
                what: "registered buffer",
                rank: 0,
                len: self.len,
                need: count,
            });
        }
        Ok(())
    }

    pub(crate) fn table_ptrs(&self) -> Vec<u64> {
        self.tables.iter().map(DeviceAlloc::ptr).collect()
    }

    /// `Error::RankOutOfRange` unless `rank` names one of the buffers.
    pub(crate) fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.bufs.len() {
            return Err(Error::RankOutOfRange {
                rank,
                ranks: self.bufs.len(),
            });
        }
        Ok(())
    }

    /// Copies `src` (a slice or view) into the start of rank `rank`'s
    /// buffer, ordered on `stream` (a stream of that rank's device).
    /// `Error::RankOutOfRange` for a rank the buffers do not have,
    /// `Error::BufferTooSmall` for a source longer than a buffer.
    pub fn copy_from(
        &self,
        rank: usize,
        stream: &Arc<CudaStream>,
        src: &impl DevicePtr<T>,
    ) -> Result<()> {
        self.check_rank(rank)?;
        let dst = self.bufs[rank].ptr();
        if src.len() > self.len {
            return Err(Error::BufferTooSmall {
                what: "registered buffer",
                rank,
                len: self.len,
                need: src.len(),
            });
        }
        let (p, g) = src.device_ptr(stream);
        // With cudarc's event tracking on, taking the pointer inside a
        // capture may have invalidated it (see `Error::CaptureInvalidated`).
        if stream.context().is_managing_stream_synchronization() {
            if let Some(cause) = crate::driver::capture_invalidated(stream)? {
                drop(g);
                let _ = stream.context().check_err();
                return Err(Error::CaptureInvalidated { cause });
            }
        }
        // SAFETY: both ranges are live device memory of at least src.len()
        // elements; the guard orders the read after the source's writers.
        let r =
            unsafe { crate::driver::copy_dtod_async(stream, dst, p, src.len() * T::DTYPE.size()) };
        drop(g);
        r
    }
}

impl<T: DeviceElement> Drop for RegisteredBuffers<T> {
    fn drop(&mut self) {
        // A kernel still in flight may read these buffers: wait for the
        // devices before the allocations are freed.
        // A failure is recorded in the context and reported by the next
        // check() (cudarc's deferred error), never dropped silently.
        for c in &self.ctxs {
            c.record_err(c.synchronize());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31: `copy_from` returned `Result` but panicked on a bad rank;
    /// the rank is checked first (no CUDA call is needed to see it).
    #[test]
    fn a_rank_outside_the_buffers_is_a_typed_error() {
        let reg = RegisteredBuffers::<f32> {
            bufs: Vec::new(),
            tables: Vec::new(),
            len: 0,
            group: 0,
            ctxs: Vec::new(),
            _t: PhantomData,
        };
        for rank in [0, 1, 7, usize::MAX] {
            match reg.check_rank(rank) {
                Err(Error::RankOutOfRange { rank: r, ranks: 0 }) => assert_eq!(r, rank),
                other => panic!("rank {rank}: {other:?}"),
            }
        }
    }
}
