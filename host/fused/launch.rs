//! The fused call's launches on a [`Collective`], for every group kind:
//! staged (row chunk by row chunk through the staging buffers) or
//! zero-copy (one launch per member), with the co-residency and cluster
//! checks of the plan's blocks.

use super::{NormInputs, NormPlan, NormPtrs};
use crate::abi::{Algorithm, Dtype, LaunchArgs, NormArgs, BUFFER_ALIGN, NORM_MAX_CTAS};
use crate::call_tag::CallDesc;
use crate::checks::{check_aligned, check_count};
use crate::collective::{disjoint, stage, Collective, Member};
use crate::error::{Error, Result};
use crate::launch::{Faults, Ranks};
use crate::plan::{AlgoChoice, Inputs};
use crate::ptx::{Entry, Op};
use cudarc::driver::CudaStream;
use std::sync::Arc;

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
        unsafe {
            self.add_rmsnorm_faults(
                streams,
                dtype,
                rows,
                hidden,
                eps,
                p,
                inputs,
                choice,
                Faults::default(),
            )
        }
    }

    /// Fault injection: a fused call of `rows x hidden` elements of `dtype`
    /// with `choice` over this group's own buffers (the staging buffers as
    /// inputs and gamma, the scratch as residual and both outputs) with
    /// `faults`: absent ranks leave at once, as dead peers would,
    /// mismatched ranks carry another call's tag. The others record an
    /// error, which [`Collective::check`] reports; the values are
    /// meaningless.
    pub(crate) fn add_rmsnorm_with_faults(
        &self,
        streams: &[&Arc<CudaStream>],
        faults: Faults,
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
            self.add_rmsnorm_faults(
                streams,
                dtype,
                rows,
                hidden,
                1e-6,
                &p,
                NormInputs::Staged,
                choice,
                faults,
            )
        }
    }

    /// [`Collective::add_rmsnorm`] with `faults` (fault injection; none
    /// normally).
    ///
    /// # Safety
    /// As for [`Collective::add_rmsnorm`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn add_rmsnorm_faults(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        p: &NormPtrs,
        inputs: NormInputs<'_>,
        choice: AlgoChoice,
        faults: Faults,
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
                let call_tag = self
                    .tags
                    .note(CallDesc::fused(rows, hidden, dtype, plan.algorithm));
                let mut args = NormArgs {
                    base: LaunchArgs {
                        table,
                        signals: self.signals,
                        count: (n * hidden) as u64,
                        timeout_ns: self.config.timeout_ns(),
                        rank,
                        absent_ranks: faults.absent,
                        mismatched_ranks: faults.mismatched,
                        call_tag,
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
    /// ([`crate::driver::Kernels::prepare`]): no driver call here, as a call inside a
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
