//! The kernel provider interface: the kernels embedded at build time (PTX
//! and SASS, compressed, decompressed once on first use), one module per
//! architecture, and a typed index of the entry points and their parameter.
//!
//! For users with their own launcher:
//! ```
//! use p2p_allreduce::ptx::{self, Entry};
//! use p2p_allreduce::{Algorithm, Dtype};
//! let module = ptx::module_for((9, 0)).expect("built for sm_90");
//! let entry = Entry { op: ptx::Op::Allreduce, algorithm: Algorithm::OneStage, dtype: Dtype::Bf16, world: 4, virtual_ranks: false };
//! assert!(module.ptx().contains(&format!(".entry {}", entry.name())));
//! // Only the entries of one family (one world size, rank mode and dtype):
//! // a valid PTX module of its own that JIT-compiles in a fraction of the time.
//! assert!(module.family_ptx(entry.family()).contains(&format!(".entry {}(", entry.name())));
//! // Launch `entry.name()` from `module.ptx()` with one `LaunchArgs` (256 bytes) by value.
//! assert_eq!(ptx::PARAM_BYTES, 256);
//! ```

use crate::abi::{Algorithm, Dtype, LaunchArgs, NormArgs, MAX_RANKS};
use crate::image_format;
use std::sync::OnceLock;

/// 16 bytes at 16-byte alignment: the unit of a decompressed image, so that
/// a cubin starts where the driver's ELF reader wants it.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Block([u8; 16]);

/// An embedded image (PTX text or cubin), compressed at build time (the
/// container of `image_format.rs`); decompressed once, on first use, into
/// memory that lives as long as the process.
pub struct Image {
    blob: &'static [u8],
    raw_len: usize,
    raw: OnceLock<Box<[Block]>>,
}

impl Image {
    const fn new(blob: &'static [u8], raw_len: usize) -> Self {
        Image {
            blob,
            raw_len,
            raw: OnceLock::new(),
        }
    }

    /// Bytes once decompressed.
    pub fn len(&self) -> usize {
        self.raw_len
    }

    /// Whether the image is empty (never, for an embedded one).
    pub fn is_empty(&self) -> bool {
        self.raw_len == 0
    }

    /// Bytes as embedded (compressed).
    pub fn compressed_len(&self) -> usize {
        self.blob.len()
    }

    /// Whether [`Image::bytes`] has run (the image is in memory).
    pub fn is_decompressed(&self) -> bool {
        self.raw.get().is_some()
    }

    /// The image, decompressed on the first call (its chunks on up to one
    /// thread each; concurrent first calls wait for one decompression) and
    /// kept: later calls cost nothing. 16-byte aligned.
    pub fn bytes(&'static self) -> &'static [u8] {
        let blocks = self.raw.get_or_init(|| decompress(self.blob, self.raw_len));
        let bytes: &'static [u8] = {
            let ptr = blocks.as_ptr() as *const u8;
            // SAFETY: `blocks` is a live allocation of `blocks.len() * 16`
            // initialized bytes (Block is 16 plain bytes, no padding), kept
            // in a static OnceLock and never mutated after initialization;
            // `raw_len <= blocks.len() * 16` (decompress allocates that).
            unsafe { std::slice::from_raw_parts(ptr, self.raw_len) }
        };
        bytes
    }
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("len", &self.raw_len)
            .field("compressed_len", &self.blob.len())
            .field("decompressed", &self.is_decompressed())
            .finish()
    }
}

/// Decompresses a container into 16-byte blocks, its chunks in parallel.
/// The container is part of this binary, written by build.rs: a damaged
/// one is a damaged binary, so this panics with what to do.
fn decompress(blob: &[u8], raw_len: usize) -> Box<[Block]> {
    let damaged = |what: String| -> ! {
        panic!("p2p-allreduce: an embedded kernel image is damaged ({what}): rebuild the binary")
    };
    let (chunks, total) = image_format::parse_container(blob).unwrap_or_else(|e| damaged(e));
    if total != raw_len {
        damaged(format!("{total} bytes, {raw_len} expected"));
    }
    let mut blocks = vec![Block([0; 16]); raw_len.div_ceil(16)].into_boxed_slice();
    {
        let out: &mut [u8] = {
            let ptr = blocks.as_mut_ptr() as *mut u8;
            // SAFETY: the allocation holds `blocks.len() * 16 >= raw_len`
            // initialized bytes (zeros), exclusively borrowed here for the
            // block's lifetime; u8 has no alignment or validity needs.
            unsafe { std::slice::from_raw_parts_mut(ptr, raw_len) }
        };
        // One (frame, destination) pair per chunk; chunks are contiguous.
        let mut jobs: Vec<(&[u8], &mut [u8])> = Vec::with_capacity(chunks.len());
        let mut rest = out;
        for c in &chunks {
            let (dst, tail) = std::mem::take(&mut rest).split_at_mut(c.raw.len());
            jobs.push((&blob[c.frame.clone()], dst));
            rest = tail;
        }
        let decode = |frame: &[u8], dst: &mut [u8]| {
            let mut d = ruzstd::decoding::FrameDecoder::new();
            match d.decode_all(frame, dst) {
                Ok(n) if n == dst.len() => {}
                Ok(n) => damaged(format!(
                    "a chunk decoded to {n} bytes, {} expected",
                    dst.len()
                )),
                Err(e) => damaged(e.to_string()),
            }
        };
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(jobs.len())
            .max(1);
        type Jobs<'a> = Vec<(&'a [u8], &'a mut [u8])>;
        let mut groups: Vec<Jobs> = (0..workers).map(|_| Vec::new()).collect();
        for (i, job) in jobs.into_iter().enumerate() {
            groups[i % workers].push(job);
        }
        let slots: Vec<std::sync::Mutex<Option<Jobs>>> = groups
            .into_iter()
            .map(|g| std::sync::Mutex::new(Some(g)))
            .collect();
        let run = |slot: &std::sync::Mutex<Option<Jobs>>| {
            let group = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            for (frame, dst) in group.into_iter().flatten() {
                decode(frame, dst);
            }
        };
        std::thread::scope(|s| {
            for slot in &slots[1..] {
                let spawned = std::thread::Builder::new()
                    .name("p2p-allreduce-unzstd".into())
                    .spawn_scoped(s, || run(slot));
                if spawned.is_err() {
                    // No thread to be had: decode this share here.
                    run(slot);
                }
            }
            run(&slots[0]);
        });
    }
    blocks
}

/// The PTX text of one architecture, compressed, with the byte ranges of
/// its entries (by name) and of the rest (header, `.func`s).
pub struct PtxImage {
    image: Image,
    common: &'static [(u32, u32)],
    /// Sorted by name.
    entries: &'static [(&'static str, u32, u32)],
    text: OnceLock<&'static str>,
}

impl PtxImage {
    const fn new(
        image: Image,
        common: &'static [(u32, u32)],
        entries: &'static [(&'static str, u32, u32)],
    ) -> Self {
        PtxImage {
            image,
            common,
            entries,
            text: OnceLock::new(),
        }
    }

    fn text(&'static self) -> &'static str {
        self.text.get_or_init(|| {
            std::str::from_utf8(self.image.bytes()).unwrap_or_else(|e| {
                panic!("p2p-allreduce: an embedded PTX text is not UTF-8 ({e}): rebuild the binary")
            })
        })
    }

    fn entry(&self, name: &str) -> Option<(u32, u32)> {
        self.entries
            .binary_search_by(|(n, _, _)| (*n).cmp(name))
            .ok()
            .map(|i| (self.entries[i].1, self.entries[i].2))
    }
}

/// The kernels for one architecture: PTX (every device of this or a newer
/// architecture can JIT-compile it) and, where the build had ptxas, SASS
/// for exactly `arch`. Both are embedded compressed and decompressed once,
/// on first use ([`PtxModule::ptx`], [`PtxModule::cubin`]).
#[derive(Clone, Copy)]
pub struct PtxModule {
    /// The SASS architecture, e.g. "sm_103".
    pub arch: &'static str,
    pub compute_capability: (u32, u32),
    /// The architecture the PTX was compiled for: `arch`, or the lowest
    /// built architecture of the same major (sm_100 for sm_103: the SASS
    /// is assembled from it).
    pub ptx_arch: &'static str,
    ptx_image: &'static PtxImage,
    cubin_image: Option<&'static Image>,
}

impl std::fmt::Debug for PtxModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PtxModule")
            .field("arch", &self.arch)
            .field("compute_capability", &self.compute_capability)
            .field("ptx_arch", &self.ptx_arch)
            .field("ptx", &self.ptx_image.image)
            .field("cubin", &self.cubin_image)
            .finish()
    }
}

impl PtxModule {
    /// The PTX text of every entry (NUL-free; append a NUL for
    /// `cuModuleLoadData`), decompressed on the first call (tens of
    /// milliseconds) and kept for the life of the process.
    pub fn ptx(&self) -> &'static str {
        self.ptx_image.text()
    }

    /// The PTX of the entries of one [`Family`] only: the module's header
    /// and shared functions, then those entries; a complete PTX module
    /// (`cuModuleLoadData` takes it, with a NUL appended). Entries this
    /// build lacks are left out.
    pub fn family_ptx(&self, family: Family) -> String {
        let names: Vec<String> = family.entries().iter().map(Entry::name).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        self.entries_ptx(&names)
    }

    /// The PTX of the named entries only (see [`PtxModule::family_ptx`]).
    pub fn entries_ptx(&self, names: &[&str]) -> String {
        let text = self.ptx();
        let mut ranges: Vec<(u32, u32)> = names
            .iter()
            .filter_map(|n| self.ptx_image.entry(n))
            .collect();
        ranges.sort_unstable();
        ranges.dedup();
        let len: u32 = self
            .ptx_image
            .common
            .iter()
            .chain(&ranges)
            .map(|(a, b)| b - a)
            .sum();
        let mut out = String::with_capacity(len as usize + 1);
        for &(a, b) in self.ptx_image.common.iter().chain(&ranges) {
            out.push_str(&text[a as usize..b as usize]);
        }
        out
    }

    /// The definition of entry `name` in the PTX text (its `.entry` line
    /// to the closing brace), if the PTX defines it.
    pub fn entry_text(&self, name: &str) -> Option<&'static str> {
        let (a, b) = self.ptx_image.entry(name)?;
        Some(&self.ptx()[a as usize..b as usize])
    }

    /// Whether the PTX defines entry `name` (from the build-time index;
    /// decompresses nothing).
    pub fn has_entry(&self, name: &str) -> bool {
        self.ptx_image.entry(name).is_some()
    }

    /// The names of the entries the PTX defines (from the build-time
    /// index, sorted; decompresses nothing).
    pub fn entry_names(&self) -> impl Iterator<Item = &'static str> {
        self.ptx_image.entries.iter().map(|(n, _, _)| *n)
    }

    /// The embedded PTX image (sizes, whether it is decompressed yet).
    pub fn ptx_image(&self) -> &'static Image {
        &self.ptx_image.image
    }

    /// The same kernels as SASS for exactly `arch` (an ELF cubin from
    /// `ptxas -arch=<arch>` at build time; `None` where the build found no
    /// ptxas), decompressed on the first call and kept. A device of the
    /// same major and no lower minor compute capability runs it as it is
    /// ([`PtxModule::runs_sass_on`]), so loading takes no JIT compilation.
    /// Starts 16-byte aligned.
    pub fn cubin(&self) -> Option<&'static [u8]> {
        self.cubin_image.map(Image::bytes)
    }

    /// The embedded cubin image, if any (sizes; decompresses nothing).
    pub fn cubin_image(&self) -> Option<&'static Image> {
        self.cubin_image
    }

    /// Whether this module's cubin runs on a device of compute capability
    /// `cc`: SASS runs on its own major version at the same or a higher
    /// minor (sm_80 SASS on 8.6, never on 9.0).
    pub fn runs_sass_on(&self, cc: (u32, u32)) -> bool {
        self.cubin_image.is_some()
            && cc.0 == self.compute_capability.0
            && cc.1 >= self.compute_capability.1
    }

    /// What a device of compute capability `cc` loads under `choice`: this
    /// module's cubin (unless the driver refuses it), or why the PTX.
    /// Decompresses the cubin when it is the answer.
    pub fn cubin_for(
        &self,
        cc: (u32, u32),
        choice: ImageChoice,
    ) -> std::result::Result<&'static [u8], PtxBecause> {
        match (choice, self.cubin_image) {
            (ImageChoice::Ptx, _) => Err(PtxBecause::Asked),
            (ImageChoice::Auto, None) => Err(PtxBecause::NoCubin),
            (ImageChoice::Auto, Some(_)) if !self.runs_sass_on(cc) => Err(PtxBecause::OtherArch),
            (ImageChoice::Auto, Some(cubin)) => Ok(cubin.bytes()),
        }
    }

    /// What a device of compute capability `cc` loads under
    /// [`ImageChoice::Auto`], unless the driver refuses the cubin:
    /// "SASS sm_90" or "PTX sm_90 (JIT)".
    pub fn describe_on(&self, cc: (u32, u32)) -> String {
        if self.runs_sass_on(cc) {
            format!("SASS {}", self.arch)
        } else {
            format!("PTX {} (JIT)", self.ptx_arch)
        }
    }
}

/// Which image of the embedded kernels a group loads ([`crate::Config::kernel_image`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ImageChoice {
    /// The cubin where this build has one that runs on the device
    /// ([`PtxModule::runs_sass_on`]) and the driver accepts it; the PTX
    /// otherwise. Same bits either way: every floating-point operation in
    /// the PTX names its rounding, so the assembler fuses none of them.
    #[default]
    Auto,
    /// Always the PTX, JIT-compiled by the driver when the module loads.
    Ptx,
}

/// The image a loaded module came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadedImage {
    /// The embedded cubin of the module's architecture.
    Sass,
    /// The PTX, JIT-compiled by the driver, and why not the cubin.
    Ptx(PtxBecause),
}

/// Why a module was loaded from its PTX.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PtxBecause {
    /// [`ImageChoice::Ptx`] asked for it.
    Asked,
    /// This build embeds no cubins (no ptxas was found when it was built).
    NoCubin,
    /// The device's compute capability cannot run the nearest cubin
    /// (another major version: the PTX is compiled forward).
    OtherArch,
    /// The driver refused the cubin, with this error.
    Refused(String),
}

impl std::fmt::Display for LoadedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadedImage::Sass => f.write_str("SASS (embedded cubin)"),
            LoadedImage::Ptx(PtxBecause::Asked) => f.write_str("PTX, JIT-compiled (asked for)"),
            LoadedImage::Ptx(PtxBecause::NoCubin) => {
                f.write_str("PTX, JIT-compiled (this build has no cubins: no ptxas at build time)")
            }
            LoadedImage::Ptx(PtxBecause::OtherArch) => {
                f.write_str("PTX, JIT-compiled (no cubin for this architecture)")
            }
            LoadedImage::Ptx(PtxBecause::Refused(e)) => {
                write!(f, "PTX, JIT-compiled (the driver refused the cubin: {e})")
            }
        }
    }
}

/// Registers and spills of one entry, from `ptxas -v` at build time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelStats {
    pub entry: &'static str,
    pub registers: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

include!(concat!(env!("OUT_DIR"), "/ptx_modules.rs"));
include!(concat!(env!("OUT_DIR"), "/kernel_resources.rs"));

/// Size of the single by-value kernel parameter of the allreduce entries
/// ([`LaunchArgs`]).
pub const PARAM_BYTES: usize = core::mem::size_of::<LaunchArgs>();
/// Size of the single by-value parameter of the fused entries
/// ([`NormArgs`]).
pub const NORM_PARAM_BYTES: usize = core::mem::size_of::<NormArgs>();

/// What an entry computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// The allreduce (`allreduce_*`, one [`LaunchArgs`]).
    Allreduce,
    /// The fused allreduce + residual add + RMSNorm
    /// (`allreduce_rmsnorm_*`, one [`NormArgs`]; one-stage, two-stage and
    /// push_ll).
    AddRmsNorm,
}

impl Op {
    /// The algorithms this operation has entries for.
    pub fn algorithms(self) -> &'static [Algorithm] {
        match self {
            Op::Allreduce => &Algorithm::ALL,
            Op::AddRmsNorm => &[Algorithm::OneStage, Algorithm::TwoStage, Algorithm::PushLl],
        }
    }
}

/// The PTX to load on a device of compute capability `cc`: an exact match
/// first, else the newest built architecture not newer than the device
/// (the driver JIT-compiles PTX forward, never backward).
pub fn module_for(cc: (u32, u32)) -> Option<&'static PtxModule> {
    if let Some(m) = MODULES.iter().find(|m| m.compute_capability == cc) {
        return Some(m);
    }
    MODULES
        .iter()
        .filter(|m| m.compute_capability <= cc)
        .max_by_key(|m| m.compute_capability)
}

/// The SASS architectures this build embeds modules for, e.g.
/// `["sm_120", "sm_103", "sm_100", "sm_90", "sm_80"]`.
pub fn built_archs() -> Vec<&'static str> {
    MODULES.iter().map(|m| m.arch).collect()
}

/// The architectures of the embedded PTX texts, e.g.
/// `["sm_120", "sm_100", "sm_90", "sm_80"]` (one per major version).
pub fn built_ptx_archs() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = Vec::new();
    for m in MODULES {
        if !v.contains(&m.ptx_arch) {
            v.push(m.ptx_arch);
        }
    }
    v
}

/// An identity of this build of the kernels and their host protocol: a
/// 64-bit hash of the crate version and every embedded PTX module (its
/// architecture and text). Two processes with the same value run the same
/// kernels; a `ProcessGroup` refuses peers whose value differs (their
/// barriers, zones or records may not match). Hashes the embedded
/// (compressed) PTX images, which the build makes deterministically from
/// the PTX, so nothing is decompressed for it; computed once.
pub fn build_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let mut h = Hasher64::new();
        h.write(env!("CARGO_PKG_VERSION").as_bytes());
        for m in MODULES {
            h.write(m.arch.as_bytes());
            let blob = m.ptx_image.image.blob;
            h.write(&(blob.len() as u64).to_le_bytes());
            h.write(blob);
        }
        h.finish()
    })
}

/// FNV-1a style hash over 8-byte words (not cryptographic: it tells builds
/// apart, it does not resist forgery).
struct Hasher64(u64);

impl Hasher64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    fn new() -> Self {
        Hasher64(0xcbf2_9ce4_8422_2325)
    }
    fn word(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(Self::PRIME);
        self.0 ^= self.0 >> 29;
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().unwrap_or_default()));
        }
        let mut last = [0u8; 8];
        let rest = chunks.remainder();
        last[..rest.len()].copy_from_slice(rest);
        self.word(u64::from_le_bytes(last) ^ ((rest.len() as u64) << 56));
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Build-time `ptxas -v` numbers for one entry on one architecture.
pub fn kernel_stats(arch: &str, entry: &str) -> Option<&'static KernelStats> {
    KERNEL_STATS
        .iter()
        .find(|(a, k)| *a == arch && k.entry == entry)
        .map(|(_, k)| k)
}

/// One allreduce entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub op: Op,
    pub algorithm: Algorithm,
    pub dtype: Dtype,
    /// World size, 1..=8; a compile-time constant in the kernel.
    pub world: usize,
    /// Rank from `blockIdx.y` (all ranks in one launch on one GPU).
    pub virtual_ranks: bool,
}

impl Entry {
    /// `allreduce_[rmsnorm_]{algorithm}_{f32|f16|bf16}_w{N}[_virtual]`, the
    /// names in `device/src/kernels/`.
    pub fn name(&self) -> String {
        format!(
            "allreduce_{}{}_{}_w{}{}",
            match self.op {
                Op::Allreduce => "",
                Op::AddRmsNorm => "rmsnorm_",
            },
            self.algorithm.name(),
            self.dtype.name(),
            self.world,
            if self.virtual_ranks { "_virtual" } else { "" }
        )
    }

    /// Bytes of the entry's one by-value parameter.
    pub fn param_bytes(&self) -> usize {
        match self.op {
            Op::Allreduce => PARAM_BYTES,
            Op::AddRmsNorm => NORM_PARAM_BYTES,
        }
    }

    /// The family the entry belongs to: what a loader that JIT-compiles
    /// the PTX compiles together with it.
    pub fn family(&self) -> Family {
        Family {
            dtype: self.dtype,
            world: self.world,
            virtual_ranks: self.virtual_ranks,
        }
    }

    /// Every entry the kernel crate defines.
    pub fn all() -> Vec<Entry> {
        let mut v = Vec::new();
        for op in [Op::Allreduce, Op::AddRmsNorm] {
            for &algorithm in op.algorithms() {
                for dtype in Dtype::ALL {
                    for world in 1..=MAX_RANKS {
                        for virtual_ranks in [false, true] {
                            v.push(Entry {
                                op,
                                algorithm,
                                dtype,
                                world,
                                virtual_ranks,
                            });
                        }
                    }
                }
            }
        }
        v
    }
}

/// The entries of one element type for one world size and rank mode: the
/// allreduce's six algorithms and the fused operation's three (9 entries,
/// 1/48 of the module). Where the driver must JIT-compile the PTX (no SASS
/// for the device, or [`ImageChoice::Ptx`]), the host library loads one
/// module per family, when a group first needs it, instead of compiling
/// all 432 entries at once ([`PtxModule::family_ptx`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Family {
    pub dtype: Dtype,
    /// World size, 1..=8.
    pub world: usize,
    pub virtual_ranks: bool,
}

impl Family {
    /// The families a group of `world` ranks (virtual or real) uses: one
    /// per element type.
    pub fn of_group(world: usize, virtual_ranks: bool) -> [Family; 3] {
        Dtype::ALL.map(|dtype| Family {
            dtype,
            world,
            virtual_ranks,
        })
    }

    /// Every family, in a fixed order ([`Family::index`]).
    pub fn all() -> Vec<Family> {
        let mut v = Vec::new();
        for world in 1..=MAX_RANKS {
            for virtual_ranks in [false, true] {
                v.extend(Family::of_group(world, virtual_ranks));
            }
        }
        v
    }

    /// Position in [`Family::all`], for tables indexed by family; `None`
    /// for a world size outside 1..=8.
    pub fn index(&self) -> Option<usize> {
        if !(1..=MAX_RANKS).contains(&self.world) {
            return None;
        }
        let dtype = Dtype::ALL.iter().position(|d| *d == self.dtype)?;
        Some(((self.world - 1) * 2 + usize::from(self.virtual_ranks)) * Dtype::ALL.len() + dtype)
    }

    /// The family's entries: every operation and algorithm.
    pub fn entries(&self) -> Vec<Entry> {
        let mut v = Vec::new();
        for op in [Op::Allreduce, Op::AddRmsNorm] {
            for &algorithm in op.algorithms() {
                v.push(Entry {
                    op,
                    algorithm,
                    dtype: self.dtype,
                    world: self.world,
                    virtual_ranks: self.virtual_ranks,
                });
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_partition_the_entries() {
        let all = Family::all();
        assert_eq!(all.len(), 48);
        for (i, f) in all.iter().enumerate() {
            assert_eq!(f.index(), Some(i));
            assert_eq!(f.entries().len(), 9);
            assert!(f.entries().iter().all(|e| e.family() == *f));
        }
        let mut names: Vec<String> = all
            .iter()
            .flat_map(|f| f.entries())
            .map(|e| e.name())
            .collect();
        names.sort();
        let mut want: Vec<String> = Entry::all().iter().map(Entry::name).collect();
        want.sort();
        assert_eq!(names, want);
        assert_eq!(
            Family {
                dtype: Dtype::F32,
                world: 9,
                virtual_ranks: false
            }
            .index(),
            None
        );
    }
}
