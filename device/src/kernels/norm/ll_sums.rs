// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The push_ll source of a fused row's sums ([`LlSums`]): this rank's own
// input and each peer's packs waited for in this rank's LL zone, reduced
// in rank order (the order of [`Pull`]). The rank loops are spelled out
// as literals (`for_ranks!`) so per-rank arrays stay in registers. A wait
// that times out records the error and counts as zeros; the block leaves
// after the row once any thread's wait failed.

/// push_ll: this rank's own input, and each peer's packs waited for in this
/// rank's LL zone (the slot of `epoch`), in rank order. A wait that times
/// out records the error, counts as zeros and sets `failed`; the caller
/// leaves once the block agrees (`bar.sync` with a predicate).
struct LlSums<const N: usize> {
    own_in: u64,
    /// This rank's LL zone.
    zone: u64,
    landing_part: u64,
    epoch: u32,
    /// What this rank's peers' words carry ([`ll_highs`]).
    tag: crate::ll::Highs,
    /// The call tag this rank carries, for its error record.
    call_tag: u32,
    rank: u32,
    /// `count` of the launch: the last pack is zero-padded past it.
    count: u64,
    timeout_ns: u64,
    own_sig: u64,
    host_error: u64,
    block: u32,
    failed: bool,
}

/// Runs `$body` for `$r` = 0, 1, ... below `$n` (at most
/// [`MAX_RANKS`]) as literals: arrays indexed by `$r` stay in registers
/// even where the body is too large for the compiler to unroll a loop
/// (the LL waits), which would index them at run time, in local memory.
macro_rules! for_ranks {
    ($n:expr, |$r:ident| $body:block) => {{
        for_ranks!(@one $n, $r, $body, 0);
        for_ranks!(@one $n, $r, $body, 1);
        for_ranks!(@one $n, $r, $body, 2);
        for_ranks!(@one $n, $r, $body, 3);
        for_ranks!(@one $n, $r, $body, 4);
        for_ranks!(@one $n, $r, $body, 5);
        for_ranks!(@one $n, $r, $body, 6);
        for_ranks!(@one $n, $r, $body, 7);
    }};
    (@one $n:expr, $r:ident, $body:block, $v:literal) => {{
        let $r: usize = $v;
        if $r < $n {
            $body
        }
    }};
}

const _: () = assert!(MAX_RANKS == 8, "for_ranks! spells out ranks 0..8");

/// Ranks up to which [`LlSums::pack2`] has every source's lines of both
/// packs in flight together (`2 * (N - 1)` lines of 32 bytes in registers;
/// more ranks wait pack by pack, as [`LlSums::pack`]: 3 ranks took up to
/// 146 registers on sm_90, over the 128 of a 512-thread block).
const LL_PAIRS_MAX_RANKS: usize = 2;

impl<const N: usize> LlSums<N> {
    /// Where source `r`'s lines of pack `pi` land in this rank's zone.
    #[inline(always)]
    fn slot(&self, r: usize, pi: u64) -> super::push_ll::GpuSlot {
        let part = crate::ll::slot(self.epoch, N as u64, r as u64, self.landing_part);
        super::push_ll::GpuSlot(self.zone + part + pi * crate::ll::LL_PACK_BYTES as u64)
    }

    /// Source `r`'s (a peer's) pack `pi`: from `look`, a first load of its
    /// lines, when that carries this collective's epoch, else waited for.
    /// A wait that times out records the error, counts as zeros and sets
    /// `failed`.
    #[inline(always)]
    fn finish(&mut self, r: usize, pi: u64, look: Lines) -> Pack {
        if let Some(p) = crate::ll::decode(&look, self.tag) {
            return p;
        }
        // After one timeout this thread waits no more: each later pack
        // would wait a whole timeout again (two rows: the error twice the
        // timeout after the peer died). The result is discarded anyway.
        if self.failed {
            return [0; 4];
        }
        let slot = self.slot(r, pi);
        match crate::ll::wait_pack(&slot, self.tag, self.timeout_ns, &mut GlobalTimer) {
            Some(p) => p,
            None => {
                if !self.failed {
                    // The data is the arrival: reported as the Start
                    // barrier's, as push_ll does.
                    // SAFETY: `own_sig` is this rank's own signal.
                    unsafe {
                        record_error(
                            self.own_sig,
                            self.host_error,
                            error_code::PEER_TIMEOUT,
                            self.rank,
                            self.block,
                            r as u32,
                            self.epoch,
                            BarrierKind::Start as u32,
                            self.call_tag,
                        )
                    };
                }
                self.failed = true;
                [0; 4]
            }
        }
    }

    /// Pack `pi` of source `r`; `WHOLE`: the pack lies wholly inside the
    /// message.
    ///
    /// # Safety
    /// `pi < ceil(count / lanes)` (WHOLE: `(pi + 1) * lanes <= count`); the
    /// zone is this rank's (contract).
    #[inline(always)]
    unsafe fn source<E: Element, const WHOLE: bool>(&mut self, r: usize, pi: u64) -> Pack {
        if r as u32 == self.rank {
            // SAFETY: pack `pi` of this rank's input (caller contract; with
            // WHOLE, the pack lies inside the message).
            return unsafe { super::push_ll::ld_own::<E, WHOLE>(self.own_in, pi, self.count) };
        }
        let look = self.slot(r, pi).load();
        self.finish(r, pi, look)
    }
}

impl<const N: usize> RowSums for LlSums<N> {
    const CAN_FAIL: bool = true;
    #[inline(always)]
    fn failed(&self) -> bool {
        self.failed
    }
    #[inline(always)]
    fn pairs(per_chunk: u64) -> bool {
        // `pack2` looks at both packs of every source at once up to
        // LL_PAIRS_MAX_RANKS ranks, for 16-bit types (f32, two packs per
        // chunk, took 134 registers on sm_80 with 2 ranks); the others
        // wait pack by pack.
        N <= LL_PAIRS_MAX_RANKS && per_chunk == 1
    }
    #[inline(always)]
    unsafe fn pack<E: Element>(&mut self, pi: u64) -> Pack {
        // Rank order, seeded with rank 0's values, each source added as it
        // arrives (no array of N packs).
        let mut acc = [0f32; 8];
        let mut r = 0;
        while r < N {
            // SAFETY: forwarded caller contract: `pack` is only called for
            // whole packs (rows of whole chunks).
            let x = E::unpack(unsafe { self.source::<E, true>(r, pi) });
            let mut l = 0;
            while l < 8 {
                acc[l] = if r == 0 { x[l] } else { acc[l] + x[l] };
                l += 1;
            }
            r += 1;
        }
        E::pack(&acc)
    }
    #[inline(always)]
    unsafe fn pack2<E: Element>(&mut self, a: u64, b: u64) -> (Pack, Pack) {
        if N > LL_PAIRS_MAX_RANKS {
            // SAFETY: forwarded caller contract.
            return unsafe { (self.pack::<E>(a), self.pack::<E>(b)) };
        }
        // First looks: this rank's two packs and every peer's lines of
        // both, all loads in flight before any is waited for; then the
        // waits (their order changes no value), then the sums in rank
        // order, seeded with rank 0's values. Peer `q` is rank `q` below
        // this rank and `q + 1` from it on: no branch on the rank, and
        // arrays indexed by literals only (registers).
        let peer_rank = |q: usize, rank: u32| q + (q as u32 >= rank) as usize;
        // Every address before any load: the loads then go out together.
        let mut at = [[0u64; 2]; MAX_RANKS];
        for_ranks!(N - 1, |q| {
            let r = peer_rank(q, self.rank);
            at[q] = [self.slot(r, a).0, self.slot(r, b).0];
        });
        let own_at = [
            self.own_in + a * size_of::<Pack>() as u64,
            self.own_in + b * size_of::<Pack>() as u64,
        ];
        let mut look = [[[[0u64; 2]; 2]; 2]; MAX_RANKS];
        let mut own = [[0u32; 4]; 2];
        // A branch that is always taken (an input is never at address 0):
        // the block boundary keeps ptxas from moving the first pack's
        // flag tests (and a stall on them) ahead of the other loads.
        if own_at[0] != 0 {
            for_ranks!(N - 1, |q| {
                look[q] = [
                    super::push_ll::GpuSlot(at[q][0]).load(),
                    super::push_ll::GpuSlot(at[q][1]).load(),
                ];
            });
            // SAFETY: packs `a`, `b` of this rank's input, whole (the
            // caller contract: rows of whole chunks).
            own = unsafe {
                [
                    ld_pack(own_at[0] as *const Pack),
                    ld_pack(own_at[1] as *const Pack),
                ]
            };
        }
        let mut peer = [[[0u32; 4]; 2]; MAX_RANKS];
        for_ranks!(N - 1, |q| {
            let r = peer_rank(q, self.rank);
            peer[q] = [self.finish(r, a, look[q][0]), self.finish(r, b, look[q][1])];
        });
        let mut acc = [[0f32; 8]; 2];
        for_ranks!(N, |r| {
            let mut x = own;
            for_ranks!(N - 1, |q| {
                if peer_rank(q, self.rank) == r {
                    x = peer[q];
                }
            });
            let (xa, xb) = (E::unpack(x[0]), E::unpack(x[1]));
            let mut l = 0;
            while l < 8 {
                acc[0][l] = if r == 0 { xa[l] } else { acc[0][l] + xa[l] };
                acc[1][l] = if r == 0 { xb[l] } else { acc[1][l] + xb[l] };
                l += 1;
            }
        });
        (E::pack(&acc[0]), E::pack(&acc[1]))
    }
    #[inline(always)]
    unsafe fn elem<E: Element>(&mut self, idx: u64) -> f32 {
        let lanes = E::LANES as u64;
        let (pi, k) = (idx / lanes, idx % lanes);
        let mut s = 0f32;
        let mut r = 0;
        while r < N {
            // SAFETY: forwarded caller contract (pi < ceil(count / lanes)).
            let p = unsafe { self.source::<E, false>(r, pi) };
            // Words chosen by comparisons: a run-time index into the pack
            // would put it in local memory.
            let w = if E::LANES == 4 { k } else { k / 2 };
            let word = if w == 0 {
                p[0]
            } else if w == 1 {
                p[1]
            } else if w == 2 {
                p[2]
            } else {
                p[3]
            };
            let bits = if E::LANES == 4 {
                word
            } else {
                (word >> (16 * (k % 2))) & 0xffff
            };
            let x = E::to_f32(bits);
            s = if r == 0 { x } else { s + x };
            r += 1;
        }
        E::to_f32(E::from_f32(s))
    }
}
