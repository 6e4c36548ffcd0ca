//! A small cuda_std-style module: the GPU intrinsics the kernels need, with
//! the names a CUDA programmer knows. Only compiled for `nvptx64`.
//!
//! Index intrinsics come from `core::arch::nvptx`; everything else is inline
//! PTX. Memory-touching asm blocks are not marked `nomem`, so the compiler
//! keeps them ordered with the surrounding loads and stores.

use crate::numeric::Pack;
use core::arch::asm;
use core::arch::nvptx;

#[inline(always)]
pub fn thread_idx_x() -> u32 {
    // SAFETY: reads a special register; always valid inside a kernel.
    unsafe { nvptx::_thread_idx_x() as u32 }
}
#[inline(always)]
pub fn block_idx_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_idx_x() as u32 }
}
#[inline(always)]
pub fn block_idx_y() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_idx_y() as u32 }
}
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_block_dim_x() as u32 }
}
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: as above.
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// `__syncthreads()`: every thread of the block must call it.
#[inline(always)]
pub fn sync_threads() {
    // SAFETY: callers keep control flow uniform across the block up to
    // here (the kernel crate is built with MIR jump threading off so the
    // compiler cannot duplicate it into divergent branches).
    unsafe { asm!("bar.sync 0;", options(nostack)) }
}

/// `__syncthreads_or(pred)`: a barrier that also returns whether any thread
/// of the block passed `true`.
#[inline(always)]
pub fn sync_threads_or(pred: bool) -> bool {
    let r: u32;
    // SAFETY: as for `sync_threads`; bar.red.or is a barrier plus a reduction.
    unsafe {
        asm!(
            "{{ .reg .pred p, q;",
            "setp.ne.u32 p, {x}, 0;",
            "bar.red.or.pred q, 0, p;",
            "selp.u32 {r}, 1, 0, q; }}",
            x = in(reg32) pred as u32, r = out(reg32) r,
            options(nostack));
    }
    r != 0
}

/// Square root rounded to nearest even (`sqrt.rn.f32`): correctly
/// rounded, as IEEE 754 requires and the CPU reference computes.
#[inline(always)]
pub fn sqrt_rn(x: f32) -> f32 {
    let r: f32;
    // SAFETY: an arithmetic instruction; no memory access.
    unsafe {
        asm!("sqrt.rn.f32 {r}, {x};", x = in(reg32) x, r = out(reg32) r,
            options(nostack, nomem, pure));
    }
    r
}

/// `shfl.sync.down.b32` over the whole warp: lane l gets lane l + `delta`'s
/// `v` (its own `v` where l + delta > 31). Every lane of the warp must call
/// it together.
#[inline(always)]
pub fn shfl_down(v: f32, delta: u32) -> f32 {
    let r: f32;
    // SAFETY: a warp shuffle; callers keep the warp converged (uniform
    // control flow), as the full mask requires.
    unsafe {
        asm!("shfl.sync.down.b32 {r}, {v}, {d}, 31, -1;",
            v = in(reg32) v, d = in(reg32) delta, r = out(reg32) r,
            options(nostack, nomem));
    }
    r
}

/// Declares a static shared array of the block (`$name`, `$bytes` bytes,
/// 16-byte aligned) in a nested scope of the calling kernel and gives its
/// shared-window address as [`SharedWords`]. Each function that expands it
/// is called once, at the top of the kernel, uniform across the block.
macro_rules! shared_words {
    ($name:literal, $bytes:literal) => {{
        let p: u32;
        // SAFETY: declares the block's shared array and takes its address;
        // no memory access.
        unsafe {
            asm!(
                concat!("{{ .shared .align 16 .b8 ", $name, "[", $bytes, "];"),
                concat!("mov.u32 {p}, ", $name, "; }}"),
                p = out(reg32) p,
                options(nostack, nomem));
        }
        SharedWords(p)
    }};
}

/// The block's [`crate::abi::NORM_MAX_CHUNKS`] f32 words of static shared
/// memory for the fused RMSNorm's sum of squares, as a shared-window
/// address: accessed with `ld.shared` / `st.shared` (a generic volatile
/// access compiles to a strong system-scope load or store).
/// 16 KiB = NORM_MAX_CHUNKS * 4 (asserted in abi.rs).
#[inline(always)]
pub fn norm_shared() -> SharedWords {
    shared_words!("p2p_norm_partials", "16384")
}

/// The block's [`crate::abi::NORM_CLUSTER_WORDS`] f32 words of static shared
/// memory through which the CTAs of a thread-block cluster exchange a fused
/// row's partial sums (stored into by the other CTAs with
/// [`SharedWords::store2_cluster`]). 128 bytes = NORM_CLUSTER_WORDS * 4
/// (asserted in abi.rs).
#[inline(always)]
pub fn norm_cluster_words() -> SharedWords {
    shared_words!("p2p_norm_cluster", "128")
}

/// The CTAs of this block's thread-block cluster (`%cluster_nctarank`) and
/// this block's rank in it (`%cluster_ctarank`): `(1, 0)` for a launch
/// without clusters, and always before sm_90, which has none.
#[inline(always)]
pub fn cluster_shape() -> (u32, u32) {
    #[cfg(target_feature = "sm_90")]
    {
        let (n, r): (u32, u32);
        // SAFETY: reads special registers; valid in any kernel on sm_90+.
        unsafe {
            asm!("mov.u32 {n}, %cluster_nctarank;", "mov.u32 {r}, %cluster_ctarank;",
                n = out(reg32) n, r = out(reg32) r, options(nostack, nomem, pure));
        }
        // Never 0; `max` keeps a division by it panic-free.
        (n.max(1), r)
    }
    #[cfg(not(target_feature = "sm_90"))]
    {
        (1, 0)
    }
}

/// `barrier.cluster.arrive` then `barrier.cluster.wait`: every thread of
/// every CTA of the cluster must call it (`.aligned`: the warp converged).
/// The arrive releases this thread's earlier shared-memory writes (its
/// stores into other CTAs' shared memory included) and the wait acquires
/// the other CTAs' (the PTX defaults), so after it a CTA reads what another
/// stored before it, and no CTA has gone past it while another has not
/// reached it (so every store into a CTA's shared memory issued before the
/// barrier is done when that CTA passes it, and it may then exit).
#[cfg(target_feature = "sm_90")]
#[inline(always)]
pub fn cluster_sync() {
    // SAFETY: a barrier over the cluster; callers keep control flow uniform
    // across the cluster, as `.aligned` requires.
    unsafe {
        asm!(
            "barrier.cluster.arrive.aligned;",
            "barrier.cluster.wait.aligned;",
            options(nostack)
        )
    }
}

/// `barrier.cluster.arrive`: this thread tells the cluster's barrier that
/// it has started. Paired with a later [`cluster_wait`] (before this thread
/// arrives again): once that wait returns, every CTA of the cluster is
/// known to have started, which the CUDA programming model requires before
/// any access to another CTA's distributed shared memory. Every thread of
/// every CTA of the cluster must call it (`.aligned`: the warp converged).
///
/// The PTX of sm_90 is version 7.8 (rustc's default for that target),
/// which has no `.relaxed` arrive (PTX 8.0); the default (`.release`)
/// orders this thread's earlier memory accesses before the arrival, so the
/// kernel calls it before its first one, where it orders nothing and so
/// costs what a relaxed arrival would.
#[cfg(target_feature = "sm_90")]
#[inline(always)]
pub fn cluster_arrive_early() {
    // SAFETY: an arrival at the cluster barrier; callers keep control flow
    // uniform across the cluster and pair it with `cluster_wait`.
    unsafe { asm!("barrier.cluster.arrive.aligned;", options(nostack)) }
}

/// `barrier.cluster.wait` (acquire): waits until every non-exited thread of
/// the cluster has arrived at the barrier's current phase (after this
/// thread's own [`cluster_arrive_early`]).
#[cfg(target_feature = "sm_90")]
#[inline(always)]
pub fn cluster_wait() {
    // SAFETY: a wait at the cluster barrier, after this thread's arrival;
    // control flow uniform across the cluster (callers).
    unsafe { asm!("barrier.cluster.wait.aligned;", options(nostack)) }
}

/// `shfl.sync.idx.b32` from lane 0 over the whole warp: every lane gets
/// lane 0's `v`. Every lane of the warp must call it together.
#[inline(always)]
pub fn shfl_lane0(v: f32) -> f32 {
    let r: f32;
    // SAFETY: a warp shuffle; callers keep the warp converged.
    unsafe {
        asm!("shfl.sync.idx.b32 {r}, {v}, 0, 31, -1;",
            v = in(reg32) v, r = out(reg32) r, options(nostack, nomem));
    }
    r
}

/// `vote.sync.any.pred` over the whole warp: whether any lane passed
/// `true`. Every lane of the warp must call it together.
#[inline(always)]
pub fn warp_any(pred: bool) -> bool {
    let r: u32;
    // SAFETY: a warp vote; callers keep the warp converged.
    unsafe {
        asm!(
            "{{ .reg .pred p, q;",
            "setp.ne.u32 p, {x}, 0;",
            "vote.sync.any.pred q, p, -1;",
            "selp.u32 {r}, 1, 0, q; }}",
            x = in(reg32) pred as u32, r = out(reg32) r,
            options(nostack, nomem));
    }
    r != 0
}

/// f32 words of the block's shared memory, from a shared-window address.
/// Accesses are ordered between threads by `bar.sync` only.
#[derive(Clone, Copy)]
pub struct SharedWords(u32);

impl SharedWords {
    /// The words from word `i` on.
    #[inline(always)]
    pub fn offset(self, i: u32) -> SharedWords {
        SharedWords(self.0 + 4 * i)
    }

    /// Word `i` (`ld.shared.f32`).
    ///
    /// # Safety
    /// Word `i` lies inside the shared array, and no other thread writes it
    /// between this thread's last `bar.sync` and this load.
    #[inline(always)]
    pub unsafe fn load(self, i: u32) -> f32 {
        let v: f32;
        // SAFETY: a shared-memory load inside the array (caller contract).
        unsafe {
            asm!("ld.shared.f32 {v}, [{p}];", p = in(reg32) self.0 + 4 * i, v = out(reg32) v,
                options(nostack, readonly));
        }
        v
    }

    /// Words `i` and `i + 1` (`ld.shared.v2.f32`).
    ///
    /// # Safety
    /// `i` is even and word `i + 1` lies inside the shared array (16-byte
    /// aligned), and no thread (of this CTA or, for words other CTAs store
    /// into, of any CTA of the cluster) writes them between the barrier
    /// that ordered their last store before this load and this load.
    #[inline(always)]
    pub unsafe fn load2(self, i: u32) -> (f32, f32) {
        let (a, b): (f32, f32);
        // SAFETY: an aligned 8-byte shared-memory load inside the array
        // (caller contract).
        unsafe {
            asm!("ld.shared.v2.f32 {{{a}, {b}}}, [{p}];", p = in(reg32) self.0 + 4 * i,
                a = out(reg32) a, b = out(reg32) b, options(nostack, readonly));
        }
        (a, b)
    }

    /// Stores `a` and `b` into words `i` and `i + 1` of CTA `cta`'s copy
    /// of these words in this block's thread-block cluster (`mapa` then
    /// `st.shared::cluster.v2.f32`; `cta` may be this block's own rank).
    ///
    /// # Safety
    /// `i` is even and word `i + 1` lies inside the shared array; `cta` is
    /// below the cluster's CTA count and has not passed the
    /// [`cluster_sync`] that follows this store (so it has not exited); no
    /// thread of any CTA reads or writes these words of that CTA between
    /// the cluster barrier before this store and the one after it.
    #[cfg(target_feature = "sm_90")]
    #[inline(always)]
    pub unsafe fn store2_cluster(self, i: u32, cta: u32, a: f32, b: f32) {
        // SAFETY: an aligned 8-byte distributed shared-memory store inside
        // the array of a live CTA of the cluster (caller contract).
        unsafe {
            asm!("{{ .reg .b32 r;",
                "mapa.shared::cluster.u32 r, {p}, {c};",
                "st.shared::cluster.v2.f32 [r], {{{a}, {b}}}; }}",
                p = in(reg32) self.0 + 4 * i, c = in(reg32) cta, a = in(reg32) a, b = in(reg32) b,
                options(nostack));
        }
    }

    /// Stores `v` into word `i` (`st.shared.f32`).
    ///
    /// # Safety
    /// Word `i` lies inside the shared array, and no other thread reads or
    /// writes it between the surrounding `bar.sync`s.
    #[inline(always)]
    pub unsafe fn store(self, i: u32, v: f32) {
        // SAFETY: a shared-memory store inside the array (caller contract).
        unsafe {
            asm!("st.shared.f32 [{p}], {v};", p = in(reg32) self.0 + 4 * i, v = in(reg32) v,
                options(nostack));
        }
    }
}

/// `%globaltimer`: a nanosecond clock shared by the whole GPU.
#[inline(always)]
pub fn global_timer_ns() -> u64 {
    let t: u64;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nomem, nostack)) }
    t
}

/// `__threadfence_system()`.
#[inline(always)]
pub fn thread_fence_system() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) }
}

/// 16-byte global load (`ld.global.v4.u32`).
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for reads.
#[inline(always)]
pub unsafe fn ld_pack(p: *const Pack) -> Pack {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees alignment and validity.
    unsafe {
        asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly));
    }
    [a, b, c, d]
}

/// `x` unchanged, through an asm statement the compiler keeps in program
/// order with the loads around it (it may touch memory, as far as the
/// compiler knows): a value loaded earlier is then first waited for here,
/// after the loads issued before this point, instead of where the
/// compiler would hoist its first use.
#[inline(always)]
pub fn ordered_u32(x: u32) -> u32 {
    let mut v = x;
    // SAFETY: a register move; no memory is touched.
    unsafe { asm!("mov.b32 {v}, {v};", v = inout(reg32) v, options(nostack, preserves_flags)) };
    v
}

/// `prefetch.global.L1`: brings the line holding `p` into this SM's L1, so
/// a later load of it is a hit; no register holds anything meanwhile.
///
/// # Safety
/// `p` must be a global address inside an allocation.
#[inline(always)]
pub unsafe fn prefetch_l1(p: *const Pack) {
    // SAFETY: the caller guarantees a valid global address; a prefetch
    // changes no memory.
    unsafe {
        asm!("prefetch.global.L1 [{p}];", p = in(reg64) p, options(nostack, readonly));
    }
}

/// 16-byte global store (`st.global.v4.u32`).
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for writes.
#[inline(always)]
pub unsafe fn st_pack(p: *mut Pack, v: Pack) {
    // SAFETY: the caller guarantees alignment and validity.
    unsafe {
        asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack));
    }
}

/// 16-byte global store marked evict-first (`st.global.cs.v4.u32`): for
/// results this kernel will not read again, so they do not push the inputs
/// that other ranks still have to read out of L2.
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for writes.
#[inline(always)]
pub unsafe fn st_pack_streaming(p: *mut Pack, v: Pack) {
    // SAFETY: the caller guarantees alignment and validity.
    unsafe {
        asm!("st.global.cs.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack));
    }
}

/// 16-byte volatile load of two 8-byte words (`ld.volatile.global.v2.u64`):
/// each word relaxed at system scope and single-copy atomic, never served
/// from a stale L1 line (the polls of [`crate::ll`]).
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for reads.
#[inline(always)]
pub unsafe fn ld_volatile_line(p: *const [u64; 2]) -> [u64; 2] {
    let (a, b): (u64, u64);
    // SAFETY: the caller guarantees alignment and validity.
    unsafe {
        asm!("ld.volatile.global.v2.u64 {{{a}, {b}}}, [{p}];",
            p = in(reg64) p, a = out(reg64) a, b = out(reg64) b,
            options(nostack, readonly));
    }
    [a, b]
}

/// 16-byte volatile store of two 8-byte words (`st.volatile.global.v2.u64`):
/// each word relaxed at system scope and single-copy atomic.
///
/// # Safety
/// `p` must be a 16-byte aligned global address valid for writes.
#[inline(always)]
pub unsafe fn st_volatile_line(p: *mut [u64; 2], v: [u64; 2]) {
    // SAFETY: the caller guarantees alignment and validity.
    unsafe {
        asm!("st.volatile.global.v2.u64 [{p}], {{{a}, {b}}};",
            p = in(reg64) p, a = in(reg64) v[0], b = in(reg64) v[1],
            options(nostack));
    }
}

/// `atomicCAS` on a 32-bit word in this GPU's own memory. Never used on
/// peer memory (PCIe P2P has no remote atomics).
///
/// # Safety
/// `p` must be a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_cas_u32(p: *mut u32, compare: u32, value: u32) -> u32 {
    let old: u32;
    // SAFETY: the caller guarantees validity.
    unsafe {
        asm!("atom.global.cas.b32 {o}, [{p}], {c}, {v};",
            o = out(reg32) old, p = in(reg64) p, c = in(reg32) compare, v = in(reg32) value,
            options(nostack));
    }
    old
}

/// The `Clock` of bounded barrier waits on the GPU.
pub struct GlobalTimer;

impl crate::barrier::Clock for GlobalTimer {
    #[inline(always)]
    fn now_ns(&mut self) -> u64 {
        global_timer_ns()
    }
}

/// Never returns; the kernel crate's panic handler. Kernels are written so
/// no panic path survives optimisation (the PTX check rejects the `.extern`
/// functions a surviving panic would need).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` aborts the kernel.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}
