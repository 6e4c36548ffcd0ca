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

/// Architectures this build embeds, e.g. `["sm_120", "sm_90", "sm_80"]`.
pub fn built_archs() -> Vec<&'static str> {
    MODULES.iter().map(|m| m.arch).collect()
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
