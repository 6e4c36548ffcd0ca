// Included into `kernels` by kernels.rs (see there why `include!`).
//
// The element and pack loops every algorithm shares: element loads and
// stores ([`ld_elem`], [`st_elem`]), reductions in rank order over packs
// and over the tail that is no whole pack ([`reduce_range`],
// [`reduce_tail`]), copies ([`copy_range`]) and the push family's tail
// sends and landed-tail reductions.

/// Reads element `idx` (bits in the low bits) of a buffer of `E`.
///
/// # Safety
/// `base` must point to a buffer of `E` elements, aligned for them and
/// valid for reads of element `idx`.
#[inline(always)]
unsafe fn ld_elem<E: Element>(base: u64, idx: u64) -> u32 {
    // SAFETY: element `idx` of the buffer is readable (caller contract).
    unsafe {
        if E::LANES == 4 {
            read_volatile((base as *const u32).add(idx as usize))
        } else {
            read_volatile((base as *const u16).add(idx as usize)) as u32
        }
    }
}

/// Writes element `idx` (bits in the low bits) of a buffer of `E`.
///
/// # Safety
/// `base` must point to a buffer of `E` elements, aligned for them and
/// valid for writes of element `idx`.
#[inline(always)]
unsafe fn st_elem<E: Element>(base: u64, idx: u64, bits: u32) {
    // SAFETY: element `idx` of the buffer is writable (caller contract).
    unsafe {
        if E::LANES == 4 {
            write_volatile((base as *mut u32).add(idx as usize), bits)
        } else {
            write_volatile((base as *mut u16).add(idx as usize), bits as u16)
        }
    }
}

/// Reduces the `tail` elements after the last whole pack (grid-stride over
/// the whole grid), in rank order, into `output`.
///
/// # Safety
/// `inputs[..N]` must be valid for reads, and `output` for writes, of
/// elements `first .. first + tail`, all aligned for `E`.
#[inline(always)]
unsafe fn reduce_tail<E: Element, const N: usize>(
    inputs: &[u64; MAX_RANKS],
    output: u64,
    first: u64,
    tail: u64,
    g: u64,
    stride: u64,
) {
    // Grid-stride, so any launch shape covers the (at most 7) tail elements.
    let mut k = g;
    while k < tail {
        let idx = first + k;
        // SAFETY: first <= idx < first + tail, inside every input and the
        // output (caller contract).
        unsafe {
            let mut acc = E::to_f32(ld_elem::<E>(inputs[0], idx));
            let mut r = 1;
            while r < N {
                acc += E::to_f32(ld_elem::<E>(inputs[r], idx));
                r += 1;
            }
            st_elem::<E>(output, idx, E::from_f32(acc));
        }
        k += stride;
    }
}

/// Loads pack `i` of every rank's input (N independent loads in flight) and
/// reduces them in rank order.
///
/// # Safety
/// Every `inputs[r]` must be a 16-byte aligned global address valid for
/// reads of pack `i`.
#[inline(always)]
unsafe fn reduce_at<E: Element, const N: usize>(inputs: &[*const Pack; N], i: u64) -> Pack {
    let mut v = [[0u32; 4]; N];
    let mut r = 0;
    while r < N {
        // SAFETY: pack `i` of input r is readable (caller contract).
        v[r] = unsafe { ld_pack(inputs[r].add(i as usize)) };
        r += 1;
    }
    reduce_pack::<E, N>(&v)
}

/// A store that either stays in L2 for peers to read (`KEEP`: two-stage
/// scratch) or is marked evict-first (final results).
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for writes.
#[inline(always)]
unsafe fn store<const KEEP: bool>(p: *mut Pack, v: Pack) {
    // SAFETY: forwarded caller contract.
    unsafe {
        if KEEP {
            st_pack(p, v)
        } else {
            st_pack_streaming(p, v)
        }
    }
}

/// Reduces packs `first + g`, `first + g + stride`, ... below `end` into
/// `dst` (and `dst2` if not null). For N <= 4, two packs per iteration: 2N
/// loads in flight before the first add hide more memory latency than N.
/// Larger N already has 5..8 loads in flight, and unrolling would push the
/// register count past what 512-thread blocks can hold.
///
/// # Safety
/// Every `inputs[r]` must be valid for reads, and `dst` (and `dst2` unless
/// null) valid for writes, of packs `first .. end`; all of them 16-byte
/// aligned global addresses.
#[inline(always)]
unsafe fn reduce_range<E: Element, const N: usize, const KEEP: bool>(
    inputs: &[*const Pack; N],
    dst: *mut Pack,
    dst2: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    let mut i = first + g;
    while N <= 4 && i + stride < end {
        let mut v = [[0u32; 4]; N];
        let mut w = [[0u32; 4]; N];
        let mut r = 0;
        while r < N {
            // SAFETY: first <= i < i + stride < end: both packs are in
            // every input (caller contract).
            unsafe {
                v[r] = ld_pack(inputs[r].add(i as usize));
                w[r] = ld_pack(inputs[r].add((i + stride) as usize));
            }
            r += 1;
        }
        let a = reduce_pack::<E, N>(&v);
        let b = reduce_pack::<E, N>(&w);
        // SAFETY: both packs are below `end`, so inside `dst` and, when not
        // null, `dst2` (caller contract).
        unsafe {
            store::<KEEP>(dst.add(i as usize), a);
            store::<KEEP>(dst.add((i + stride) as usize), b);
            if !dst2.is_null() {
                st_pack_streaming(dst2.add(i as usize), a);
                st_pack_streaming(dst2.add((i + stride) as usize), b);
            }
        }
        i += 2 * stride;
    }
    while i < end {
        // SAFETY: first <= i < end: pack i is in every input, in `dst` and,
        // when not null, in `dst2` (caller contract).
        unsafe {
            let a = reduce_at::<E, N>(inputs, i);
            store::<KEEP>(dst.add(i as usize), a);
            if !dst2.is_null() {
                st_pack_streaming(dst2.add(i as usize), a);
            }
        }
        i += stride;
    }
}

/// Copies packs `first + g`, `first + g + stride`, ... below `end`, four
/// per iteration: a copy has no arithmetic to hide latency behind, so it
/// needs more loads in flight than the reductions. Stores are evict-first
/// (final results).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of packs
/// `first .. end`, both 16-byte aligned global addresses.
#[inline(always)]
unsafe fn copy_range(src: *const Pack, dst: *mut Pack, first: u64, end: u64, g: u64, stride: u64) {
    // SAFETY: forwarded caller contract.
    unsafe { copy_range_as::<false>(src, dst, first, end, g, stride) }
}

/// [`copy_range`] with plain stores, for data a peer reads next (landing
/// zones).
///
/// # Safety
/// As for [`copy_range`].
#[inline(always)]
unsafe fn copy_range_keep(
    src: *const Pack,
    dst: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    // SAFETY: forwarded caller contract.
    unsafe { copy_range_as::<true>(src, dst, first, end, g, stride) }
}

/// The loop of [`copy_range`], storing with [`store`]`::<KEEP>`.
///
/// # Safety
/// As for [`copy_range`].
#[inline(always)]
unsafe fn copy_range_as<const KEEP: bool>(
    src: *const Pack,
    dst: *mut Pack,
    first: u64,
    end: u64,
    g: u64,
    stride: u64,
) {
    let mut i = first + g;
    while i + 3 * stride < end {
        // SAFETY: first <= i < i + 3 * stride < end: all four packs are in
        // `src` and `dst` (caller contract).
        unsafe {
            let a = ld_pack(src.add(i as usize));
            let b = ld_pack(src.add((i + stride) as usize));
            let c = ld_pack(src.add((i + 2 * stride) as usize));
            let d = ld_pack(src.add((i + 3 * stride) as usize));
            store::<KEEP>(dst.add(i as usize), a);
            store::<KEEP>(dst.add((i + stride) as usize), b);
            store::<KEEP>(dst.add((i + 2 * stride) as usize), c);
            store::<KEEP>(dst.add((i + 3 * stride) as usize), d);
        }
        i += 4 * stride;
    }
    while i < end {
        // SAFETY: first <= i < end: pack i is in `src` and `dst` (caller
        // contract).
        unsafe { store::<KEEP>(dst.add(i as usize), ld_pack(src.add(i as usize))) };
        i += stride;
    }
}

/// push_two_stage and push_islands (one slot, parts of `a.landing_part`
/// bytes, the tail pack `tail` bytes into a part): this rank's `s.tail`
/// elements after its last whole pack into the tail pack of its part of
/// every peer's zone, grid-stride.
///
/// # Safety
/// `own_in` holds the message; `a.table` points to the group's
/// [`RankTable`], whose signals each hold such a zone at
/// `a.landing_offset`, with a tail pack of at least `s.tail` elements.
#[inline(always)]
unsafe fn send_tail<E: Element, const N: usize>(
    a: &LaunchArgs,
    rank: u32,
    own_in: u64,
    s: crate::reduce::Split,
    tail: u64,
    g: u64,
    stride: u64,
) {
    // SAFETY: `a.table` points to the group's RankTable (contract).
    let table = unsafe { &*(a.table as *const RankTable) };
    let mut t = g;
    while t < s.tail {
        // SAFETY: the tail element is inside the input; the tail pack of
        // every part holds `lanes > s.tail` elements.
        unsafe {
            let v = ld_elem::<E>(own_in, s.packs * E::LANES as u64 + t);
            let mut p = 0;
            while p < N {
                if p as u32 != rank {
                    let sig = read_volatile(&table.signals[p]);
                    let at = sig + a.landing_offset + rank as u64 * a.landing_part + tail;
                    st_elem::<E>(at, t, v);
                }
                p += 1;
            }
        }
        t += stride;
    }
}

/// The tail [`send_tail`] sent, after the arrivals that publish it:
/// reduced in rank order from this rank's input and the peers' tail packs
/// in its own zone (`zone`), into `output`.
///
/// # Safety
/// As for [`send_tail`], with `zone` this rank's zone, every peer's tail
/// pack filled before its published arrival, and `output` holding the
/// message.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_landed_tail<E: Element, const N: usize>(
    a: &LaunchArgs,
    rank: u32,
    own_in: u64,
    zone: u64,
    output: u64,
    s: crate::reduce::Split,
    tail: u64,
    g: u64,
    stride: u64,
) {
    let tail_at = s.packs * E::LANES as u64;
    let esize = 16 / E::LANES as u64;
    // `reduce_tail` indexes from the message start, so each peer's tail
    // pack is addressed as if it sat at the tail's position.
    let mut from = [0u64; MAX_RANKS];
    let mut r = 0;
    while r < N {
        from[r] = if r as u32 == rank {
            own_in
        } else {
            (zone + r as u64 * a.landing_part + tail).wrapping_sub(tail_at * esize)
        };
        r += 1;
    }
    // SAFETY: elements tail_at .. tail_at + tail of `from[r]` are the
    // peer's tail pack or this input's tail; the output holds them
    // (contract).
    unsafe { reduce_tail::<E, N>(&from, output, tail_at, s.tail, g, stride) };
}
