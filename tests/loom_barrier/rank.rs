//! One rank: its stream operations per collective, each algorithm's
//! kernel, on the memory of [`super::model`].

use super::*;

pub(crate) struct Rank<'a> {
    pub(crate) world: &'a [RankMem],
    pub(crate) me: usize,
    pub(crate) p: Protocol,
    pub(crate) clock: StepClock,
    /// The barriers this rank ran (arrived at), with their orders, in order.
    pub(crate) ran: Vec<(BarrierKind, Order)>,
}

pub(crate) enum Stop {
    Died,
    TimedOut,
}

impl<'a> Rank<'a> {
    pub(crate) fn new(world: &'a [RankMem], me: usize, p: Protocol) -> Self {
        Rank {
            world,
            me,
            p,
            clock: StepClock { now: 0 },
            ran: Vec::new(),
        }
    }

    /// Elements of this rank's call (`Protocol::short`).
    pub(crate) fn len(&self) -> usize {
        match self.p.short {
            Some((r, len)) if r == self.me => len,
            _ => self.p.len,
        }
    }

    /// The call tag this rank's words carry.
    pub(crate) fn tag(&self) -> u32 {
        self.p.tags[self.me]
    }

    /// This rank's flag word at `epoch` (`abi::flag_word`).
    pub(crate) fn word(&self, epoch: u32) -> u64 {
        epoch as u64 | (self.tag() as u64) << 32
    }

    /// This rank's LL high halves at `epoch` (`abi::ll_highs`).
    pub(crate) fn highs(&self, epoch: u32) -> ll::Highs {
        let a = LaunchArgs {
            call_tag: self.tag(),
            ..LaunchArgs::default()
        };
        ll_highs(epoch, &a, 0)
    }

    /// The end of a stream operation (input copy or kernel).
    pub(crate) fn stream_boundary(&self) {
        if self.p.hw.stream_order {
            fence(Ordering::Release);
        }
    }

    pub(crate) fn barrier(&mut self, c: u32, kind: BarrierKind, epoch: u32) -> Result<(), Stop> {
        self.barrier_among(c, kind, epoch, 0..self.p.world)
    }

    /// A barrier between the ranks of `among` only (push_islands' Relay),
    /// this rank one of them.
    pub(crate) fn barrier_among(
        &mut self,
        c: u32,
        kind: BarrierKind,
        epoch: u32,
        among: std::ops::Range<usize>,
    ) -> Result<(), Stop> {
        let Some(order) = self.p.order(kind) else {
            return Ok(());
        };
        if self.p.dies == Some((self.me, c, kind)) {
            return Err(Stop::Died);
        }
        self.ran.push((kind, order));
        let relaxed = order == Order::ArrivalOnly;
        if relaxed && kind == BarrierKind::End && self.p.hw.reads_done_before_end {
            fence(Ordering::Release);
        }
        // The kernels also exchange a flag with their own signal; it is
        // written and read by one thread in program order, so the model
        // leaves it out to keep loom's search small.
        for (peer, mem) in self.world.iter().enumerate() {
            if peer != self.me && among.contains(&peer) {
                arrive_ordered(mem.slot(kind, self.me), self.word(epoch), order);
            }
        }
        let own = &self.world[self.me];
        let mut failed = false;
        for peer in among.filter(|&p| p != self.me) {
            // Every peer is waited for, even after a timeout, as the
            // kernel's threads wait side by side.
            let flag = own.slot(kind, peer);
            let word = self.word(epoch);
            let (timeout, clock) = (self.p.timeout_ns, &mut self.clock);
            let w = match self.p.wait {
                WaitRule::Reached => wait_ordered(flag, word, timeout, clock, order),
                WaitRule::Equality => {
                    wait_ordered(&Exactly { flag, word }, word, timeout, clock, order)
                }
            };
            if w == Wait::TimedOut {
                record_error(own, self.me, peer, epoch, kind, self.tag());
                failed = true;
            }
        }
        if failed {
            return Err(Stop::TimedOut);
        }
        if relaxed && self.p.hw.polls_gate_accesses {
            fence(Ordering::Acquire);
        }
        Ok(())
    }

    pub(crate) fn read(cell: &UnsafeCell<u32>) -> u32 {
        // SAFETY: loom checks this read against every write of the cell.
        cell.with(|v| unsafe { *v })
    }

    pub(crate) fn write(cell: &UnsafeCell<u32>, value: u32) {
        // SAFETY: loom checks this write against every access of the cell.
        cell.with_mut(|v| unsafe { *v = value })
    }

    /// Reads element `i` of every rank's input, checking that each holds
    /// collective `c`'s value, and adds them.
    pub(crate) fn reduce(&self, c: u32, i: usize) -> u32 {
        let mut acc = 0u32;
        for (r, peer) in self.world.iter().enumerate() {
            let v = Self::read(&peer.input[i]);
            assert_eq!(
                v,
                input_value(c, r, i),
                "rank {} collective {c}: input {i} of rank {r} is stale: read before it was \
                 written for this collective, or after it was overwritten",
                self.me
            );
            acc = acc.wrapping_add(v);
        }
        acc
    }

    /// The landing slot of the collective with `epoch` (push).
    pub(crate) fn landing_slot(&self, epoch: u32) -> usize {
        (epoch % self.p.landing_slots) as usize
    }

    /// Push, phase 1: this rank's input into its part of every peer's
    /// landing zone (its own part is never written).
    pub(crate) fn push_to_peers(&self, epoch: u32) {
        let slot = self.landing_slot(epoch);
        let own = &self.world[self.me];
        for i in 0..self.len() {
            let v = Self::read(&own.input[i]);
            for (peer, mem) in self.world.iter().enumerate() {
                if peer != self.me {
                    Self::write(mem.landing(slot, self.me, i), v);
                }
            }
        }
    }

    /// Push, phase 2: element `i` of every source in rank order, its own
    /// from its input and the others' from its landing zone, checking that
    /// each holds collective `c`'s value, added.
    pub(crate) fn reduce_landed(&self, c: u32, epoch: u32, i: usize) -> u32 {
        let slot = self.landing_slot(epoch);
        let own = &self.world[self.me];
        let mut acc = 0u32;
        for src in 0..self.p.world {
            let v = if src == self.me {
                Self::read(&own.input[i])
            } else {
                Self::read(own.landing(slot, src, i))
            };
            assert_eq!(
                v,
                input_value(c, src, i),
                "rank {} collective {c}: landing slot {slot} part {src} element {i} is stale: \
                 read before rank {src} wrote it for this collective, or after it was \
                 overwritten",
                self.me
            );
            acc = acc.wrapping_add(v);
        }
        acc
    }

    /// The high halves push_ll packs of collective `epoch` carry.
    pub(crate) fn ll_epoch(&self, epoch: u32) -> ll::Highs {
        self.highs(self.p.ll_fixed_epoch.unwrap_or(epoch))
    }

    /// Pack `i` of this rank's input, zero past `len` (as the kernels'
    /// `ld_pack_upto`).
    pub(crate) fn own_ll_pack(&self, i: usize) -> [u32; 4] {
        let own = &self.world[self.me];
        let mut pack = [0u32; 4];
        for (k, v) in pack.iter_mut().enumerate() {
            if let Some(cell) = own.input.get(i * LL_LANES + k) {
                *v = Self::read(cell);
            }
        }
        pack
    }

    /// push_ll, phase 1: this rank's input, pack by pack, into its part of
    /// every peer's LL zone (its own part is never written).
    pub(crate) fn push_ll_to_peers(&self, epoch: u32) {
        for i in 0..self.len().div_ceil(LL_LANES) {
            let lines = ll::encode(self.own_ll_pack(i), self.ll_epoch(epoch));
            for (peer, mem) in self.world.iter().enumerate() {
                if peer != self.me {
                    let pack = mem.ll_pack(epoch, self.p.landing_slots, self.me, i);
                    LlView {
                        pack,
                        layout: self.p.ll_layout,
                    }
                    .store(lines);
                }
            }
        }
    }

    /// push_ll, phase 2: per pack, every source in rank order (its own
    /// from its input, the others waited for in its LL zone with the
    /// kernels' `ll::wait_pack`), each element checked to hold collective
    /// `c`'s value, added into `out`.
    pub(crate) fn reduce_ll(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let own = &self.world[self.me];
        for i in 0..self.len().div_ceil(LL_LANES) {
            let mut acc = [0u32; LL_LANES];
            for src in 0..self.p.world {
                let pack = if src == self.me {
                    self.own_ll_pack(i)
                } else {
                    let view = LlView {
                        pack: own.ll_pack(epoch, self.p.landing_slots, src, i),
                        layout: self.p.ll_layout,
                    };
                    let want = self.ll_epoch(epoch);
                    match ll::wait_pack(&view, want, self.p.timeout_ns, &mut self.clock) {
                        Some(p) => p,
                        None => {
                            record_error(own, self.me, src, epoch, BarrierKind::Start, self.tag());
                            return Err(Stop::TimedOut);
                        }
                    }
                };
                for (k, a) in acc.iter_mut().enumerate() {
                    let idx = i * LL_LANES + k;
                    if idx < self.len() {
                        assert_eq!(
                            pack[k],
                            input_value(c, src, idx),
                            "rank {} collective {c}: LL pack {i} of source {src} element {idx} \
                             is stale",
                            self.me
                        );
                        *a = a.wrapping_add(pack[k]);
                    }
                }
            }
            for (k, a) in acc.into_iter().enumerate() {
                if let Some(o) = out.get_mut(i * LL_LANES + k) {
                    *o = a;
                }
            }
        }
        Ok(())
    }

    /// PushTwoStage: partitions into their owners' landing zones, `Start`,
    /// the own partition reduced in rank order into the output and into
    /// every peer's zone, `Mid`, the peers' reduced partitions copied from
    /// the own zone. The kernels keep the two stages' data in separate
    /// regions of a part; here they are the same cells' disjoint indices
    /// (the owner's partition, then the source's own).
    pub(crate) fn push_two_stage(
        &mut self,
        c: u32,
        epoch: u32,
        out: &mut [u32],
    ) -> Result<(), Stop> {
        let (n, len) = (self.p.world, self.len());
        let slot = self.landing_slot(epoch);
        let part = |p: usize| {
            let (s, e) = partition(len as u64, n as u32, p as u32);
            s as usize..e as usize
        };
        for (p, mem) in self.world.iter().enumerate().filter(|(p, _)| *p != self.me) {
            for i in part(p) {
                let v = Self::read(&self.world[self.me].input[i]);
                Self::write(mem.landing(slot, self.me, i), v);
            }
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        for i in part(self.me) {
            out[i] = self.reduce_landed(c, epoch, i);
            for (p, mem) in self.world.iter().enumerate() {
                if p != self.me {
                    Self::write(mem.landing(slot, self.me, i), out[i]);
                }
            }
        }
        self.barrier(c, BarrierKind::Mid, epoch)?;
        for owner in (0..n).filter(|&p| p != self.me) {
            for i in part(owner) {
                out[i] = Self::read(self.world[self.me].landing(slot, owner, i));
                assert_eq!(
                    out[i],
                    expected_sum(c, n, i),
                    "rank {} collective {c}: landing slot {slot} part {owner} element {i} is stale: \
                     read before rank {owner} wrote its reduced partition, or after it was overwritten",
                    self.me
                );
            }
        }
        Ok(())
    }

    /// Element `i` of source `src`'s share as this rank reads it: its own
    /// input, or its part of this rank's landing zone, checked to hold
    /// collective `c`'s value.
    pub(crate) fn landed(&self, c: u32, epoch: u32, src: usize, i: usize) -> u32 {
        let own = &self.world[self.me];
        let slot = self.landing_slot(epoch);
        let v = if src == self.me {
            Self::read(&own.input[i])
        } else {
            Self::read(own.landing(slot, src, i))
        };
        assert_eq!(
            v,
            input_value(c, src, i),
            "rank {} collective {c}: part {src} element {i} is stale",
            self.me
        );
        v
    }

    /// PushIslands (device/src/kernels/push_islands.rs): island A is ranks
    /// `0..h`, B ranks `h..n`; partition `i < h` is owned by A's rank `i`
    /// and its counterpart `h + i`. Each rank writes its island owners'
    /// partitions into their zones, `Start`; A's owners add their island's
    /// values and write the (here wrapping) partial into the counterpart's
    /// zone, `Mid`; B's owners add theirs on top and write the result into
    /// their output, the counterpart's zone and their island peers' zones,
    /// `Back`; B copies the other partitions and is done; A takes its
    /// result, relays it within A, `Relay` (among A); A copies the rest.
    /// Cells: a source's scatter writes land at the owner's partition's
    /// indices of the source's part, its gather (and crossing) writes at
    /// its own partition's indices, which never meet.
    pub(crate) fn push_islands(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let (n, len, me) = (self.p.world, self.len(), self.me);
        let h = island_split(n);
        let slot = self.landing_slot(epoch);
        let part = |q: usize| {
            let (s, e) = partition(len as u64, h as u32, q as u32);
            s as usize..e as usize
        };
        let (first, size) = if me < h { (0, h) } else { (h, n - h) };
        let idx = me - first;
        for k in 1..size {
            let q = (idx + k) % size;
            if q < h {
                for i in part(q) {
                    let v = Self::read(&self.world[me].input[i]);
                    Self::write(self.world[first + q].landing(slot, me, i), v);
                }
            }
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        if n == 1 {
            for (i, o) in out.iter_mut().enumerate() {
                *o = self.landed(c, epoch, 0, i);
            }
            return Ok(());
        }
        if me < h {
            for i in part(me) {
                let acc = (0..h).fold(0u32, |a, src| a.wrapping_add(self.landed(c, epoch, src, i)));
                Self::write(self.world[me + h].landing(slot, me, i), acc);
            }
        }
        self.barrier(c, BarrierKind::Mid, epoch)?;
        if me >= h && idx < h {
            let cp = me - h;
            for i in part(idx) {
                let partial = Self::read(self.world[me].landing(slot, cp, i));
                let want = (0..h).fold(0u32, |a, r| a.wrapping_add(input_value(c, r, i)));
                assert_eq!(
                    partial, want,
                    "rank {me} collective {c}: partial {i} from rank {cp} is stale"
                );
                let acc = (h..n).fold(partial, |a, src| {
                    a.wrapping_add(self.landed(c, epoch, src, i))
                });
                out[i] = acc;
                Self::write(self.world[cp].landing(slot, me, i), acc);
                for q in (h..n).filter(|&q| q != me) {
                    Self::write(self.world[q].landing(slot, me, i), acc);
                }
            }
        }
        self.barrier(c, BarrierKind::Back, epoch)?;
        // The other partitions (for A: first its own, from across): each
        // from its owner's part of this rank's zone.
        let copy = |owner: usize, q: usize, out: &mut [u32]| {
            for i in part(q) {
                out[i] = Self::read(self.world[me].landing(slot, owner, i));
                assert_eq!(
                    out[i],
                    expected_sum(c, n, i),
                    "rank {me} collective {c}: part {owner} element {i} is stale"
                );
            }
        };
        if me >= h {
            for q in (0..h).filter(|&q| h + q != me) {
                copy(h + q, q, out);
            }
            return Ok(());
        }
        copy(me + h, me, out);
        for p in (0..h).filter(|&p| p != me) {
            for i in part(me) {
                Self::write(self.world[p].landing(slot, me, i), out[i]);
            }
        }
        if h > 1 {
            self.barrier_among(c, BarrierKind::Relay, epoch, 0..h)?;
        }
        for q in (0..h).filter(|&q| q != me) {
            copy(q, q, out);
        }
        Ok(())
    }

    /// One kernel: the collective `c` with this rank's input in place.
    pub(crate) fn kernel(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let (n, len) = (self.p.world, self.len());
        if self.p.algo == Algorithm::PushLl {
            // No barrier: a rank told to die at Start leaves before it
            // sends anything, as `absent_ranks` makes the kernel do.
            if self.p.dies == Some((self.me, c, BarrierKind::Start)) {
                return Err(Stop::Died);
            }
            self.push_ll_to_peers(epoch);
            return self.reduce_ll(c, epoch, out);
        }
        if self.p.algo == Algorithm::PushTwoStage {
            return self.push_two_stage(c, epoch, out);
        }
        if self.p.algo == Algorithm::PushIslands {
            return self.push_islands(c, epoch, out);
        }
        if self.p.algo == Algorithm::Push {
            self.push_to_peers(epoch);
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        match self.p.algo {
            Algorithm::Push => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.reduce_landed(c, epoch, i);
                }
            }
            Algorithm::OneStage => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.reduce(c, i);
                }
            }
            Algorithm::PushLl | Algorithm::PushTwoStage | Algorithm::PushIslands => {
                unreachable!("returned above")
            }
            Algorithm::TwoStage => {
                let (s, e) = partition(len as u64, n as u32, self.me as u32);
                for (i, o) in out.iter_mut().enumerate().take(e as usize).skip(s as usize) {
                    *o = self.reduce(c, i);
                    Self::write(&self.world[self.me].scratch[i], *o);
                }
                self.barrier(c, BarrierKind::Mid, epoch)?;
                for k in 1..n {
                    let owner = (self.me + k) % n;
                    let (s, e) = partition(len as u64, n as u32, owner as u32);
                    for (i, o) in out.iter_mut().enumerate().take(e as usize).skip(s as usize) {
                        *o = Self::read(&self.world[owner].scratch[i]);
                        assert_eq!(
                            *o,
                            expected_sum(c, n, i),
                            "rank {} collective {c}: scratch {i} of rank {owner} is stale",
                            self.me
                        );
                    }
                }
            }
        }
        self.barrier(c, BarrierKind::End, epoch)
    }

    pub(crate) fn run(mut self) -> Outcome {
        self.run_collectives()
    }

    /// [`Rank::run`], also returning the barriers the rank ran.
    pub(crate) fn run_recorded(mut self) -> (Outcome, Vec<(BarrierKind, Order)>) {
        let outcome = self.run_collectives();
        (outcome, self.ran)
    }

    pub(crate) fn run_collectives(&mut self) -> Outcome {
        let mut epoch = self.p.epoch_before;
        let mut out = vec![0u32; self.len()];
        if let Some((rank, yields)) = self.p.late {
            if rank == self.me {
                for _ in 0..yields {
                    loom::thread::yield_now();
                }
            }
        }
        for c in 0..self.p.collectives {
            // The input copy: a stream operation before the kernel.
            for i in 0..self.len() {
                Self::write(&self.world[self.me].input[i], input_value(c, self.me, i));
            }
            self.stream_boundary();
            epoch = next_epoch(epoch);
            assert_ne!(epoch, 0, "epoch 0 would match zeroed flags");
            match self.kernel(c, epoch, &mut out) {
                Ok(()) => {}
                Err(Stop::Died) => return Outcome::Died,
                Err(Stop::TimedOut) => {
                    let own = &self.world[self.me];
                    assert_eq!(
                        own.error.code.load(Ordering::Acquire),
                        error_code::PEER_TIMEOUT
                    );
                    // SAFETY: this rank's record is written only by this rank.
                    return Outcome::Failed(own.error.record.with(|r| unsafe { *r }));
                }
            }
            self.stream_boundary();
            for (i, &o) in out.iter().enumerate() {
                let want = expected_sum(c, self.p.world, i);
                assert_eq!(o, want, "rank {} collective {c} element {i}", self.me);
            }
        }
        Outcome::Done(out)
    }
}
