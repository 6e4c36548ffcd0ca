//! The collective core under [`crate::VirtualGroup`], [`crate::PeerGroup`]
//! and [`crate::ProcessGroup`]: the group's buffers and signals, its health,
//! the chunk loop of {plan, stage, launch}, `check` and `reset`. The groups
//! are front ends that turn their call shapes (all ranks at once, or one
//! rank per process) into the pointer arrays this core takes.
//!
//! A group launches through one or more *members*: a member is one kernel
//! launch per step on one stream — all ranks at once (virtual ranks) or one
//! real rank. Invariants:
//! - every member computes the same [`Plan`] from the same request, so all
//!   ranks run the same steps with the same grids (the barriers need it);
//! - a member's calls are ordered on the device even when they come on
//!   different streams (see [`Member::order`]): two calls on one group
//!   share its staging buffers and flags, so they must never overlap;
//! - after a kernel error (a peer timeout) the group is poisoned until
//!   `reset`: its ranks are out of step and a new collective would hang or
//!   mix epochs.

use crate::abi::{
    error_code, Algorithm, BarrierKind, Dtype, ErrorRecord, Signal, BUFFER_ALIGN, MAX_BLOCKS,
    MAX_RANKS,
};
use crate::call_tag::{CallDesc, TagBook};
use crate::checks::{check_aligned, check_count};
use crate::device::barrier::next_epoch;
use crate::driver::{self, DeviceAlloc, HostMailbox, Kernels, PlainData as _};
use crate::element::DeviceElement;
use crate::error::{Context as _, Error, Result};
use crate::launch::{launch_step, Faults, Ranks, Target};
use crate::ll;
use crate::plan::{AlgoChoice, Config, Inputs, Link, Plan, Request, Step};
use crate::registered::RegisteredBuffers;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::{Arc, Mutex};

/// A process-unique id per group: registered buffers carry the id of the
/// group whose scratch and signals their tables name.
pub(crate) fn next_group_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One rank's group-owned memory: staging (inputs are copied here), scratch
/// (two-stage partial sums) and the signal (flags, epochs, error record).
pub(crate) struct RankBuffers {
    pub(crate) staging: DeviceAlloc,
    pub(crate) scratch: DeviceAlloc,
    pub(crate) signal: DeviceAlloc,
}

impl RankBuffers {
    /// Staging and scratch of `config.max_bytes`; the signal followed by
    /// the landing zone of push collectives in a group of `world` ranks
    /// (one allocation, so one IPC handle maps both).
    pub(crate) fn new(ctx: &Arc<CudaContext>, config: &Config, world: usize) -> Result<Self> {
        let [staging, scratch, signal] = Self::sizes(config, world);
        Ok(RankBuffers {
            staging: DeviceAlloc::zeroed(ctx, staging)?,
            scratch: DeviceAlloc::zeroed(ctx, scratch)?,
            signal: DeviceAlloc::zeroed(ctx, signal)?,
        })
    }

    /// Bytes of the staging, scratch and signal allocations of a rank
    /// with `config` in a group of `world` ranks: what the kernels may
    /// touch in each (a peer's mapped buffers are checked against them).
    pub(crate) fn sizes(config: &Config, world: usize) -> [usize; 3] {
        [
            config.max_bytes,
            config.max_bytes,
            Signal::LANDING_OFFSET + config.landing_bytes(world),
        ]
    }
}

/// Whether the group may run: poisoned by a kernel error until `reset`.
struct Health(Mutex<Option<String>>);

impl Health {
    fn ensure_ok(&self) -> Result<()> {
        match &*self.0.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }
    fn poison(&self, e: &Error) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
    }
    fn clear(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// Where a group's push_ll landing zone lies in each rank's signal
/// allocation, for the look at a timed-out wait's words.
#[derive(Clone, Copy)]
pub(crate) struct LlZone {
    pub(crate) offset: u64,
    pub(crate) part: u64,
    pub(crate) world: usize,
}

/// A word a peer left for collective `epoch` in this rank's signal, as
/// the look at a timed-out wait reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerWord {
    /// A flag (`abi::flag_word`: epoch low, tag high).
    Flag(u64),
    /// The high halves of an LL pack's four words (`abi::ll_highs`).
    Ll([u32; 4]),
}

/// The tag of another call in word `w` of collective `epoch` (a word of
/// that epoch whose tag is not `mine`), if it holds one.
fn other_call(w: PeerWord, epoch: u32, mine: u32) -> Option<u32> {
    let theirs = match w {
        PeerWord::Flag(v) => (v as u32 == epoch).then_some((v >> 32) as u32),
        PeerWord::Ll(highs) => crate::abi::ll_tag(highs, epoch),
    }?;
    (theirs != mine).then_some(theirs)
}

/// Reads a rank's error record (through the ABI struct) and turns it into
/// an error. A code or barrier the kernels never write means the signal
/// memory is corrupted: reported as such, not guessed.
///
/// A timed-out wait is a [`Error::CallMismatch`] where the peer's words of
/// that collective in this rank's signal carry another call's tag: the
/// awaited flag, the peer's `Start` flag of that block or of block 0 (a
/// flag algorithm), or its first LL word (push_ll). Otherwise the peer is
/// dead or late: [`Error::PeerTimeout`].
fn read_error_record(rank: usize, signal: &DeviceAlloc, ll: LlZone, book: &TagBook) -> Result<()> {
    // The record alone: the flags behind it are read only for a timeout.
    let mut rec = [ErrorRecord::default()];
    signal.read_at(Signal::ERROR_OFFSET, &mut rec)?;
    let rec = rec[0];
    let corrupted = || Error::UnknownKernelError {
        rank,
        code: rec.code,
    };
    match rec.code {
        error_code::NONE => Ok(()),
        error_code::PEER_TIMEOUT => {
            let barrier = BarrierKind::from_u32(rec.barrier_kind()).ok_or_else(corrupted)?;
            let (p, b) = (rec.peer as usize, rec.block as usize);
            if p >= MAX_RANKS || b >= MAX_BLOCKS {
                return Err(corrupted());
            }
            let (e, mine) = (rec.epoch, rec.tag);
            let words = peer_words(signal, barrier, e, b, p, ll)?;
            match words.into_iter().find_map(|v| other_call(v, e, mine)) {
                Some(theirs) => Err(Error::CallMismatch {
                    rank: rec.rank as usize,
                    block: rec.block,
                    peer: rec.peer,
                    epoch: e,
                    mine: book.named(mine),
                    theirs: book.named(theirs),
                }),
                None => Err(Error::PeerTimeout {
                    rank: rec.rank as usize,
                    block: rec.block,
                    peer: rec.peer,
                    barrier,
                    epoch: e,
                }),
            }
        }
        error_code::BAD_LAUNCH => Err(Error::BadLaunch {
            rank: rec.rank as usize,
            block: rec.block,
        }),
        error_code::UNREGISTERED => Err(Error::Unregistered {
            rank: rec.rank as usize,
        }),
        _ => Err(corrupted()),
    }
}

/// Peer `p`'s words of collective `epoch` in this rank's signal, where a
/// wait of block `b` at `barrier` timed out: the awaited flag, its `Start`
/// flags of block `b` and of block 0, and (push_ll) the high halves of
/// the first pack of its part of the collective's slot (`crate::ll::slot`).
fn peer_words(
    signal: &DeviceAlloc,
    barrier: BarrierKind,
    epoch: u32,
    b: usize,
    p: usize,
    ll: LlZone,
) -> Result<Vec<PeerWord>> {
    let mut sig = [Signal::zeroed()];
    signal.read(&mut sig)?;
    let parity = (epoch & 1) as usize;
    let mut words = vec![
        PeerWord::Flag(sig[0].flag(barrier, parity, b, p)),
        PeerWord::Flag(sig[0].flag(BarrierKind::Start, parity, b, p)),
        PeerWord::Flag(sig[0].flag(BarrierKind::Start, parity, 0, p)),
    ];
    if p < ll.world && ll.part != 0 {
        let at = ll.offset + ll::slot(epoch, ll.world as u64, p as u64, ll.part);
        let mut w = [0u64; 4];
        signal.read_at(at as usize, &mut w)?;
        words.push(PeerWord::Ll(ll::highs(&[[w[0], w[1]], [w[2], w[3]]])));
    }
    Ok(words)
}

/// Copies elements `[offset, offset + len)` of `src` to the start of a
/// staging buffer, ordered on `stream`.
///
/// # Safety
/// `src` must hold `offset + len` elements of `size` bytes and `staging` at
/// least `len`, until the copy has run.
pub(crate) unsafe fn stage(
    staging: u64,
    src: u64,
    offset: usize,
    len: usize,
    size: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { driver::copy_dtod_async(stream, staging, src + (offset * size) as u64, len * size) }
}

/// Whether a staged `step` reads each rank's input in place
/// (`LaunchArgs::own_inputs`) instead of from a copy in the staging
/// buffer: push_ll reads no peer's input (a peer reads only the lines
/// this rank writes into its zone), so no copy is needed where each input
/// of the launch's `ranks` at the step's offset is aligned as the kernel's
/// pack loads need and no output of the call overlaps it anywhere in the
/// message (`count` elements): not another rank's output, of this launch or
/// of another launching member (a PeerGroup's ranks on one GPU share an
/// address space, and another rank writes its output while this one may
/// still read its input for its own sums), and not the rank's own output
/// unless it lies exactly over the input (the thread that writes a pack
/// read it first). `outputs` holds every output of the call this process
/// knows, by rank (0: a rank of another process). Elsewhere the step is
/// staged as before.
pub(crate) fn direct_input(
    step: &Step,
    ranks: impl Iterator<Item = usize> + Clone,
    count: usize,
    inputs: &[u64; MAX_RANKS],
    outputs: &[u64; MAX_RANKS],
    size: usize,
) -> bool {
    let at = |p: u64| p + (step.offset * size) as u64;
    let bytes = (count * size) as u64;
    step.entry.algorithm == Algorithm::PushLl
        && ranks.clone().all(|r| {
            at(inputs[r]) % BUFFER_ALIGN as u64 == 0
                && outputs.iter().enumerate().all(|(o, &out)| {
                    out == 0 || (o == r && out == inputs[r]) || disjoint(inputs[r], out, bytes)
                })
        })
}

/// The end of a call that took cudarc slices' pointers: drops their
/// guards (`guards`), and where the call was refused because cudarc's
/// event tracking invalidated a graph capture (`CaptureInvalidated`), drops
/// the deferred errors those guards then left on the streams' contexts
/// (their event records on the invalidated capture, part of the same
/// refusal, which the next `check()` would otherwise report as a driver
/// error).
pub(crate) fn settle<T, G>(r: Result<T>, guards: G, streams: &[&Arc<CudaStream>]) -> Result<T> {
    drop(guards);
    if matches!(r, Err(Error::CaptureInvalidated { .. })) {
        for s in streams {
            let _ = s.context().check_err();
        }
    }
    r
}

/// Whether `len` bytes at `a` and `len` bytes at `b` (one address space)
/// share no byte.
pub(crate) fn disjoint(a: u64, b: u64, len: u64) -> bool {
    a.saturating_add(len) <= b || b.saturating_add(len) <= a
}

/// One launching unit of a group (see the module docs).
pub(crate) struct Member {
    pub(crate) kernels: Arc<Kernels>,
    pub(crate) ranks: Ranks,
    /// Staging buffer of every rank this member fills, by rank.
    pub(crate) staging: [u64; MAX_RANKS],
    /// The pointer table of staged launches, on this member's device.
    pub(crate) staged_table: DeviceAlloc,
    /// The stream of this member's last call (see [`Member::order`]).
    last: Mutex<Option<Arc<CudaStream>>>,
    /// Where this member's kernels report an error to the host at once.
    pub(crate) mailbox: HostMailbox,
}

impl Member {
    pub(crate) fn new(
        kernels: Arc<Kernels>,
        ranks: Ranks,
        staging: [u64; MAX_RANKS],
        staged_table: DeviceAlloc,
    ) -> Result<Self> {
        let mailbox = HostMailbox::new(kernels.context())?;
        Ok(Member {
            kernels,
            ranks,
            staging,
            staged_table,
            last: Mutex::new(None),
            mailbox,
        })
    }

    fn context(&self) -> &Arc<CudaContext> {
        self.kernels.context()
    }

    pub(crate) fn owns(&self, world: usize) -> impl Iterator<Item = usize> + Clone + '_ {
        (0..world).filter(move |&r| match self.ranks {
            Ranks::All => true,
            Ranks::One(o) => o == r,
        })
    }

    /// Orders this call after the member's previous one when it comes on
    /// another stream: the calls share buffers and flags, so they must not
    /// overlap on the device. Refused (`StreamSwitchInCapture`) while either
    /// stream captures a graph.
    fn order(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(prev) = last.as_ref() {
            if prev.cu_stream() != stream.cu_stream() {
                driver::order_after(prev, stream)?;
            }
        }
        *last = Some(stream.clone());
        Ok(())
    }
}

/// The shared core of every group kind.
pub(crate) struct Collective {
    pub(crate) world: usize,
    pub(crate) config: Config,
    pub(crate) link: Link,
    /// Every rank's signal, as seen from this process's devices.
    pub(crate) signals: [u64; MAX_RANKS],
    pub(crate) members: Vec<Member>,
    /// The buffers this process owns, with their ranks (all ranks in one
    /// process; this process's rank for a ProcessGroup).
    pub(crate) own: Vec<(usize, RankBuffers)>,
    health: Health,
    pub(crate) id: u64,
    /// The last call launched with each tag, for naming a mismatch.
    pub(crate) tags: TagBook,
}

impl Collective {
    pub(crate) fn new(
        world: usize,
        config: Config,
        link: Link,
        signals: [u64; MAX_RANKS],
        members: Vec<Member>,
        own: Vec<(usize, RankBuffers)>,
    ) -> Self {
        Collective {
            world,
            config,
            link,
            signals,
            members,
            own,
            health: Health(Mutex::new(None)),
            id: next_group_id(),
            tags: TagBook::new(),
        }
    }

    /// Where this group's push_ll zone lies in a signal allocation.
    fn ll_zone(&self) -> LlZone {
        let (offset, part) = self.config.landing(Algorithm::PushLl, self.world);
        LlZone {
            offset,
            part,
            world: self.world,
        }
    }

    /// Refuses a call on a poisoned group, and turns an error a kernel has
    /// reported to the host mailbox since into that error (the group is
    /// poisoned by it). Cheap: reads host memory, no device synchronisation.
    pub(crate) fn ensure_ok(&self) -> Result<()> {
        self.health.ensure_ok()?;
        if self.members.iter().any(|m| m.mailbox.read() != 0) {
            self.read_records()?;
            // The mailbox was raised after the record was written, so a
            // record must be there; if not, say the signal is corrupted.
            let e = Error::UnknownKernelError { rank: 0, code: 0 };
            self.health.poison(&e);
            return Err(e);
        }
        Ok(())
    }

    /// Reads this process's error records; the first error poisons the group.
    fn read_records(&self) -> Result<()> {
        let ll = self.ll_zone();
        for (rank, b) in &self.own {
            read_error_record(*rank, &b.signal, ll, &self.tags)
                .inspect_err(|e| self.health.poison(e))?;
        }
        Ok(())
    }

    /// Checks one stream per member (on the member's device, no stream
    /// twice) and orders the call after the member's previous one.
    pub(crate) fn begin(&self, streams: &[&Arc<CudaStream>]) -> Result<()> {
        self.ensure_ok()?;
        check_count("streams", streams.len(), self.members.len())?;
        for (m, (s, member)) in streams.iter().zip(&self.members).enumerate() {
            let rank = match member.ranks {
                Ranks::One(r) => r,
                Ranks::All => m,
            };
            if s.context().cu_ctx() != member.context().cu_ctx() {
                return Err(Error::StreamDevice {
                    rank,
                    stream_device: s.context().ordinal(),
                    rank_device: member.context().ordinal(),
                });
            }
            if let Some(a) = streams[..m]
                .iter()
                .position(|p| p.cu_stream() == s.cu_stream())
            {
                return Err(Error::SharedStream { a, b: rank });
            }
        }
        for s in streams {
            // cudarc's event tracking (its default) makes the caller's
            // CudaSlices wait for events recorded before a capture, which
            // invalidates it: say so (the tracking already costs driver
            // calls; with it off this costs one atomic load).
            if s.context().is_managing_stream_synchronization() {
                if let Some(cause) = driver::capture_invalidated(s)? {
                    return Err(Error::CaptureInvalidated { cause });
                }
            }
        }
        for (s, member) in streams.iter().zip(&self.members) {
            member.order(s)?;
        }
        Ok(())
    }

    fn request(&self, dtype: Dtype, count: usize, inputs: Inputs, choice: AlgoChoice) -> Request {
        Request {
            dtype,
            count,
            world: self.world,
            link: self.link,
            virtual_ranks: self.members.first().is_some_and(|m| m.ranks == Ranks::All),
            inputs,
            choice,
        }
    }

    /// Staged allreduce: for each step of the plan, every member copies its
    /// ranks' chunk into their staging buffers and launches.
    ///
    /// # Safety
    /// For every rank r launched from this process, `inputs[r]` must be
    /// valid for reads and `outputs[r]` for writes of `count` elements of
    /// `dtype` on that rank's device until the work on its stream completes.
    pub(crate) unsafe fn staged(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        count: usize,
        inputs: &[u64; MAX_RANKS],
        outputs: &[u64; MAX_RANKS],
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        let plan = self.prepare(streams, dtype, count, Inputs::Staged, outputs, choice)?;
        let size = dtype.size();
        for step in plan.steps() {
            for (member, stream) in self.members.iter().zip(streams) {
                // push_ll reads no peer's input: where it can, each rank's
                // is read in place, with no copy into the staging buffer.
                let direct =
                    direct_input(&step, member.owns(self.world), count, inputs, outputs, size);
                if !direct {
                    for r in member.owns(self.world) {
                        // SAFETY: inputs[r] holds `count` elements (caller);
                        // staging holds max_bytes >= step.len * size (plan).
                        unsafe {
                            stage(
                                member.staging[r],
                                inputs[r],
                                step.offset,
                                step.len,
                                size,
                                stream,
                            )?
                        };
                    }
                }
                // SAFETY: the staged table names this group's live staging
                // and scratch buffers and signals; the inputs read in place
                // hold `count` elements (caller); outputs are the caller's
                // contract.
                unsafe {
                    self.launch_member(
                        member,
                        stream,
                        plan.call(),
                        &step,
                        member.staged_table.ptr(),
                        outputs,
                        direct.then_some(inputs),
                        Faults::default(),
                    )?
                };
            }
        }
        Ok(plan.algorithm)
    }

    /// Zero-copy allreduce over registered buffers, which must belong to
    /// this group (their tables name its scratch and signals) and hold
    /// `count` elements.
    ///
    /// # Safety
    /// `outputs[r]` as for [`Collective::staged`].
    pub(crate) unsafe fn registered<T: DeviceElement>(
        &self,
        streams: &[&Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &[u64; MAX_RANKS],
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        reg.check_owner(self.id, count)?;
        // SAFETY: the registered buffers hold >= count elements and their
        // tables name this group's scratch (owner checked); outputs are the
        // caller's contract.
        unsafe { self.zero_copy(streams, T::DTYPE, count, &reg.table_ptrs(), outputs, choice) }
    }

    /// Zero-copy allreduce: every member launches once with its own pointer
    /// table (`tables[m]`), whose inputs the peers read directly.
    ///
    /// # Safety
    /// Every table must name inputs holding `count` elements and this
    /// group's scratch; `outputs[r]` as for [`Collective::staged`].
    pub(crate) unsafe fn zero_copy(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        count: usize,
        tables: &[u64],
        outputs: &[u64; MAX_RANKS],
        choice: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("pointer tables", tables.len(), self.members.len())?;
        let plan = self.prepare(streams, dtype, count, Inputs::ZeroCopy, outputs, choice)?;
        for step in plan.steps() {
            for ((member, stream), &table) in self.members.iter().zip(streams).zip(tables) {
                // SAFETY: forwarded from the caller.
                unsafe {
                    self.launch_member(
                        member,
                        stream,
                        plan.call(),
                        &step,
                        table,
                        outputs,
                        None,
                        Faults::default(),
                    )?
                };
            }
        }
        Ok(plan.algorithm)
    }

    /// Launches `step` of the call `call` for `member` on `stream` with
    /// pointer table `table`.
    ///
    /// # Safety
    /// As for [`launch_step`]: the table names live buffers of this group
    /// holding what the step reads, and `outputs` are valid for it.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_member(
        &self,
        member: &Member,
        stream: &CudaStream,
        call: CallDesc,
        step: &Step,
        table: u64,
        outputs: &[u64; MAX_RANKS],
        own_inputs: Option<&[u64; MAX_RANKS]>,
        faults: Faults,
    ) -> Result<()> {
        // The whole call's tag in every chunk: ranks that differ only in
        // the number of chunks, or in the last one, differ in the first.
        let call_tag = self.tags.note(call);
        let target = Target {
            table,
            signals: &self.signals,
            outputs,
            faults,
            call_tag,
            host_error: member.mailbox.device_ptr(),
            own_inputs,
        };
        // SAFETY: forwarded from the caller.
        unsafe {
            launch_step(
                &member.kernels,
                stream,
                &self.config,
                self.world,
                step,
                member.ranks,
                &target,
            )
        }
    }

    /// What every collective does first: plan it (or refuse it), check the
    /// outputs' alignment, check the streams and order the call after the
    /// previous one (see [`Collective::begin`]).
    fn prepare(
        &self,
        streams: &[&Arc<CudaStream>],
        dtype: Dtype,
        count: usize,
        inputs: Inputs,
        outputs: &[u64; MAX_RANKS],
        choice: AlgoChoice,
    ) -> Result<Plan> {
        let plan = Plan::new(&self.config, self.request(dtype, count, inputs, choice))?;
        self.check_outputs(outputs)?;
        self.begin(streams)?;
        Ok(plan)
    }

    fn check_outputs(&self, outputs: &[u64; MAX_RANKS]) -> Result<()> {
        for member in &self.members {
            for r in member.owns(self.world) {
                check_aligned("output", r, outputs[r])?;
            }
        }
        Ok(())
    }

    /// Fault injection: a collective of `count` elements (at most what the
    /// staging buffers hold) of `dtype` with `algorithm` over the staging
    /// buffers with `faults`: absent ranks leave at once, as dead peers
    /// would, mismatched ranks carry another call's tag; results go to each
    /// rank's scratch. The others record an error, which
    /// [`Collective::check`] reports.
    pub(crate) fn launch_with_faults(
        &self,
        streams: &[&Arc<CudaStream>],
        faults: Faults,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        let count = count.min(self.config.max_bytes / dtype.size());
        let mut outputs = [0u64; MAX_RANKS];
        for (r, b) in &self.own {
            outputs[*r] = b.scratch.ptr();
        }
        let plan = self.prepare(
            streams,
            dtype,
            count,
            Inputs::Staged,
            &outputs,
            algorithm.into(),
        )?;
        for step in plan.steps() {
            for (member, stream) in self.members.iter().zip(streams) {
                // SAFETY: staging and scratch hold max_bytes >= count * 4.
                unsafe {
                    self.launch_member(
                        member,
                        stream,
                        plan.call(),
                        &step,
                        member.staged_table.ptr(),
                        &outputs,
                        None,
                        faults,
                    )?
                };
            }
        }
        Ok(())
    }

    /// Waits for every member's stream, then reports the first error a
    /// kernel of this process recorded; the group is poisoned by it.
    pub(crate) fn check(&self, streams: &[&Arc<CudaStream>]) -> Result<()> {
        check_count("streams", streams.len(), self.members.len())?;
        for (s, member) in streams.iter().zip(&self.members) {
            s.synchronize().during("cuStreamSynchronize")?;
            member
                .context()
                .check_err()
                .during("an earlier release of device memory or another deferred driver call")?;
            // Everything of this member on that stream has run.
            let mut last = member.last.lock().unwrap_or_else(|p| p.into_inner());
            if last
                .as_ref()
                .is_some_and(|l| l.cu_stream() == s.cu_stream())
            {
                *last = None;
            }
        }
        self.read_records()
    }

    /// Brings this process's ranks back to a clean state: waits for their
    /// devices, zeroes their signals (epochs and error records) and landing
    /// zones. Every rank
    /// of the group must reset before the next collective.
    pub(crate) fn reset(&self) -> Result<()> {
        for m in &self.members {
            m.context().synchronize().during("cuCtxSynchronize")?;
            *m.last.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        // The signal and the landing zones behind it: a line or slot a
        // failed push collective left there carries an epoch that the
        // epochs counted again from zero reach, and would pass for a peer's
        // data of a later collective.
        for (_, b) in &self.own {
            b.signal.clear()?;
        }
        for m in &self.members {
            m.mailbox.clear();
        }
        self.health.clear();
        Ok(())
    }

    /// Moves every block's epoch of every own rank `collectives` epochs on,
    /// as that many collectives that wrote no flag or landing zone would:
    /// for tests of long runs (a flag or line left untouched meanwhile
    /// must not pass for a fresh one). Waits for the device first.
    pub(crate) fn advance_epochs(&self, collectives: u32) -> Result<()> {
        for m in &self.members {
            m.context().synchronize().during("cuCtxSynchronize")?;
        }
        for (_, b) in &self.own {
            let mut sig = [Signal::zeroed()];
            b.signal.read(&mut sig)?;
            for e in sig[0].epoch.iter_mut() {
                *e = epoch_after(*e, collectives);
            }
            b.signal.write(&sig)?;
        }
        Ok(())
    }
}

/// The epoch `collectives` collectives after `e`, as the kernels count
/// ([`next_epoch`]: 0 is never used, `u32::MAX` is followed by 2).
fn epoch_after(mut e: u32, mut collectives: u32) -> u32 {
    while collectives > 0 && e < 2 {
        e = next_epoch(e);
        collectives -= 1;
    }
    if collectives == 0 {
        return e;
    }
    // From 2 on, epochs cycle through 2..=u32::MAX.
    const PERIOD: u64 = (1 << 32) - 2;
    ((u64::from(e) - 2 + u64::from(collectives)) % PERIOD + 2) as u32
}

#[cfg(test)]
mod tests;
