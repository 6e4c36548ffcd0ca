//! A fused call's buffers: the device pointers of one call by rank
//! ([`NormPtrs`]), the call's shape from every rank's buffer lengths
//! ([`norm_shape`]), a multi-rank call's buffers checked and turned into
//! pointers with the guards that order them on their streams
//! ([`NormBuffers`]), and where the inputs are read from ([`NormInputs`]).

use crate::abi::{Dtype, MAX_RANKS};
use crate::checks::{by_rank, check_count};
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use crate::registered::RegisteredBuffers;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::sync::Arc;

/// Device pointers of one fused call, by rank (zero for ranks another
/// process runs).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormPtrs {
    pub inputs: [u64; MAX_RANKS],
    pub residual: [u64; MAX_RANKS],
    pub residual_out: [u64; MAX_RANKS],
    pub gamma: [u64; MAX_RANKS],
    pub normed: [u64; MAX_RANKS],
}

/// The shape of a fused call, `(rows, hidden)`, from every rank's buffer
/// lengths: inputs agree (`RankMismatch`), hidden is gamma's length (the
/// same on every rank), the inputs are whole rows (`NormShape`), residuals
/// and normed outputs hold them (`BufferTooSmall`); `eps` finite and >= 0.
pub(crate) fn norm_shape(
    dtype: Dtype,
    inputs: impl Iterator<Item = usize>,
    residuals: impl Iterator<Item = usize>,
    gammas: impl Iterator<Item = usize>,
    normed: impl Iterator<Item = usize>,
    eps: f32,
) -> Result<(usize, usize)> {
    let count = crate::checks::count_of(dtype, inputs, normed)?;
    for (rank, len) in residuals.enumerate() {
        if len < count {
            return Err(Error::BufferTooSmall {
                what: "residual",
                rank,
                len,
                need: count,
            });
        }
    }
    let mut hidden = None;
    for (rank, len) in gammas.enumerate() {
        let h = *hidden.get_or_insert(len);
        if len != h {
            return Err(Error::NormShape(format!(
                "gamma of rank {rank} has {len} elements, rank 0's {h}: give every rank the same hidden size"
            )));
        }
    }
    let hidden = hidden.unwrap_or(0);
    if !eps.is_finite() || eps < 0.0 {
        return Err(Error::NormShape(format!(
            "eps = {eps}: use a finite value >= 0"
        )));
    }
    if hidden == 0 {
        if count > 0 {
            return Err(Error::NormShape(
                "gamma is empty: its length is the hidden size".into(),
            ));
        }
        return Ok((0, 0));
    }
    if count % hidden != 0 {
        return Err(Error::NormShape(format!(
            "{count} elements are not whole rows of hidden size {hidden} (gamma's length)"
        )));
    }
    Ok((count / hidden, hidden))
}

impl NormPtrs {
    /// The pointers of one rank's call (a `ProcessGroup` rank), residual
    /// updated in place.
    pub(crate) fn one_rank(
        rank: usize,
        input: u64,
        residual: u64,
        gamma: u64,
        normed: u64,
    ) -> Self {
        let at = |p: u64| {
            let mut a = [0u64; MAX_RANKS];
            a[rank] = p;
            a
        };
        NormPtrs {
            inputs: at(input),
            residual: at(residual),
            residual_out: at(residual),
            gamma: at(gamma),
            normed: at(normed),
        }
    }
}

/// A multi-rank fused call's buffers, one per rank, checked (counts
/// against the world, shapes by [`norm_shape`]) and turned into device
/// pointers (buffer r's on `streams[r % streams.len()]`: a stream per
/// rank, or one for every rank), with the guards that order them on those
/// streams: keep it until the work that uses the pointers is enqueued.
/// The residual is updated in place.
pub(crate) struct NormBuffers<'a> {
    pub rows: usize,
    pub hidden: usize,
    pub ptrs: NormPtrs,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> NormBuffers<'a> {
    /// Staged inputs, read; the normed rows go to `normed`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn staged<T, I, R, G, O>(
        world: usize,
        streams: &'a [Arc<CudaStream>],
        inputs: &'a [&'a I],
        residual: &'a mut [R],
        gamma: &'a [&'a G],
        eps: f32,
        normed: &'a mut [O],
    ) -> Result<Self>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let lens = inputs.iter().map(|i| i.len()).collect();
        let normed_lens = normed.iter().map(|o| o.len()).collect();
        let mut b = Self::checked::<T, R, G>(
            world,
            streams,
            lens,
            Some(normed_lens),
            residual,
            gamma,
            eps,
        )?;
        b.ptrs.inputs = b.read(inputs, streams);
        b.ptrs.normed = b.write(normed, streams);
        Ok(b)
    }

    /// Staged inputs, overwritten by the normed rows.
    pub(crate) fn in_place<T, X, R, G>(
        world: usize,
        streams: &'a [Arc<CudaStream>],
        x: &'a mut [X],
        residual: &'a mut [R],
        gamma: &'a [&'a G],
        eps: f32,
    ) -> Result<Self>
    where
        T: DeviceElement,
        X: DevicePtrMut<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
    {
        let lens = x.iter().map(|i| i.len()).collect();
        let mut b = Self::checked::<T, R, G>(world, streams, lens, None, residual, gamma, eps)?;
        b.ptrs.inputs = b.write(x, streams);
        b.ptrs.normed = b.ptrs.inputs;
        Ok(b)
    }

    /// The first `count` elements of each rank's registered buffer, read
    /// where they are; the normed rows go to `normed`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn registered<T, R, G, O>(
        world: usize,
        streams: &'a [Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        residual: &'a mut [R],
        gamma: &'a [&'a G],
        eps: f32,
        normed: &'a mut [O],
    ) -> Result<Self>
    where
        T: DeviceElement,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let normed_lens = normed.iter().map(|o| o.len()).collect();
        let mut b = Self::checked::<T, R, G>(
            world,
            streams,
            vec![count; world],
            Some(normed_lens),
            residual,
            gamma,
            eps,
        )?;
        b.ptrs.inputs = by_rank((0..reg.ranks()).map(|r| reg.ptr(r)));
        b.ptrs.normed = b.write(normed, streams);
        Ok(b)
    }

    /// The checks, before any pointer is taken: one input, residual,
    /// gamma and (unless `normed_lens` is `None`: in place) normed output
    /// per rank (`RankCount`), then the shapes ([`norm_shape`]). Then the
    /// residual's and gamma's pointers.
    fn checked<T, R, G>(
        world: usize,
        streams: &'a [Arc<CudaStream>],
        input_lens: Vec<usize>,
        normed_lens: Option<Vec<usize>>,
        residual: &'a mut [R],
        gamma: &'a [&'a G],
        eps: f32,
    ) -> Result<Self>
    where
        T: DeviceElement,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
    {
        for (what, n) in [
            ("inputs", input_lens.len()),
            ("residuals", residual.len()),
            ("gammas", gamma.len()),
            (
                "normed outputs",
                normed_lens.as_ref().map_or(world, Vec::len),
            ),
        ] {
            check_count(what, n, world)?;
        }
        let (rows, hidden) = norm_shape(
            T::DTYPE,
            input_lens.into_iter(),
            residual.iter().map(|r| r.len()),
            gamma.iter().map(|g| g.len()),
            normed_lens.unwrap_or_default().into_iter(),
            eps,
        )?;
        let mut b = NormBuffers {
            rows,
            hidden,
            ptrs: NormPtrs::default(),
            guards: Vec::with_capacity(4 * world),
        };
        b.ptrs.residual = b.write(residual, streams);
        b.ptrs.residual_out = b.ptrs.residual;
        b.ptrs.gamma = b.read(gamma, streams);
        Ok(b)
    }

    /// Pointers of `bufs` for reading, by rank (buffer r's taken on
    /// `streams[r % streams.len()]`: its own stream, or the one stream of
    /// every rank); keeps their guards.
    fn read<T, B: DevicePtr<T>>(
        &mut self,
        bufs: &'a [&'a B],
        streams: &'a [Arc<CudaStream>],
    ) -> [u64; MAX_RANKS] {
        let ptrs = bufs
            .iter()
            .enumerate()
            .map(|(r, b)| b.device_ptr(&streams[r % streams.len()]));
        self.keep(ptrs)
    }

    /// Pointers of `bufs` for writing, as [`Self::read`].
    fn write<T, B: DevicePtrMut<T>>(
        &mut self,
        bufs: &'a mut [B],
        streams: &'a [Arc<CudaStream>],
    ) -> [u64; MAX_RANKS] {
        let ptrs = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, b)| b.device_ptr_mut(&streams[r % streams.len()]));
        self.keep(ptrs)
    }

    /// Keeps the guards of `ptrs` and lists the pointers by rank.
    fn keep(&mut self, ptrs: impl Iterator<Item = (u64, SyncOnDrop<'a>)>) -> [u64; MAX_RANKS] {
        by_rank(ptrs.map(|(p, g)| {
            self.guards.push(g);
            p
        }))
    }
}

/// Where a fused call's inputs are read from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum NormInputs<'a> {
    /// Copied into the staging buffers first (`p.inputs`), row chunk by
    /// row chunk.
    Staged,
    /// Read where they are, through one pointer table per member (a
    /// registered buffer or a captured one): one launch.
    ZeroCopy(&'a [u64]),
}
