// Included into `kernels` by kernels.rs (see there why `include!`).
//
// The barrier flags' addresses ([`flag`]) and this rank's error record
// ([`record_error`]): claimed once, by a compare-and-swap, by the first
// thread of the rank that records an error, then the host's mailbox
// raised.

/// The flag that `from` writes into the signal at `sig` in collectives of
/// epoch parity `parity & 1` (a 64-bit word, `abi::flag_word`).
///
/// # Safety
/// `sig` must be the address of a [`Signal`] that stays mapped for `'a`,
/// `block < MAX_BLOCKS` and `from < MAX_RANKS`, and the flag must be
/// accessed only atomically while the reference lives.
#[inline(always)]
unsafe fn flag<'a>(sig: u64, kind: BarrierKind, parity: u32, block: u32, from: u32) -> &'a AtomicU64 {
    // SAFETY: `sig` is a Signal (caller contract) and the offset stays inside
    // it because block < MAX_BLOCKS and from < MAX_RANKS; flags are 8-byte
    // aligned u64s (the Signal is 128-byte aligned), which AtomicU64 may
    // alias.
    unsafe {
        &*((sig as usize + Signal::flag_offset(kind, parity as usize & 1, block as usize, from as usize))
            as *const AtomicU64)
    }
}

/// Claims this rank's error record and fills it, then raises the host's
/// mailbox (`host_error`, mapped pinned host memory; 0 for none) so the host
/// can see that a record exists without synchronising with the device.
/// Only own memory is touched.
///
/// # Safety
/// `own_sig` must be the address of this rank's own [`Signal`], in this
/// GPU's memory (the claim is an atomic compare-and-swap); `host_error`
/// zero or a device-mapped `u32` of host memory.
#[inline(always)]
unsafe fn record_error(
    own_sig: u64,
    host_error: u64,
    code: u32,
    rank: u32,
    block: u32,
    peer: u32,
    epoch: u32,
    barrier: u32,
    tag: u32,
) {
    let rec = (own_sig as usize + Signal::ERROR_OFFSET) as *mut ErrorRecord;
    // SAFETY: `rec` is the error record inside this rank's own signal (caller
    // contract), aligned and in local GPU memory; only the thread that wins
    // the compare-and-swap writes the other fields.
    unsafe {
        if atomic_cas_u32(core::ptr::addr_of_mut!((*rec).code), 0, code) == 0 {
            write_volatile(core::ptr::addr_of_mut!((*rec).rank), rank);
            write_volatile(core::ptr::addr_of_mut!((*rec).block), block);
            write_volatile(core::ptr::addr_of_mut!((*rec).peer), peer);
            write_volatile(core::ptr::addr_of_mut!((*rec).epoch), epoch);
            write_volatile(core::ptr::addr_of_mut!((*rec).barrier), barrier);
            write_volatile(core::ptr::addr_of_mut!((*rec).tag), tag);
            // The record is visible (system scope) before the mailbox says so.
            thread_fence_system();
            if host_error != 0 {
                write_volatile(host_error as *mut u32, code);
                thread_fence_system();
            }
        }
    }
}
