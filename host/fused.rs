//! The fused allreduce + residual add + RMSNorm: its plan (algorithm, row
//! chunks, blocks) and its launches, for every group kind. Numerics in
//! docs/numerics.md; the CPU oracle is `reference::add_rmsnorm_bits`.

use crate::abi::{
    norm_reg_path, norm_reg_slots, norm_split_range, Algorithm, Dtype, LaunchArgs, NormArgs,
    BUFFER_ALIGN, MAX_RANKS, NORM_CHUNK, NORM_MAX_CTAS, NORM_MAX_HIDDEN,
};
use crate::checks::{by_rank, check_aligned, check_count};
use crate::collective::{disjoint, stage, Collective, Member};
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use crate::launch::Ranks;
use crate::plan::{AlgoChoice, Config, Inputs, Link};
use crate::ptx::{Entry, Op};
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

/// The plan of one fused call: one algorithm for the whole call, the rows
/// of each launch, and the blocks per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormPlan {
    pub algorithm: Algorithm,
    pub rows: usize,
    pub hidden: usize,
    /// Rows per launch (all of them if they fit the staging buffers).
    pub rows_per_step: usize,
    /// Blocks per rank: `ctas` per row at a time (each block, or each
    /// cluster of `ctas` blocks, takes whole rows).
    pub blocks: u32,
    /// CTAs of the thread-block cluster that splits each row (fused
    /// push_ll on sm_90 and newer, [`split_ctas`]); 1: a block per row, no
    /// cluster.
    pub ctas: u32,
    /// Threads per block: on the register path
    /// ([`crate::abi::norm_reg_path`]) just enough warps for the row's
    /// chunks (fewer warps issue fewer instructions), else
    /// `Config::threads_per_block`.
    pub threads: u32,
}

impl NormPlan {
    /// The plan of `rows x hidden` elements of `dtype` per rank, or the
    /// error that refuses it: `hidden` 0 with rows, or above
    /// [`NORM_MAX_HIDDEN`] (`NormShape`); push, push_two_stage or
    /// push_islands (`NormAlgorithm`); staged, a row that does not fit the
    /// staging buffers (or, push_ll, its landing zone: `MessageTooLarge`),
    /// or rows that need chunks with chunking off; zero-copy (one launch,
    /// no chunks), two-stage rows that do not fit the scratch
    /// (`ScratchTooSmall`), push_ll rows that do not fit its landing zone
    /// (`ZoneTooSmall`); push_ll rows off the register path
    /// (`NormPushLlShape`: the fused push_ll kernel has no other path).
    /// `Auto` never refuses for room: zero-copy rows that do not fit the
    /// scratch run one-stage where the table says two-stage (the same bits).
    /// `Auto` runs push_ll where the allreduce of the same bytes would (and
    /// for one rank, where no allreduce runs: push_ll then sends and waits
    /// for nothing), the rows fit its zone and take the register path, else
    /// one-stage or two-stage as the allreduce would. `max_ctas`: the most CTAs over
    /// which push_ll may split a row ([`split_ctas`]): [`NORM_MAX_CTAS`]
    /// where every device of the group runs thread-block clusters (sm_90
    /// and newer), 1 where not (or where fewer must do: co-residency).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: &Config,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        world: usize,
        link: Link,
        choice: AlgoChoice,
        inputs: Inputs,
        max_ctas: u32,
    ) -> Result<NormPlan> {
        if hidden == 0 && rows > 0 {
            return Err(Error::NormShape(format!(
                "{rows} rows of hidden size 0: give hidden >= 1"
            )));
        }
        if hidden > NORM_MAX_HIDDEN {
            return Err(Error::NormShape(format!(
                "hidden size {hidden} is above the fused kernels' {NORM_MAX_HIDDEN}: use allreduce and a separate RMSNorm"
            )));
        }
        let row_bytes = hidden.max(1) * dtype.size();
        let total = rows * row_bytes;
        let ll_zone = config.push_ll_max_bytes;
        let max_threads = config.threads_per_block;
        let reg_path = norm_reg_path(dtype.lanes(), hidden as u64, max_threads as u64);
        // Elements one thread holds on the register path.
        let per_thread = NORM_CHUNK * norm_reg_slots(dtype.lanes());
        let mut algorithm = match choice {
            AlgoChoice::Auto => match config.choose(AlgoChoice::Auto, total, world, link) {
                _ if world <= 1 && total <= ll_zone && reg_path => Algorithm::PushLl,
                Algorithm::TwoStage => Algorithm::TwoStage,
                Algorithm::PushLl if total <= ll_zone && reg_path => Algorithm::PushLl,
                _ => Algorithm::OneStage,
            },
            AlgoChoice::OneStage => Algorithm::OneStage,
            AlgoChoice::TwoStage => Algorithm::TwoStage,
            AlgoChoice::PushLl if reg_path => Algorithm::PushLl,
            AlgoChoice::PushLl => {
                return Err(Error::NormPushLlShape {
                    dtype,
                    hidden,
                    max_hidden: per_thread * max_threads as usize,
                    threads: max_threads,
                })
            }
            other => {
                return Err(Error::NormAlgorithm(
                    other.explicit().unwrap_or(Algorithm::OneStage),
                ))
            }
        };
        let rows_per_step = if inputs == Inputs::ZeroCopy {
            // One launch; only two-stage needs room (scratch) for the sums:
            // `Auto` runs one-stage there (the same bits), an explicit
            // two-stage is refused.
            if choice == AlgoChoice::Auto
                && algorithm == Algorithm::TwoStage
                && total > config.max_bytes
            {
                algorithm = Algorithm::OneStage;
            }
            if algorithm == Algorithm::TwoStage && total > config.max_bytes {
                return Err(Error::ScratchTooSmall {
                    bytes: total,
                    capacity: config.max_bytes,
                });
            }
            if algorithm == Algorithm::PushLl && total > ll_zone {
                return Err(Error::ZoneTooSmall {
                    algorithm,
                    bytes: total,
                    capacity: ll_zone,
                });
            }
            rows.max(1)
        } else {
            // Staging holds the inputs and, two-stage, scratch the sums;
            // push_ll's landing zone holds its steps too.
            let capacity = if algorithm == Algorithm::PushLl {
                config.max_bytes.min(ll_zone)
            } else {
                config.max_bytes
            };
            let rows_per_step = capacity / row_bytes;
            if rows_per_step == 0 || (rows > rows_per_step && !config.chunking) {
                return Err(Error::MessageTooLarge {
                    bytes: if rows_per_step == 0 { row_bytes } else { total },
                    capacity,
                });
            }
            rows_per_step.min(rows.max(1))
        };
        // A block (push_ll with clusters: a cluster of `ctas` blocks) per
        // row up to the cap: every algorithm normalises every row on every
        // rank (two-stage reduces only a partition first).
        let cap = config.blocks_cap(link);
        let ctas = if algorithm == Algorithm::PushLl {
            split_ctas(
                config.fused_ctas,
                hidden / NORM_CHUNK,
                norm_reg_slots(dtype.lanes()),
                rows_per_step,
                world,
                cap,
                max_ctas,
            )
        } else {
            1
        };
        let row_blocks = (rows_per_step.min(u32::MAX as usize) as u32).clamp(1, cap / ctas);
        // Register path: a warp per 32 threads the chunks of a CTA's range
        // need, at most the configured block (a multiple of 32, checked by
        // Config).
        let threads = if reg_path {
            let chunks = (hidden / NORM_CHUNK) as u32;
            let local = norm_split_range(chunks, ctas).min(chunks) as usize;
            let need = (local * NORM_CHUNK).div_ceil(per_thread);
            (need.div_ceil(32) * 32).clamp(32, max_threads as usize) as u32
        } else {
            max_threads
        };
        Ok(NormPlan {
            algorithm,
            rows,
            hidden,
            rows_per_step,
            blocks: row_blocks * ctas,
            ctas,
            threads,
        })
    }

    /// `(first row, rows)` of each launch; one empty launch for no rows
    /// (it still runs the barriers, as every rank's call must).
    pub fn steps(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let n = self.rows.div_ceil(self.rows_per_step).max(1);
        (0..n).map(move |k| {
            let first = k * self.rows_per_step;
            (
                first,
                self.rows_per_step.min(self.rows - first.min(self.rows)),
            )
        })
    }
}

/// Least chunks per CTA that [`split_ctas`] gives a row under `Auto` (a
/// warp's worth): smaller ranges add a CTA for almost no work.
pub const AUTO_MIN_CTA_CHUNKS: usize = 32;

/// Threads of a whole-row block at and below which `Auto` keeps the rows
/// of a world of 2 whole: there the split cost more than it saved
/// (docs/design.md, "Splitting a fused row over a cluster").
pub const AUTO_WHOLE_ROW_THREADS_W2: usize = 256;

/// CTAs of the cluster that splits each fused push_ll row of `chunks`
/// chunks (`slots` per thread on the register path), for `rows` rows per
/// launch, a world of `world`, at most `cap` blocks per rank and at most
/// `max_ctas` (a power of two; 1: no clusters). `fused_ctas` when given (a
/// power of two; no more than `cap` and `max_ctas` allow). Else, from the
/// fused bench on one H200 (virtual ranks, docs/benchmarks.md): 8 or 4
/// CTAs, the most that keep every row's cluster within `cap` blocks and at
/// least [`AUTO_MIN_CTA_CHUNKS`] chunks per CTA; none for one rank (no
/// gain measured), for two ranks with rows that one block of at most
/// [`AUTO_WHOLE_ROW_THREADS_W2`] threads holds, and for 2 CTAs (which lost
/// to whole rows in most shapes).
pub fn split_ctas(
    fused_ctas: Option<u32>,
    chunks: usize,
    slots: usize,
    rows: usize,
    world: usize,
    cap: u32,
    max_ctas: u32,
) -> u32 {
    // The largest power of two at most `n` (n >= 1).
    let floor_pow2 = |n: u32| 1u32 << (31 - n.max(1).leading_zeros());
    let most = floor_pow2(cap.min(max_ctas).min(NORM_MAX_CTAS as u32));
    if let Some(k) = fused_ctas {
        return floor_pow2(k).min(most);
    }
    let whole_threads = chunks.div_ceil(slots.max(1));
    if world <= 1 || (world == 2 && whole_threads <= AUTO_WHOLE_ROW_THREADS_W2) {
        return 1;
    }
    for k in [8u32, 4] {
        if k <= most
            && rows.max(1) * k as usize <= cap as usize
            && norm_split_range(chunks as u32, k) as usize >= AUTO_MIN_CTA_CHUNKS
        {
            return k;
        }
    }
    1
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

impl Collective {
    /// Fused call: staged, for each row chunk every member copies its
    /// ranks' inputs into their staging buffers and launches; zero-copy,
    /// every member launches once with its pointer table.
    ///
    /// # Safety
    /// For every rank r launched from this process: `p.inputs[r]` (staged)
    /// or the inputs its table names (zero-copy, every rank's) and
    /// `p.residual[r]` valid for reads, `p.residual_out[r]` and
    /// `p.normed[r]` for writes of `rows * hidden` elements of `dtype`,
    /// `p.gamma[r]` for reads of `hidden`, on that rank's device, until the
    /// work on its stream completes; a zero-copy table names this group's
    /// scratch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn add_rmsnorm(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        p: &NormPtrs,
        inputs: NormInputs<'_>,
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        // SAFETY: forwarded caller contract.
        unsafe { self.add_rmsnorm_absent(streams, dtype, rows, hidden, eps, p, inputs, choice, 0) }
    }

    /// Fault injection: a fused call of `rows x hidden` elements of `dtype`
    /// with `choice` over this group's own buffers (the staging buffers as
    /// inputs and gamma, the scratch as residual and both outputs), in
    /// which the ranks in `absent` (a bit mask) leave at once, as dead
    /// peers would. The present ranks record a peer timeout, which
    /// [`Collective::check`] reports; the values are meaningless.
    pub(crate) fn add_rmsnorm_with_absent_ranks(
        &self,
        streams: &[&Arc<CudaStream>],
        absent: u32,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        let bytes = rows * hidden.max(1) * dtype.size();
        if bytes > self.config.max_bytes {
            return Err(Error::MessageTooLarge {
                bytes,
                capacity: self.config.max_bytes,
            });
        }
        let mut p = NormPtrs::default();
        for (r, b) in &self.own {
            p.inputs[*r] = b.staging.ptr();
            p.gamma[*r] = b.staging.ptr();
            p.residual[*r] = b.scratch.ptr();
            p.residual_out[*r] = b.scratch.ptr();
            p.normed[*r] = b.scratch.ptr();
        }
        // SAFETY: staging and scratch hold max_bytes >= rows * hidden
        // elements (checked) on each rank's device, and live as long as
        // the group (whose drop waits for the devices).
        unsafe {
            self.add_rmsnorm_absent(
                streams,
                dtype,
                rows,
                hidden,
                1e-6,
                &p,
                NormInputs::Staged,
                choice,
                absent,
            )
        }
    }

    /// [`Collective::add_rmsnorm`], with the ranks in `absent` leaving at
    /// once (fault injection; 0 normally).
    ///
    /// # Safety
    /// As for [`Collective::add_rmsnorm`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_rmsnorm_absent(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        p: &NormPtrs,
        inputs: NormInputs<'_>,
        choice: AlgoChoice,
        absent: u32,
    ) -> Result<Algorithm> {
        // The typed front ends check it in `norm_shape`; raw calls here.
        if !eps.is_finite() || eps < 0.0 {
            return Err(Error::NormShape(format!(
                "eps = {eps}: use a finite value >= 0"
            )));
        }
        let kind = match inputs {
            NormInputs::Staged => Inputs::Staged,
            NormInputs::ZeroCopy(tables) => {
                check_count("pointer tables", tables.len(), self.members.len())?;
                Inputs::ZeroCopy
            }
        };
        // Clusters where every member's kernels are built for sm_90 or
        // newer (the module loaded for its device).
        let clusters = self
            .members
            .iter()
            .all(|m| m.kernels.ptx.compute_capability.0 >= 9);
        let mut max_ctas = if clusters { NORM_MAX_CTAS as u32 } else { 1 };
        let plan = loop {
            let plan = NormPlan::new(
                &self.config,
                dtype,
                rows,
                hidden,
                self.world,
                self.link,
                choice,
                kind,
                max_ctas,
            )?;
            // Auto's split must leave every cluster resident at once: else
            // fewer CTAs per row (an explicit `fused_ctas` is refused
            // below instead, with `NotCoResident`).
            if plan.ctas == 1
                || self.config.fused_ctas.is_some()
                || self.clusters_fit(&plan, dtype)?
            {
                break plan;
            }
            max_ctas = plan.ctas / 2;
        };
        for member in &self.members {
            for r in member.owns(self.world) {
                for (what, ptr) in [
                    ("residual", p.residual[r]),
                    ("residual output", p.residual_out[r]),
                    ("gamma", p.gamma[r]),
                    ("normed output", p.normed[r]),
                ] {
                    check_aligned(what, r, ptr)?;
                }
            }
        }
        self.begin(streams)?;
        let size = dtype.size() as u64;
        for (first, n) in plan.steps() {
            let off = (first * hidden) as u64 * size;
            for (m, (member, stream)) in self.members.iter().zip(streams).enumerate() {
                // push_ll reads no peer's input: staged, each rank's rows are
                // read in place (no copy) unless an output of the call, of
                // any rank (other members' too: a PeerGroup's ranks on one
                // GPU share an address space), overlaps them (a normed row
                // written over x while another block still sends its
                // packs), or they are not aligned.
                let bytes = (rows * hidden) as u64 * size;
                let writes = p.normed.iter().chain(&p.residual_out);
                let direct = matches!(inputs, NormInputs::Staged)
                    && plan.algorithm == Algorithm::PushLl
                    && member.owns(self.world).all(|r| {
                        (p.inputs[r] + off) % BUFFER_ALIGN as u64 == 0
                            && writes
                                .clone()
                                .all(|&w| w == 0 || disjoint(p.inputs[r], w, bytes))
                    });
                let table = match inputs {
                    NormInputs::Staged if direct => member.staged_table.ptr(),
                    NormInputs::Staged => {
                        for r in member.owns(self.world) {
                            // SAFETY: inputs[r] holds rows * hidden elements
                            // (caller); staging holds max_bytes >= n * hidden
                            // (plan).
                            unsafe {
                                stage(
                                    member.staging[r],
                                    p.inputs[r],
                                    first * hidden,
                                    n * hidden,
                                    dtype.size(),
                                    stream,
                                )?
                            };
                        }
                        member.staged_table.ptr()
                    }
                    // One step (the plan): the table's inputs hold every row.
                    NormInputs::ZeroCopy(tables) => tables[m],
                };
                let (grid_y, rank) = match member.ranks {
                    Ranks::All => (self.world as u32, 0),
                    Ranks::One(r) => (1, r as u32),
                };
                let entry = Entry {
                    op: Op::AddRmsNorm,
                    algorithm: plan.algorithm,
                    dtype,
                    world: self.world,
                    virtual_ranks: member.ranks == Ranks::All,
                };
                let (fits, capacity, counted_at) = self.co_resident(member, entry, &plan)?;
                if !fits {
                    return Err(Error::NotCoResident {
                        blocks: plan.blocks * grid_y,
                        threads: counted_at,
                        capacity,
                    });
                }
                let (landing_offset, landing_part) =
                    self.config.landing(plan.algorithm, self.world);
                let mut args = NormArgs {
                    base: LaunchArgs {
                        table,
                        signals: self.signals,
                        count: (n * hidden) as u64,
                        timeout_ns: self.config.timeout_ns(),
                        rank,
                        absent_ranks: absent,
                        host_error: member.mailbox.device_ptr(),
                        landing_part,
                        landing_offset,
                        ..Default::default()
                    },
                    rows: n as u64,
                    hidden: hidden as u64,
                    eps,
                    ..Default::default()
                };
                for r in member.owns(self.world) {
                    if direct {
                        args.base.own_inputs[r] = p.inputs[r] + off;
                    }
                    args.base.outputs[r] = p.normed[r] + off;
                    args.residual[r] = p.residual[r] + off;
                    args.residual_out[r] = p.residual_out[r] + off;
                    args.gamma[r] = p.gamma[r];
                }
                // SAFETY: the table names inputs of n * hidden elements
                // (this group's staging: the plan; or the caller's zero-copy
                // buffers) and this group's scratch (max_bytes: the plan);
                // the other pointers are the caller's contract, offset to
                // this chunk.
                unsafe {
                    member.kernels.launch_norm(
                        stream,
                        entry,
                        (plan.blocks, grid_y),
                        plan.threads,
                        plan.ctas,
                        &args,
                    )?
                };
            }
        }
        Ok(plan.algorithm)
    }

    /// Whether `plan`'s blocks of `entry` can all be resident at once on
    /// `member`'s device, how many blocks can, and at how many threads per
    /// block that was counted. Blocks without clusters
    /// are counted at the configured block size (a launch of at most as
    /// many threads fits wherever that one does); clusters at the plan's
    /// block size, whole clusters. Both cached when the group was made
    /// ([`Kernels::prepare`]): no driver call here, as a call inside a
    /// graph capture must not make one.
    fn co_resident(
        &self,
        member: &Member,
        entry: Entry,
        plan: &NormPlan,
    ) -> Result<(bool, u32, u32)> {
        let grid_y = match member.ranks {
            Ranks::All => self.world as u32,
            Ranks::One(_) => 1,
        };
        if plan.ctas <= 1 {
            let threads = self.config.threads_per_block;
            let capacity = member.kernels.co_resident_blocks(entry, threads)?;
            return Ok((plan.blocks * grid_y <= capacity, capacity, threads));
        }
        let clusters = member
            .kernels
            .co_resident_clusters(entry, plan.threads, plan.ctas)?;
        Ok((
            plan.blocks / plan.ctas * grid_y <= clusters,
            clusters * plan.ctas,
            plan.threads,
        ))
    }

    /// Whether every member can hold `plan`'s clusters (of `dtype`) at once.
    fn clusters_fit(&self, plan: &NormPlan, dtype: Dtype) -> Result<bool> {
        for member in &self.members {
            let entry = Entry {
                op: Op::AddRmsNorm,
                algorithm: plan.algorithm,
                dtype,
                world: self.world,
                virtual_ranks: member.ranks == Ranks::All,
            };
            if !self.co_resident(member, entry, plan)?.0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Fused call with zero-copy input: the first `rows * hidden` elements
    /// of each rank's registered buffer (`reg`, which must belong to this
    /// group: `ForeignRegistered`, and hold them: `BufferTooSmall`), read
    /// where they are; one launch.
    ///
    /// # Safety
    /// As for [`Collective::add_rmsnorm`], for every pointer of `p` but the
    /// inputs (the registered buffers' tables name those).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn add_rmsnorm_registered<T: crate::element::DeviceElement>(
        &self,
        streams: &[&Arc<CudaStream>],
        reg: &crate::registered::RegisteredBuffers<T>,
        rows: usize,
        hidden: usize,
        eps: f32,
        p: &NormPtrs,
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        reg.check_owner(self.id, rows * hidden)?;
        let tables = reg.table_ptrs();
        // SAFETY: the tables name this group's registered buffers, which
        // hold the rows (checked) and stay allocated while `reg` lives
        // (its drop waits for the devices); the rest is the caller's.
        unsafe {
            self.add_rmsnorm(
                streams,
                T::DTYPE,
                rows,
                hidden,
                eps,
                p,
                NormInputs::ZeroCopy(&tables),
                choice,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::norm_reg_path_split;

    fn plan(c: &Config, rows: usize, hidden: usize, choice: AlgoChoice) -> Result<NormPlan> {
        NormPlan::new(
            c,
            Dtype::Bf16,
            rows,
            hidden,
            2,
            Link::NvLink,
            choice,
            Inputs::Staged,
            1,
        )
    }

    #[test]
    fn plans_take_whole_rows_and_refuse_what_cannot_run() {
        let c = Config::with_max_bytes(1 << 20);
        // Auto: push_ll, as the allreduce of the same bytes on two NVLink
        // GPUs (the built-in table), since the rows fit its zone.
        let p = plan(&c, 3, 7168, AlgoChoice::Auto).expect("plan");
        assert_eq!(p.algorithm, Algorithm::PushLl);
        assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 3)]);
        assert_eq!(p.blocks, 3);
        // Row chunks of what the staging buffers hold.
        let p = plan(&c, 300, 7168, AlgoChoice::TwoStage).expect("plan");
        let rows_per_step = (1 << 20) / (7168 * 2);
        assert_eq!(p.rows_per_step, rows_per_step);
        let steps: Vec<_> = p.steps().collect();
        assert_eq!(steps.iter().map(|s| s.1).sum::<usize>(), 300);
        assert!(steps.iter().all(|s| s.1 <= rows_per_step));
        // No rows: one launch of nothing.
        let p = plan(&c, 0, 7168, AlgoChoice::Auto).expect("plan");
        assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 0)]);
        assert!(matches!(
            plan(&c, 1, 0, AlgoChoice::Auto),
            Err(Error::NormShape(_))
        ));
        assert!(matches!(
            plan(&c, 1, NORM_MAX_HIDDEN + 1, AlgoChoice::Auto),
            Err(Error::NormShape(_))
        ));
        assert!(matches!(
            plan(&c, 1, 64, AlgoChoice::Push),
            Err(Error::NormAlgorithm(Algorithm::Push))
        ));
        // push_ll: chunks of what its landing zone holds.
        let p = plan(&c, 30, 7168, AlgoChoice::PushLl).expect("plan");
        assert_eq!(p.algorithm, Algorithm::PushLl);
        assert_eq!(p.rows_per_step, c.push_ll_max_bytes / (7168 * 2));
        assert_eq!(
            p.steps().map(|s| s.1).sum::<usize>(),
            30,
            "every row in some step"
        );
        // Rows beyond push_ll's zone: Auto falls back to the pull ones.
        let big = plan(&c, 64, 7168, AlgoChoice::Auto).expect("plan");
        assert_ne!(big.algorithm, Algorithm::PushLl);
        // One rank: no allreduce runs, and push_ll sends and waits for
        // nothing, so Auto takes it where the rows fit its zone and the
        // register path; else one-stage, as the allreduce.
        let one_rank = |rows, hidden| {
            NormPlan::new(
                &c,
                Dtype::Bf16,
                rows,
                hidden,
                1,
                Link::SameDevice,
                AlgoChoice::Auto,
                Inputs::Staged,
                1,
            )
            .expect("plan")
            .algorithm
        };
        assert_eq!(one_rank(3, 7168), Algorithm::PushLl);
        assert_eq!(one_rank(3, 7), Algorithm::OneStage, "off the register path");
        assert_eq!(one_rank(64, 7168), Algorithm::OneStage, "beyond the zone");
        let tiny = Config::with_max_bytes(256);
        assert!(matches!(
            plan(&tiny, 1, 4096, AlgoChoice::OneStage),
            Err(Error::MessageTooLarge { .. })
        ));
        let no_chunks = Config {
            chunking: false,
            ..Config::with_max_bytes(1 << 20)
        };
        assert!(matches!(
            plan(&no_chunks, 300, 7168, AlgoChoice::OneStage),
            Err(Error::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn push_ll_takes_register_path_rows_with_just_enough_warps() {
        let c = Config::with_max_bytes(1 << 20);
        let at = |dtype, hidden, choice| {
            NormPlan::new(
                &c,
                dtype,
                2,
                hidden,
                2,
                Link::NvLink,
                choice,
                Inputs::Staged,
                1,
            )
        };
        // 7168 bf16: 896 chunks, two per thread: 448 threads (14 warps).
        let p = at(Dtype::Bf16, 7168, AlgoChoice::PushLl).expect("plan");
        assert_eq!((p.algorithm, p.threads), (Algorithm::PushLl, 448));
        assert_eq!(
            at(Dtype::Bf16, 4096, AlgoChoice::Auto)
                .expect("plan")
                .threads,
            256
        );
        assert_eq!(
            at(Dtype::F16, 8, AlgoChoice::OneStage)
                .expect("plan")
                .threads,
            32
        );
        // f32: one chunk per thread.
        assert_eq!(
            at(Dtype::F32, 4096, AlgoChoice::TwoStage)
                .expect("plan")
                .threads,
            512
        );
        // Off the register path (not whole chunks, or more chunks than
        // the block holds): the configured block, and no push_ll.
        for (dtype, hidden) in [
            (Dtype::Bf16, 7),
            (Dtype::Bf16, 8200),
            (Dtype::F32, 4104),
            (Dtype::F32, 5120),
        ] {
            let p = at(dtype, hidden, AlgoChoice::Auto).expect("plan");
            assert_ne!(p.algorithm, Algorithm::PushLl, "{dtype:?} {hidden}");
            assert_eq!(p.threads, c.threads_per_block);
            let r = at(dtype, hidden, AlgoChoice::PushLl);
            assert!(
                matches!(r, Err(Error::NormPushLlShape { hidden: h, .. }) if h == hidden),
                "{dtype:?} {hidden}: {r:?}"
            );
            assert_eq!(
                at(dtype, hidden, AlgoChoice::OneStage)
                    .expect("plan")
                    .algorithm,
                Algorithm::OneStage
            );
        }
        // The largest register-path rows take push_ll.
        assert!(at(Dtype::Bf16, 8192, AlgoChoice::PushLl).is_ok());
        assert!(at(Dtype::F32, 4096, AlgoChoice::PushLl).is_ok());
    }

    #[test]
    fn plan_threads_keep_register_path_rows_on_it() {
        // The kernel takes the register path with the launch's block
        // (`blockDim.x = plan.threads`), and the fused push_ll has no other:
        // whatever block the plan picks must keep a register-path row on it.
        for max in [32u32, 64, 96, 256, 512, 1024] {
            let c = Config {
                threads_per_block: max,
                ..Config::with_max_bytes(1 << 20)
            };
            for dtype in Dtype::ALL {
                for hidden in 0..=16_400usize {
                    let p = NormPlan::new(
                        &c,
                        dtype,
                        1,
                        hidden.max(1),
                        2,
                        Link::NvLink,
                        AlgoChoice::OneStage,
                        Inputs::Staged,
                        1,
                    )
                    .expect("plan");
                    let lanes = dtype.lanes();
                    let on = norm_reg_path(lanes, p.hidden as u64, max as u64);
                    assert!(p.threads % 32 == 0 && (32..=max).contains(&p.threads));
                    if on {
                        assert!(
                            norm_reg_path(lanes, p.hidden as u64, p.threads as u64),
                            "{dtype:?} hidden {hidden}: {} threads leave the register path",
                            p.threads
                        );
                        // No more warps than the row's chunks need.
                        assert!(
                            p.threads == 32
                                || !norm_reg_path(lanes, p.hidden as u64, p.threads as u64 - 32)
                        );
                    } else {
                        assert_eq!(p.threads, max, "{dtype:?} hidden {hidden}");
                    }
                }
            }
        }
    }

    #[test]
    fn push_ll_rows_split_over_clusters_where_blocks_are_spare() {
        let plan_on = |c: &Config, rows, hidden, link, clusters| {
            NormPlan::new(
                c,
                Dtype::Bf16,
                rows,
                hidden,
                2,
                link,
                AlgoChoice::PushLl,
                Inputs::Staged,
                if clusters { NORM_MAX_CTAS as u32 } else { 1 },
            )
            .expect("plan")
        };
        let c = Config::with_max_bytes(1 << 20);
        // 7168 bf16 (896 chunks) on NVLink (64 blocks): 8 CTAs of 128
        // chunks (the last one idle), 64 threads each.
        let p = plan_on(&c, 1, 7168, Link::NvLink, true);
        assert_eq!((p.ctas, p.blocks, p.threads), (8, 8, 64));
        let p = plan_on(&c, 8, 7168, Link::NvLink, true);
        assert_eq!((p.ctas, p.blocks), (8, 64));
        // Same device (16 blocks): fewer CTAs per row as rows grow, never 2.
        for (rows, ctas, blocks) in [(1, 8, 8), (2, 8, 16), (3, 4, 12), (4, 4, 16), (5, 1, 5)] {
            let p = plan_on(&c, rows, 7168, Link::SameDevice, true);
            assert_eq!((p.ctas, p.blocks), (ctas, blocks), "{rows} rows");
        }
        // Two ranks keep rows whole that 256 threads hold (4096 bf16);
        // more ranks split them, down to 32 chunks per CTA.
        assert_eq!(plan_on(&c, 1, 4096, Link::NvLink, true).ctas, 1);
        for (world, hidden, ctas) in [
            (4, 4096, 8),
            (8, 2048, 8),
            (8, 1024, 4),
            (8, 64, 1),
            (1, 7168, 1),
        ] {
            let p = NormPlan::new(
                &c,
                Dtype::Bf16,
                1,
                hidden,
                world,
                Link::NvLink,
                AlgoChoice::PushLl,
                Inputs::Staged,
                NORM_MAX_CTAS as u32,
            )
            .expect("plan");
            assert_eq!(p.ctas, ctas, "world {world} hidden {hidden}");
        }
        // f32 4096 (512 chunks, one per thread: 512 threads) splits at w2.
        let f32_row = NormPlan::new(
            &c,
            Dtype::F32,
            1,
            4096,
            2,
            Link::NvLink,
            AlgoChoice::PushLl,
            Inputs::Staged,
            NORM_MAX_CTAS as u32,
        )
        .expect("plan");
        assert_eq!(f32_row.ctas, 8);
        // No clusters, or another algorithm: one block per row.
        let p = plan_on(&c, 1, 7168, Link::NvLink, false);
        assert_eq!((p.ctas, p.blocks, p.threads), (1, 1, 448));
        let one = NormPlan::new(
            &c,
            Dtype::Bf16,
            1,
            7168,
            2,
            Link::NvLink,
            AlgoChoice::OneStage,
            Inputs::Staged,
            1,
        )
        .expect("plan");
        assert_eq!(one.ctas, 1);
        // Explicit: as asked, within the block cap.
        for k in [1u32, 2, 4, 8] {
            let c = Config {
                fused_ctas: Some(k),
                ..Config::with_max_bytes(1 << 20)
            };
            let p = plan_on(&c, 5, 8, Link::SameDevice, true);
            assert_eq!((p.ctas, p.blocks % k), (k, 0), "fused_ctas {k}");
            let capped = Config {
                max_blocks: Some(3),
                ..c.clone()
            };
            assert_eq!(plan_on(&capped, 1, 7168, Link::NvLink, true).ctas, k.min(2));
        }
        assert_eq!(
            split_ctas(None, 896, 2, 0, 2, 64, 8),
            8,
            "no rows: one launch of nothing"
        );
    }

    #[test]
    fn split_plans_keep_every_cta_on_the_register_path() {
        // The kernel checks `norm_reg_path_split` with the launch's block
        // and cluster; whatever the plan picks must pass it.
        for k in [1u32, 2, 4, 8] {
            let c = Config {
                fused_ctas: Some(k),
                ..Config::with_max_bytes(1 << 20)
            };
            for dtype in Dtype::ALL {
                for hidden in (8..=8192usize).step_by(8) {
                    let Ok(p) = NormPlan::new(
                        &c,
                        dtype,
                        1,
                        hidden,
                        2,
                        Link::NvLink,
                        AlgoChoice::PushLl,
                        Inputs::Staged,
                        NORM_MAX_CTAS as u32,
                    ) else {
                        continue;
                    };
                    let lanes = dtype.lanes();
                    let (t, ctas) = (p.threads as u64, p.ctas);
                    assert!(
                        norm_reg_path_split(lanes, hidden as u64, t, ctas),
                        "{dtype:?} hidden {hidden} ctas {ctas}: {t} threads"
                    );
                    assert!(t == 32 || !norm_reg_path_split(lanes, hidden as u64, t - 32, ctas));
                    assert_eq!(p.blocks % p.ctas, 0);
                }
            }
        }
    }

    #[test]
    fn zero_copy_plans_are_one_launch() {
        let c = Config::with_max_bytes(1 << 20);
        let zc = |rows, choice| {
            NormPlan::new(
                &c,
                Dtype::Bf16,
                rows,
                7168,
                2,
                Link::NvLink,
                choice,
                Inputs::ZeroCopy,
                1,
            )
        };
        // One-stage reads the inputs where they are: any number of rows.
        let p = zc(300, AlgoChoice::OneStage).expect("plan");
        assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 300)]);
        assert_eq!(p.blocks, c.blocks_cap(Link::NvLink));
        // Two-stage needs the sums to fit the scratch.
        let fits = (1 << 20) / (7168 * 2);
        assert_eq!(
            zc(fits, AlgoChoice::TwoStage)
                .expect("plan")
                .steps()
                .count(),
            1
        );
        assert!(matches!(
            zc(fits + 1, AlgoChoice::TwoStage),
            Err(Error::ScratchTooSmall { .. })
        ));
        // push_ll needs the rows to fit its landing zone.
        let ll_fits = c.push_ll_max_bytes / (7168 * 2);
        assert_eq!(
            zc(ll_fits, AlgoChoice::PushLl)
                .expect("plan")
                .steps()
                .count(),
            1
        );
        assert!(matches!(
            zc(ll_fits + 1, AlgoChoice::PushLl),
            Err(Error::ZoneTooSmall {
                algorithm: Algorithm::PushLl,
                ..
            })
        ));
        assert_eq!(
            zc(0, AlgoChoice::Auto)
                .expect("plan")
                .steps()
                .collect::<Vec<_>>(),
            vec![(0, 0)]
        );
    }

    /// Issue 31: a zero-copy fused call under `Auto` whose rows exceed the
    /// scratch ran into `ScratchTooSmall` where the table says two-stage;
    /// it runs one-stage (one launch, the same bits), as the README and the
    /// groups' docs promise. An explicit two-stage is still refused.
    #[test]
    fn auto_zero_copy_runs_one_stage_where_the_scratch_is_short() {
        let mut t = crate::thresholds::Thresholds::default();
        t.set_bands(
            Link::NvLink,
            2,
            vec![crate::thresholds::Band {
                up_to: usize::MAX,
                algorithm: Algorithm::TwoStage,
            }],
        )
        .expect("valid bands");
        let c = Config {
            thresholds: t,
            ..Config::with_max_bytes(64 << 10)
        };
        let zc = |rows, choice| {
            NormPlan::new(
                &c,
                Dtype::F32,
                rows,
                4096,
                2,
                Link::NvLink,
                choice,
                Inputs::ZeroCopy,
                1,
            )
        };
        // 64 x 4096 f32 = 1 MiB of rows, 64 KiB of scratch.
        let p = zc(64, AlgoChoice::Auto).expect("Auto must run, not refuse");
        assert_eq!(p.algorithm, Algorithm::OneStage);
        assert_eq!(p.steps().collect::<Vec<_>>(), vec![(0, 64)]);
        // Rows that fit: two-stage, as the table says.
        assert_eq!(
            zc(4, AlgoChoice::Auto).expect("plan").algorithm,
            Algorithm::TwoStage
        );
        assert!(matches!(
            zc(64, AlgoChoice::TwoStage),
            Err(Error::ScratchTooSmall {
                bytes: 1_048_576,
                capacity: 65_536
            })
        ));
        // The other shape, with the built-in table and the default
        // config: 4096 x 8192 bf16 at world 8 (64 MiB > 32 MiB of scratch).
        let d = Config::default();
        for link in [Link::NvLink, Link::Pcie, Link::SameDevice] {
            let p = NormPlan::new(
                &d,
                Dtype::Bf16,
                4096,
                8192,
                8,
                link,
                AlgoChoice::Auto,
                Inputs::ZeroCopy,
                1,
            )
            .expect("Auto must run, not refuse");
            assert_ne!(p.algorithm, Algorithm::TwoStage, "{link:?}");
            assert_eq!(p.steps().count(), 1);
        }
    }
}
