//! The kernel provider interface: PTX embedded at build time, one module per
//! architecture, and a typed index of the entry points and their parameter.
//!
//! For users with their own launcher:
//! ```
//! use p2p_allreduce::ptx::{self, Entry};
//! use p2p_allreduce::{Algorithm, Dtype};
//! let module = ptx::module_for((9, 0)).expect("built for sm_90");
//! let entry = Entry { op: ptx::Op::Allreduce, algorithm: Algorithm::OneStage, dtype: Dtype::Bf16, world: 4, virtual_ranks: false };
//! assert!(module.ptx.contains(&format!(".entry {}", entry.name())));
//! // Launch `entry.name()` from `module.ptx` with one `LaunchArgs` (248 bytes) by value.
//! assert_eq!(ptx::PARAM_BYTES, 248);
//! ```

use crate::abi::{Algorithm, Dtype, LaunchArgs, NormArgs, MAX_RANKS};

/// One embedded PTX module.
#[derive(Clone, Copy, Debug)]
pub struct PtxModule {
    /// e.g. "sm_90".
    pub arch: &'static str,
    pub compute_capability: (u32, u32),
    /// The PTX text (NUL-free; append a NUL for `cuModuleLoadData`).
    pub ptx: &'static str,
    /// The same kernels as SASS for exactly `arch` (an ELF cubin from
    /// `ptxas -arch=<arch>` at build time; `None` where the build found no
    /// ptxas). A device of the same major and no lower minor compute
    /// capability runs it as it is ([`PtxModule::runs_sass_on`]), so loading
    /// takes no JIT compilation (tens of seconds for the PTX of this
    /// module). Starts 16-byte aligned.
    pub cubin: Option<&'static [u8]>,
}

impl PtxModule {
    /// Whether this module's cubin runs on a device of compute capability
    /// `cc`: SASS runs on its own major version at the same or a higher
    /// minor (sm_80 SASS on 8.6, never on 9.0).
    pub fn runs_sass_on(&self, cc: (u32, u32)) -> bool {
        self.cubin.is_some()
            && cc.0 == self.compute_capability.0
            && cc.1 >= self.compute_capability.1
    }

    /// What a device of compute capability `cc` loads under `choice`: this
    /// module's cubin (unless the driver refuses it), or why the PTX.
    pub fn cubin_for(
        &self,
        cc: (u32, u32),
        choice: ImageChoice,
    ) -> std::result::Result<&'static [u8], PtxBecause> {
        match (choice, self.cubin) {
            (ImageChoice::Ptx, _) => Err(PtxBecause::Asked),
            (ImageChoice::Auto, None) => Err(PtxBecause::NoCubin),
            (ImageChoice::Auto, Some(_)) if !self.runs_sass_on(cc) => Err(PtxBecause::OtherArch),
            (ImageChoice::Auto, Some(cubin)) => Ok(cubin),
        }
    }

    /// What a device of compute capability `cc` loads under
    /// [`ImageChoice::Auto`], unless the driver refuses the cubin:
    /// "SASS sm_90" or "PTX sm_90 (JIT)".
    pub fn describe_on(&self, cc: (u32, u32)) -> String {
        if self.cubin_for(cc, ImageChoice::Auto).is_ok() {
            format!("SASS {}", self.arch)
        } else {
            format!("PTX {} (JIT)", self.arch)
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

/// Keeps an embedded image at an alignment the driver's ELF reader accepts.
#[repr(C, align(16))]
struct Aligned<T: ?Sized>(T);

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

/// Architectures this build embeds, e.g. `["sm_120", "sm_90", "sm_80"]`.
pub fn built_archs() -> Vec<&'static str> {
    MODULES.iter().map(|m| m.arch).collect()
}

/// An identity of this build of the kernels and their host protocol: a
/// 64-bit hash of the crate version and every embedded PTX module (its
/// architecture and text). Two processes with the same value run the same
/// kernels; a `ProcessGroup` refuses peers whose value differs (their
/// barriers, zones or records may not match). Computed once (a few
/// milliseconds: tens of MB of PTX, eight bytes at a time).
pub fn build_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let mut h = Hasher64::new();
        h.write(env!("CARGO_PKG_VERSION").as_bytes());
        for m in MODULES {
            h.write(m.arch.as_bytes());
            h.write(&(m.ptx.len() as u64).to_le_bytes());
            h.write(m.ptx.as_bytes());
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
