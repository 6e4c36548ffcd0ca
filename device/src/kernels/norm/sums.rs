// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// Where a fused row's rounded sums come from ([`RowSums`]), and the two
// pull sources: every rank's input reduced in rank order ([`Pull`],
// one-stage) and the rounded sums the row's owner left in its scratch
// ([`Scratch`], two-stage). The push_ll source is in ll_sums.rs.
// Invariant: every source gives the sums in the same order (rank order,
// rounded to the element type once), so the rest of a row's path gives
// the same bits whatever the algorithm.

/// Where a fused row's rounded sums come from: reduced from every rank's
/// input ([`Pull`], one-stage), loaded where the row's owner left them
/// ([`Scratch`], two-stage), or reduced from flag-in-data lines in this
/// rank's LL zone ([`LlSums`], push_ll). A type per case, so each kernel
/// holds only the code (and registers) of its own.
trait RowSums {
    /// Whether a wait can fail ([`RowSums::failed`]): the block then votes
    /// after every row.
    const CAN_FAIL: bool = false;
    /// Whether pass 1 takes two chunks per iteration, for chunks of
    /// `per_chunk` packs: more loads in flight, more registers.
    fn pairs(per_chunk: u64) -> bool;
    /// Called before row `row`: a source that depends on the row picks it.
    fn for_row(&mut self, _row: u64) {}
    /// Whether a wait of this thread failed (recorded); the block leaves
    /// after the row when any thread's did.
    fn failed(&self) -> bool {
        false
    }
    /// The rounded sums of pack `pi` of the message.
    ///
    /// # Safety
    /// Pack `pi` lies inside the message (whole rows of whole chunks).
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack;
    /// The rounded sum of element `idx` of the message, widened to f32.
    ///
    /// # Safety
    /// `idx` lies inside the message.
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32;
    /// The rounded sums of packs `a` and `b`: a thread's two places of a
    /// row on the register path, asked for together so that a source can
    /// have both in flight at once. A place the thread does not hold is
    /// asked for as a present pack (the caller clamps it) and its result
    /// ignored: no branch and no zeroed registers for absent places.
    ///
    /// # Safety
    /// As for [`RowSums::pack`], for each pack.
    #[inline(always)]
    unsafe fn pack2<E: Element>(&mut self, a: u64, b: u64) -> (Pack, Pack) {
        // SAFETY: forwarded caller contract.
        unsafe { (self.pack::<E>(a), self.pack::<E>(b)) }
    }
}

/// One-stage: every rank's input, reduced in rank order.
/// `inputs` stays where it is (the pointer table in global memory) for
/// the element path: a copy in registers cost 24 more of them (f32, 8
/// ranks, sm_80: 147).
struct Pull<'a, const N: usize> {
    inp: [*const Pack; N],
    inputs: &'a [u64; MAX_RANKS],
}

impl<'a, const N: usize> Pull<'a, N> {
    fn new(inputs: &'a [u64; MAX_RANKS]) -> Self {
        Pull {
            inp: [core::ptr::null::<Pack>(); N],
            inputs,
        }
    }
}

impl<const N: usize> RowSums for Pull<'_, N> {
    #[inline(always)]
    fn pairs(_: u64) -> bool {
        // 2 x 2 packs of N ranks fit 128 registers up to 4 ranks (2 x 1
        // packs of 7 and 8 ranks took up to 152 on sm_90).
        N <= 4
    }
    #[inline(always)]
    fn for_row(&mut self, _row: u64) {
        // The pointers into registers once per row (not once per launch:
        // held through the tree and the second pass they cost registers
        // the loads need, f32 w5 on sm_80: 137).
        let mut r = 0;
        while r < N {
            self.inp[r] = self.inputs[r] as *const Pack;
            r += 1;
        }
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // SAFETY: pack `pi` of every input is readable (caller contract).
        unsafe { reduce_at::<E, N>(&self.inp, pi) }
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        // SAFETY: element idx of every input is readable (caller contract).
        unsafe {
            let mut s = E::to_f32(ld_elem::<E>(self.inputs[0], idx));
            let mut r = 1;
            while r < N {
                s += E::to_f32(ld_elem::<E>(self.inputs[r], idx));
                r += 1;
            }
            E::to_f32(E::from_f32(s))
        }
    }
}

/// Two-stage: the rounded sums the row's owner stored in its scratch
/// (`cur`, picked by [`RowSums::for_row`]).
struct Scratch<'a, const N: usize> {
    scratch: &'a [u64; MAX_RANKS],
    rows: u64,
    cur: u64,
}

impl<'a, const N: usize> Scratch<'a, N> {
    fn new(scratch: &'a [u64; MAX_RANKS], rows: u64) -> Self {
        Scratch {
            scratch,
            rows,
            cur: 0,
        }
    }
}

impl<const N: usize> RowSums for Scratch<'_, N> {
    #[inline(always)]
    fn pairs(_: u64) -> bool {
        true
    }
    #[inline(always)]
    fn for_row(&mut self, row: u64) {
        // The owner of `row`: partitions are contiguous and ordered.
        let mut owner = 0usize;
        let mut q = 1;
        while q < N {
            if row >= partition(self.rows, N as u32, q as u32).0 {
                owner = q;
            }
            q += 1;
        }
        self.cur = self.scratch[owner];
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // SAFETY: pack `pi` of the owner's scratch (caller contract).
        unsafe { ld_pack((self.cur as *const Pack).add(pi as usize)) }
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        // SAFETY: element `idx` of the owner's scratch (caller contract).
        E::to_f32(unsafe { ld_elem::<E>(self.cur, idx) })
    }
}
