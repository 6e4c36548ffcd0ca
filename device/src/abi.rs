//! The binary interface shared by the kernels and the host library.
//!
//! Every struct here is `#[repr(C)]` and is used, from this one file, by the
//! PTX kernels and by the host code that allocates, fills and reads them.
//! Sizes and field offsets are asserted at compile time, so a change that
//! would make host and device disagree fails to build.

/// Largest group the kernels support.
pub const MAX_RANKS: usize = 8;

/// Largest number of thread blocks per rank in one launch. Each block owns a
/// row of flags in every [`Signal`], so this bounds the signal size.
pub const MAX_BLOCKS: usize = 64;

/// Bytes per vector access: each thread moves 16-byte packs.
pub const PACK_BYTES: usize = 16;

/// Required alignment of every input, output, scratch and staging pointer.
pub const BUFFER_ALIGN: usize = PACK_BYTES;

/// The flag sets of a collective. Separate sets are needed because a fast
/// peer can reach barrier k+1 while a slow one still polls barrier k.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierKind {
    /// Before any rank reads a peer's input.
    Start = 1,
    /// Two-stage and push two-stage: between reduce-scatter and all-gather.
    /// Push islands: after the first island's partial sums crossed over.
    Mid = 2,
    /// One-stage only: after every read of peer inputs, before any rank may
    /// return and let its input be overwritten. Two-stage needs none: peers
    /// read inputs only before `Mid`, and scratch is written only after the
    /// next collective's `Start`, which a peer reaches only once its whole
    /// previous kernel (every read of scratch) has completed.
    End = 3,
    /// Push islands only: after the second island's owners sent the
    /// reduced partitions back across and into their own island.
    Back = 4,
    /// Push islands only, among the first island's ranks: after they
    /// relayed the reduced partitions within their island.
    Relay = 5,
}

impl BarrierKind {
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Start),
            2 => Some(Self::Mid),
            3 => Some(Self::End),
            4 => Some(Self::Back),
            5 => Some(Self::Relay),
            _ => None,
        }
    }
}

/// Codes a kernel writes into [`ErrorRecord::code`].
pub mod error_code {
    /// No error.
    pub const NONE: u32 = 0;
    /// A peer did not arrive at a barrier within the timeout.
    pub const PEER_TIMEOUT: u32 = 1;
    /// The launch shape is outside what the signal layout supports
    /// (more than [`super::MAX_BLOCKS`] blocks, or fewer threads than ranks).
    pub const BAD_LAUNCH: u32 = 2;
    /// The pointer table holds a null input: a CUDA graph was launched
    /// before its captured buffers were registered.
    pub const UNREGISTERED: u32 = 3;
}

/// What a kernel leaves behind instead of hanging. The first failing thread of
/// a rank claims the record (compare-and-swap on `code` in its own memory,
/// never a peer's), so the record describes one consistent failure.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ErrorRecord {
    /// One of [`error_code`].
    pub code: u32,
    /// The rank that wrote the record.
    pub rank: u32,
    /// The block of that rank that failed.
    pub block: u32,
    /// The peer that never arrived (for `PEER_TIMEOUT`).
    pub peer: u32,
    /// The epoch the block was waiting for.
    pub epoch: u32,
    /// Which barrier, as a [`BarrierKind`] value.
    pub barrier: u32,
    /// For `PEER_TIMEOUT`: the waiting rank's call tag (with any injected
    /// flip, [`tag_of`]), the tag its own words carry.
    pub tag: u32,
    pub _reserved: u32,
}

impl ErrorRecord {
    /// The raw [`BarrierKind`] of the record.
    pub const fn barrier_kind(&self) -> u32 {
        self.barrier
    }
}

/// One rank's signal buffer, in memory every peer can map.
///
/// `start[e % 2][b][p]` in rank r's signal is written by peer p's block b
/// when it reaches the start barrier of collective `e`, and read by rank
/// r's block b. Flags are 64-bit words: the epoch of the collective in the
/// low half, the peer's 32-bit call tag in the high half ([`flag_word`]);
/// `epoch[b]` is owned by block b of this rank and
/// is advanced on the device, so the same launch can be replayed in a CUDA
/// graph. Zeroed memory is a valid initial state: epochs start at 1.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub struct Signal {
    pub start: [[[u64; MAX_RANKS]; MAX_BLOCKS]; 2],
    pub mid: [[[u64; MAX_RANKS]; MAX_BLOCKS]; 2],
    pub end: [[[u64; MAX_RANKS]; MAX_BLOCKS]; 2],
    pub back: [[[u64; MAX_RANKS]; MAX_BLOCKS]; 2],
    pub relay: [[[u64; MAX_RANKS]; MAX_BLOCKS]; 2],
    pub epoch: [u32; MAX_BLOCKS],
    pub error: ErrorRecord,
    pub _pad: [u32; 440],
}

impl Signal {
    /// Byte offset of the flag that `from` writes into this signal for block
    /// `block` at barrier `kind` in collectives of epoch parity `parity`.
    /// Flags alternate by parity as the landing zones do: a peer one
    /// collective ahead (push) writes the other parity's flag, so a wait
    /// sees only its own collective's word, under the peer's call tag.
    pub const fn flag_offset(kind: BarrierKind, parity: usize, block: usize, from: usize) -> usize {
        let set = match kind {
            BarrierKind::Start => 0,
            BarrierKind::Mid => 1,
            BarrierKind::End => 2,
            BarrierKind::Back => 3,
            BarrierKind::Relay => 4,
        };
        (((set * 2 + parity) * MAX_BLOCKS + block) * MAX_RANKS + from) * 8
    }
    /// The flag that `from` wrote into this signal for block `block` at
    /// barrier `kind` in collectives of epoch parity `parity` (the word at
    /// [`Self::flag_offset`]).
    pub const fn flag(&self, kind: BarrierKind, parity: usize, block: usize, from: usize) -> u64 {
        let set = match kind {
            BarrierKind::Start => &self.start,
            BarrierKind::Mid => &self.mid,
            BarrierKind::End => &self.end,
            BarrierKind::Back => &self.back,
            BarrierKind::Relay => &self.relay,
        };
        set[parity][block][from]
    }
    /// Flag sets, one per [`BarrierKind`].
    pub const FLAG_SETS: usize = 5;
    pub const EPOCH_OFFSET: usize = Self::FLAG_SETS * 2 * MAX_BLOCKS * MAX_RANKS * 8;
    /// Where a rank's landing zones start in its signal allocation: right
    /// after the [`Signal`], push's first, then push_ll's, then
    /// push_two_stage's, then push_islands' (`LaunchArgs::landing_offset`
    /// says where each is; the last two have one slot,
    /// `[source 0..N][part]`, their parts laid out by [`PushTwoStagePart`]).
    /// Layout of push's and push_ll's:
    /// `[slot 0..2][source 0..N][part]`, each part `LaunchArgs::landing_part`
    /// bytes (fixed for the group; at least `ceil(count / lanes) * 16` for
    /// push and twice that for push_ll), slot = the collective's epoch
    /// parity ([`crate::barrier::barriers`] and [`crate::ll`] say why two
    /// slots suffice).
    pub const LANDING_OFFSET: usize = core::mem::size_of::<Signal>();
    pub const ERROR_OFFSET: usize = Self::EPOCH_OFFSET + MAX_BLOCKS * 4;
}

/// The layout of one source's part of push_two_stage's and push_islands'
/// landing zones (one slot, unlike push and push_ll:
/// [`crate::barrier::barriers`] says why), for messages of up to
/// `cap_packs` packs cut into `world` partitions (push_islands:
/// [`island_split`] partitions, and the part of a rank's counterpart in
/// the other island holds the partial or reduced partition that crosses
/// between them, in the scatter and gather regions together): `half`
/// packs for the source's share of the owner's partition (reduce-scatter,
/// at pack 0), `half` packs for the source's own reduced partition
/// (all-gather, at pack `half`), then one pack for the source's tail
/// elements. `half = ceil(cap_packs / world)` is the longest partition
/// ([`crate::reduce::partition`]) of any message that fits. The kernels
/// derive `half` from `LaunchArgs::landing_part`, so host and device agree
/// by construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushTwoStagePart {
    /// Packs per region.
    pub half: u64,
}

impl PushTwoStagePart {
    pub const fn for_capacity(cap_packs: u64, world: u64) -> Self {
        PushTwoStagePart {
            half: cap_packs.div_ceil(if world == 0 { 1 } else { world }),
        }
    }
    /// From `LaunchArgs::landing_part` (`bytes()` of some layout).
    pub const fn from_part_bytes(part: u64) -> Self {
        PushTwoStagePart {
            half: (part / PACK_BYTES as u64).saturating_sub(1) / 2,
        }
    }
    /// `LaunchArgs::landing_part`.
    pub const fn bytes(self) -> u64 {
        (2 * self.half + 1) * PACK_BYTES as u64
    }
    /// Byte offset of the reduce-scatter region.
    pub const fn scatter(self) -> u64 {
        0
    }
    /// Byte offset of the all-gather region.
    pub const fn gather(self) -> u64 {
        self.half * PACK_BYTES as u64
    }
    /// Byte offset of the tail pack.
    pub const fn tail(self) -> u64 {
        2 * self.half * PACK_BYTES as u64
    }
}

/// Buffer pointers as seen from one rank's address space: every rank's input
/// (staging or registered buffer), scratch and signal. (The signals also
/// travel in [`LaunchArgs`]; this copy is for a peer chosen at run time,
/// which the kernel parameter cannot serve without going through local
/// memory.) Lives in device memory;
/// kernels get a pointer to it, so a table filled after a CUDA-graph capture
/// (buffers whose peer mappings are exchanged later) is picked up on replay.
/// With virtual ranks all ranks share one table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankTable {
    pub inputs: [u64; MAX_RANKS],
    pub scratch: [u64; MAX_RANKS],
    pub signals: [u64; MAX_RANKS],
}

/// The one by-value kernel parameter of every allreduce entry point.
///
/// `outputs[r]` is rank r's output; a real-rank launch fills only its own
/// slot. The rank is `rank` for real-rank entries and `blockIdx.y` for the
/// `_virtual` entries. Signal pointers are fixed for a group's life, so they
/// travel by value: the first flag store then needs no dependent load.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchArgs {
    /// Device pointer to a [`RankTable`].
    pub table: u64,
    pub outputs: [u64; MAX_RANKS],
    /// Every rank's [`Signal`], mapped into this rank's address space.
    pub signals: [u64; MAX_RANKS],
    /// Elements (not bytes) in the message.
    pub count: u64,
    /// Barrier timeout in nanoseconds of `%globaltimer`; 0 waits forever.
    pub timeout_ns: u64,
    pub rank: u32,
    /// Fault injection for tests: ranks whose bit is set leave the kernel
    /// at once, as a dead peer would. Zero in normal use.
    pub absent_ranks: u32,
    /// The call's tag (32 bits the host computes from the whole call's
    /// count, dtype, algorithm and fused shape, `host/call_tag.rs`): every
    /// flag this rank stores is `epoch | tag << 32` ([`flag_word`]) and
    /// every LL word carries `epoch` with one byte of the tag XORed into
    /// its top byte ([`ll_highs`]), and every wait awaits its own, so
    /// ranks whose calls differ never take each other's words, and the
    /// host tells a mismatch from a dead peer by the words left where a
    /// wait timed out.
    pub call_tag: u32,
    /// Fault injection for tests: ranks whose bit is set carry the tag
    /// with [`MISMATCH_FLIP`] flipped, as a rank with another call would.
    /// Zero in normal use.
    pub mismatched_ranks: u32,
    /// Device address of a `u32` in mapped pinned host memory that a kernel
    /// sets to its error code after writing an error record (0: none), so
    /// the host learns of an error without synchronising.
    pub host_error: u64,
    /// Push algorithms: bytes of one source's part of a landing zone (the
    /// same on every rank). The layout must not depend on the message: a
    /// peer one collective ahead writes the other slot while this rank
    /// still reads this one, and slots of different sizes would overlap.
    pub landing_part: u64,
    /// Push algorithms: bytes from the start of every rank's
    /// signal allocation to the landing zone of this algorithm (the zones
    /// are distinct, see [`crate::ll`]).
    pub landing_offset: u64,
    /// Each rank's own input for this launch, read where it is instead of
    /// the table's entry, or 0 (the table's). Only kernels that read no
    /// peer's input take it (the host sets it for push_ll): a staged call
    /// then needs no copy into the staging buffer, and the kernel's first
    /// input load needs no table load before it.
    pub own_inputs: [u64; MAX_RANKS],
}

/// The tag bits a rank in [`LaunchArgs::mismatched_ranks`] flips (the
/// top bit of the last LL word's tag byte).
pub const MISMATCH_FLIP: u32 = 0x8000_0000;

/// The call tag rank `rank` of a launch carries: the call's, with
/// [`MISMATCH_FLIP`] flipped where fault injection says so.
#[inline(always)]
pub const fn tag_of(a: &LaunchArgs, rank: u32) -> u32 {
    a.call_tag ^ (((a.mismatched_ranks >> rank) & 1) * MISMATCH_FLIP)
}

/// The flag word rank `rank` of a launch stores and awaits at `epoch`:
/// the epoch in the low half, the call tag in the high half. For one
/// call, equality on it is equality on the epoch (every guarantee of the
/// plain epoch holds, docs/design/call-tags.md); a word of another call
/// differs in the high half at every epoch, however old it is.
#[inline(always)]
pub const fn flag_word(epoch: u32, a: &LaunchArgs, rank: u32) -> u64 {
    epoch as u64 | (tag_of(a, rank) as u64) << 32
}

/// The high halves of the four words of an LL pack that rank `rank` of a
/// launch stores and awaits at `epoch` (`crate::ll`, word `i` of a pack
/// is element `i`): the epoch with byte `i` of the call tag XORed into its
/// top byte. For one call each is a bijection of the epoch, so equality
/// keeps every guarantee of the plain epoch; a pack of another call at the
/// same epoch differs in the top byte of at least one word, because the
/// four bytes together are the whole 32-bit tag.
#[inline(always)]
pub const fn ll_highs(epoch: u32, a: &LaunchArgs, rank: u32) -> [u32; 4] {
    let t = tag_of(a, rank);
    [
        epoch ^ (t << 24),
        epoch ^ ((t >> 8) << 24),
        epoch ^ ((t >> 16) << 24),
        epoch ^ ((t >> 24) << 24),
    ]
}

/// The call tag that the four high halves `highs` of an LL pack carry at
/// `epoch` ([`ll_highs`]), if they are words of that epoch (each agrees
/// with it in its low 24 bits).
pub const fn ll_tag(highs: [u32; 4], epoch: u32) -> Option<u32> {
    let mut t = 0u32;
    let mut i = 0;
    while i < 4 {
        let x = highs[i] ^ epoch;
        if x & 0x00ff_ffff != 0 {
            return None;
        }
        t |= (x >> 24) << (8 * i);
        i += 1;
    }
    Some(t)
}

// Layout checks: the host writes these bytes and the PTX reads them.
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<ErrorRecord>() == 32);
    assert!(size_of::<Signal>() == 43008);
    assert!(align_of::<Signal>() == 128);
    assert!(offset_of!(Signal, mid) == Signal::flag_offset(BarrierKind::Mid, 0, 0, 0));
    assert!(offset_of!(Signal, end) == Signal::flag_offset(BarrierKind::End, 0, 0, 0));
    assert!(offset_of!(Signal, back) == Signal::flag_offset(BarrierKind::Back, 0, 0, 0));
    assert!(offset_of!(Signal, relay) == Signal::flag_offset(BarrierKind::Relay, 0, 0, 0));
    assert!(Signal::flag_offset(BarrierKind::Start, 1, 0, 0) == MAX_BLOCKS * MAX_RANKS * 8);
    assert!(offset_of!(Signal, epoch) == Signal::EPOCH_OFFSET);
    assert!(offset_of!(Signal, error) == Signal::ERROR_OFFSET);
    assert!(size_of::<RankTable>() == 192);
    // Tables are allocated alone or in arrays from 256-byte-aligned device
    // allocations, so every table is 16-byte aligned: a kernel may read
    // its first pack as a stand-in address (`push_ll::ll_first`).
    assert!(size_of::<RankTable>() & 15 == 0);
    assert!(size_of::<LaunchArgs>() == 256);
    assert!(offset_of!(LaunchArgs, outputs) == 8);
    assert!(offset_of!(LaunchArgs, signals) == 72);
    assert!(offset_of!(LaunchArgs, count) == 136);
    assert!(offset_of!(LaunchArgs, timeout_ns) == 144);
    assert!(offset_of!(LaunchArgs, rank) == 152);
    assert!(offset_of!(LaunchArgs, absent_ranks) == 156);
    // In the parameter line every kernel reads first (rank, absent_ranks):
    // at the end of the struct they cost the flag algorithms a line more.
    assert!(offset_of!(LaunchArgs, call_tag) == 160);
    assert!(offset_of!(LaunchArgs, mismatched_ranks) == 164);
    assert!(offset_of!(LaunchArgs, host_error) == 168);
    assert!(offset_of!(LaunchArgs, landing_part) == 176);
    assert!(offset_of!(LaunchArgs, landing_offset) == 184);
    assert!(offset_of!(LaunchArgs, own_inputs) == 192);
    // A push_two_stage part round-trips through `landing_part`.
    let l = PushTwoStagePart::for_capacity(1000, 3);
    assert!(PushTwoStagePart::from_part_bytes(l.bytes()).half == l.half);
    assert!(l.half * 3 >= 1000);
};

/// Elements per chunk of the fused RMSNorm's sum of squares: the squares
/// of a chunk's elements are added in column order, then the chunks'
/// partial sums in a pairwise tree ([`crate::norm`]). A function of the
/// row length only, never of dtype, grid, rows, world or algorithm.
pub const NORM_CHUNK: usize = 8;
/// Largest row (`hidden`) the fused kernels take: one f32 partial per
/// chunk lives in 16 KiB of shared memory.
pub const NORM_MAX_HIDDEN: usize = 32768;
/// Chunks of the longest row.
pub const NORM_MAX_CHUNKS: usize = NORM_MAX_HIDDEN / NORM_CHUNK;

/// Chunks one thread holds in registers on the fused kernels' register
/// path, for elements of `lanes` per 16-byte pack: two for 16-bit types
/// (one pack each), one for f32 (two packs; two f32 chunks took 131..162
/// registers, over the 128 of a 512-thread block).
pub const fn norm_reg_slots(lanes: usize) -> usize {
    if lanes == 8 {
        2
    } else {
        1
    }
}

/// Whether rows of `hidden` elements (`lanes` per pack) take the fused
/// kernels' register path with `threads` threads per block: every chunk
/// whole, at most [`norm_reg_slots`] chunks per thread. The fused push_ll
/// entries have no other path: the host launches them only for such
/// shapes, and the kernel records `BAD_LAUNCH` for any other.
// `is_multiple_of` needs Rust 1.87; the host crate builds with 1.85.
#[allow(clippy::manual_is_multiple_of)]
pub const fn norm_reg_path(lanes: usize, hidden: u64, threads: u64) -> bool {
    hidden % NORM_CHUNK as u64 == 0
        && hidden / NORM_CHUNK as u64 <= norm_reg_slots(lanes) as u64 * threads
}

/// CTAs at most in the thread-block cluster of a fused push_ll row (the
/// portable cluster size of sm_90 and sm_120).
pub const NORM_MAX_CTAS: usize = 8;

/// Words of the fused push_ll kernel's cluster exchange in each CTA's shared
/// memory: per row parity and per CTA of the cluster, that CTA's partial
/// sum of squares and whether any of its waits failed (each CTA stores its
/// pair into every CTA's words).
pub const NORM_CLUSTER_WORDS: usize = 2 * NORM_MAX_CTAS * 2;

/// Chunks each CTA takes when a row of `chunks` chunks is split over a
/// cluster of `ctas` CTAs (a power of two, at most [`NORM_MAX_CTAS`]; the
/// kernel refuses other clusters): the least power of two that covers the
/// row in `ctas` ranges. CTA c takes chunks `[c * range, min((c + 1) *
/// range, chunks))` (possibly none): an aligned power-of-two range is a
/// subtree of the pairwise tree (docs/numerics.md), so the split changes
/// no bit. Shifts only (no division: the kernels compute it before their
/// first loads).
pub const fn norm_split_range(chunks: u32, ctas: u32) -> u32 {
    let l = ctas.trailing_zeros();
    let per = (chunks + (1 << l) - 1) >> l;
    per.next_power_of_two()
}

/// Whether rows of `hidden` elements split over `ctas` CTAs (a cluster, a
/// power of two up to [`NORM_MAX_CTAS`]; 1: one block per row) take the
/// register path with `threads` threads per block: every chunk whole, the
/// row at most [`NORM_MAX_HIDDEN`], and each CTA's range at most
/// [`norm_reg_slots`] chunks per thread. For `ctas == 1` this is
/// [`norm_reg_path`].
#[allow(clippy::manual_is_multiple_of)]
pub const fn norm_reg_path_split(lanes: usize, hidden: u64, threads: u64, ctas: u32) -> bool {
    if hidden % NORM_CHUNK as u64 != 0
        || hidden > NORM_MAX_HIDDEN as u64
        || !ctas.is_power_of_two()
        || ctas as usize > NORM_MAX_CTAS
    {
        return false;
    }
    let chunks = (hidden / NORM_CHUNK as u64) as u32;
    let range = norm_split_range(chunks, ctas);
    let local = if range < chunks { range } else { chunks };
    local as u64 <= norm_reg_slots(lanes) as u64 * threads
}

/// The one by-value parameter of the fused allreduce + residual add +
/// RMSNorm entries (`allreduce_rmsnorm_*`). `base` is an allreduce's, with
/// `count = rows * hidden` elements and `outputs` the normed results; per
/// rank r (slot r, or only the launching rank's for real-rank entries):
/// `residual[r]` in, `residual_out[r]` out (may equal `residual[r]`),
/// `gamma[r]` (`hidden` elements). Two-stage also needs scratch of
/// `count` elements per rank (the rounded sums of its rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NormArgs {
    pub base: LaunchArgs,
    pub residual: [u64; MAX_RANKS],
    pub residual_out: [u64; MAX_RANKS],
    pub gamma: [u64; MAX_RANKS],
    pub rows: u64,
    pub hidden: u64,
    pub eps: f32,
    pub _pad: u32,
}

const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(size_of::<NormArgs>() == 472);
    assert!(offset_of!(NormArgs, residual) == 256);
    assert!(offset_of!(NormArgs, rows) == 448);
    assert!(offset_of!(NormArgs, eps) == 464);
    assert!(NORM_MAX_CHUNKS * 4 == 16384);
    assert!(NORM_CLUSTER_WORDS * 4 == 128);
};

/// Element types the kernels reduce.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32 = 0,
    F16 = 1,
    Bf16 = 2,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }
    /// Elements per 16-byte pack.
    pub const fn lanes(self) -> usize {
        PACK_BYTES / self.size()
    }
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// The kernel algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank reads every input and reduces the whole message.
    OneStage,
    /// Reduce-scatter into scratch, then all-gather.
    TwoStage,
    /// Every rank writes its input into every peer's landing zone (posted
    /// writes), then reduces its own landing zone locally: one flag
    /// exchange and no reads of peer memory (small messages).
    Push,
    /// Push whose arrival signal travels with the data (flag-in-data
    /// lines, [`crate::ll`]): no flag, no fence, no barrier; one one-way
    /// trip. Twice the bytes on the wire (the smallest messages).
    PushLl,
    /// Two-stage by writes only: reduce-scatter (each rank writes partition
    /// j of its input into rank j's landing zone; j reduces it in rank
    /// order), then all-gather (each owner writes its reduced partition
    /// into every peer's landing zone). Every byte crosses the links once
    /// per stage as a posted write, as in two-stage, but no rank reads
    /// peer memory (PCIe: reads are non-posted round trips).
    PushTwoStage,
    /// Push two-stage over two islands of ranks (ranks `0..h` and `h..N`,
    /// `h =` [`island_split`]`(N)`, e.g. the GPUs behind two PCIe switches),
    /// keeping the rank-order sum: each first-island rank reduces its
    /// partition over its island in f32 and sends the unrounded partial to
    /// its counterpart `r + h`, which adds the second island's values in
    /// rank order, rounds once, and sends the result back; each island
    /// then all-gathers by writes. Only partials (f32) and results cross
    /// between the islands, once each: a quarter of push_two_stage's
    /// cross-island bytes for 16-bit types on 4 + 4 ranks.
    PushIslands,
}

/// Ranks in the first island of [`Algorithm::PushIslands`] for a group of
/// `world` ranks, which is also its number of partitions: half the group,
/// rounded down (the second island is never smaller), and the one rank of
/// a one-rank group.
pub const fn island_split(world: usize) -> usize {
    if world <= 1 {
        world
    } else {
        world / 2
    }
}

impl Algorithm {
    pub const ALL: [Algorithm; 6] = [
        Algorithm::OneStage,
        Algorithm::TwoStage,
        Algorithm::Push,
        Algorithm::PushLl,
        Algorithm::PushTwoStage,
        Algorithm::PushIslands,
    ];
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::OneStage => "one_stage",
            Algorithm::TwoStage => "two_stage",
            Algorithm::Push => "push",
            Algorithm::PushLl => "push_ll",
            Algorithm::PushTwoStage => "push_two_stage",
            Algorithm::PushIslands => "push_islands",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_carry_the_whole_tag_and_an_injected_flip() {
        for (epoch, tag) in [
            (1u32, 0u32),
            (0x00ab_cdef, 0x1234_5678),
            (u32::MAX, 0xffff_ffff),
            (0x8000_0000, 0x8000_0001),
        ] {
            for flipped in [0u32, 0b100] {
                let a = LaunchArgs {
                    call_tag: tag,
                    mismatched_ranks: flipped,
                    ..Default::default()
                };
                let want = if flipped != 0 {
                    tag ^ MISMATCH_FLIP
                } else {
                    tag
                };
                assert_eq!(tag_of(&a, 2), want);
                assert_eq!(tag_of(&a, 1), tag, "rank 1 is not flipped");
                let w = flag_word(epoch, &a, 2);
                assert_eq!((w as u32, (w >> 32) as u32), (epoch, want));
                let highs = ll_highs(epoch, &a, 2);
                assert_eq!(ll_tag(highs, epoch), Some(want));
                // Another epoch's words are not this epoch's.
                assert_eq!(ll_tag(highs, epoch ^ 1), None);
                // Tags that differ in any one byte differ in that word.
                for byte in 0..4 {
                    let other = LaunchArgs {
                        call_tag: tag ^ (1 << (8 * byte + 3)),
                        ..a
                    };
                    let o = ll_highs(epoch, &other, 2);
                    for w in 0..4 {
                        assert_eq!(o[w] == highs[w], w != byte);
                    }
                }
            }
        }
    }

    #[test]
    fn the_flag_read_is_the_word_at_its_offset() {
        let mut s = Signal {
            start: [[[0; MAX_RANKS]; MAX_BLOCKS]; 2],
            mid: [[[0; MAX_RANKS]; MAX_BLOCKS]; 2],
            end: [[[0; MAX_RANKS]; MAX_BLOCKS]; 2],
            back: [[[0; MAX_RANKS]; MAX_BLOCKS]; 2],
            relay: [[[0; MAX_RANKS]; MAX_BLOCKS]; 2],
            epoch: [0; MAX_BLOCKS],
            error: ErrorRecord::default(),
            _pad: [0; 440],
        };
        // Every flag word holds its own byte offset.
        let words = Signal::EPOCH_OFFSET / 8;
        let base = &mut s as *mut Signal as *mut u64;
        for i in 0..words {
            // SAFETY: i indexes a u64 of the flag arrays at the start of `s`
            // (a repr(C) struct aligned to 128 bytes).
            unsafe { *base.add(i) = (i * 8) as u64 };
        }
        let kinds = [
            BarrierKind::Start,
            BarrierKind::Mid,
            BarrierKind::End,
            BarrierKind::Back,
            BarrierKind::Relay,
        ];
        for kind in kinds {
            for parity in 0..2 {
                for (block, from) in [(0, 0), (3, 5), (MAX_BLOCKS - 1, MAX_RANKS - 1)] {
                    let at = Signal::flag_offset(kind, parity, block, from);
                    assert_eq!(s.flag(kind, parity, block, from) as usize, at);
                }
            }
        }
    }
}
