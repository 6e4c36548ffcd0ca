//! The kernel module loaded into a context: entry lookups, occupancy,
//! launches. Every call binds the module's context first.

use super::{compute_capability, module_for_device, record_drop_error};
use crate::abi::{LaunchArgs, NormArgs};
use crate::error::{Context as _, Result};
use crate::ptx::{Entry, Family, ImageChoice, LoadedImage, PtxBecause, PtxModule};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

/// The kernel module(s) loaded into one context, with entry lookups cached.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    modules: Modules,
    pub ptx: &'static PtxModule,
    image: LoadedImage,
    functions: Mutex<HashMap<Entry, usize>>,
    /// Co-resident block capacity per (entry, threads): a fixed property of
    /// the kernel and device, asked on every virtual launch.
    capacity: Mutex<HashMap<(Entry, u32), u32>>,
    /// Co-resident cluster capacity per (entry, threads, CTAs per cluster).
    cluster_capacity: Mutex<HashMap<(Entry, u32, u32), u32>>,
}

/// What is loaded: the whole cubin (one module, no JIT), or the PTX one
/// family at a time, each JIT-compiled when first needed.
enum Modules {
    Sass(sys::CUmodule),
    /// Indexed by [`Family::index`]; each slot loads once (its lock held
    /// while the driver compiles it, so other families load meanwhile).
    Ptx(Vec<Mutex<Option<sys::CUmodule>>>),
}

/// The launch attribute of thread-block clusters of `ctas` blocks along x.
fn cluster_attribute(ctas: u32) -> sys::CUlaunchAttribute {
    // SAFETY: the attribute is plain data (an id and a union of plain
    // values); all zeros is a valid value of it, overwritten below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = ctas;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

/// A launch configuration of `grid` blocks of `threads` threads, no
/// dynamic shared memory, on `stream`, with the one attribute `attr`.
fn launch_config(
    grid: (u32, u32),
    threads: u32,
    stream: sys::CUstream,
    attr: &mut sys::CUlaunchAttribute,
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}

// SAFETY: CUmodule and CUfunction handles are usable from any thread once the
// owning context is current; all use goes through `ctx.bind_to_thread()`.
unsafe impl Send for Kernels {}
// SAFETY: as above; the function cache is behind a Mutex.
unsafe impl Sync for Kernels {}

/// Modules already loaded, per context and image choice: loading the PTX
/// means JIT-compiling it, so groups on the same context share one module.
/// Weak, so the module is unloaded when the last group using it is dropped.
type LoadedKey = (usize, ImageChoice);
static LOADED: Mutex<Vec<(LoadedKey, std::sync::Weak<Kernels>)>> = Mutex::new(Vec::new());

impl Kernels {
    /// The module for `ctx` from the image `choice` names, loaded once and
    /// shared.
    pub fn for_context(ctx: &Arc<CudaContext>, choice: ImageChoice) -> Result<Arc<Self>> {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        loaded.retain(|(_, w)| w.strong_count() > 0);
        let key = (ctx.cu_ctx() as usize, choice);
        if let Some(k) = loaded
            .iter()
            .find(|(c, _)| *c == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(k);
        }
        let k = Arc::new(Self::load(ctx, choice)?);
        loaded.push((key, Arc::downgrade(&k)));
        Ok(k)
    }

    /// Loads the kernels for `ctx` (not shared; see
    /// [`Kernels::for_context`]): the cubin where `choice` allows it and it
    /// runs on the device (one module, decompressed on first use), else the
    /// PTX, one family at a time as groups need them
    /// ([`Kernels::load_family`]; nothing is compiled here). A cubin the
    /// driver refuses falls back to the PTX, and [`Kernels::image`] says
    /// why.
    pub fn load(ctx: &Arc<CudaContext>, choice: ImageChoice) -> Result<Self> {
        let ptx = module_for_device(ctx)?;
        let cc = compute_capability(ctx)?;
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let because = match ptx.cubin_for(cc, choice) {
            Ok(cubin) => {
                // SAFETY: `cubin` is an ELF image decompressed from this
                // binary into memory kept for the process ('static, 16-byte
                // aligned), alive for the whole call.
                match unsafe { result::module::load_data(cubin.as_ptr() as *const c_void) } {
                    Ok(module) => {
                        return Ok(Self::new(
                            ctx,
                            Modules::Sass(module),
                            ptx,
                            LoadedImage::Sass,
                        ))
                    }
                    Err(e) => PtxBecause::Refused(e.to_string()),
                }
            }
            Err(because) => because,
        };
        let slots = Family::all().iter().map(|_| Mutex::new(None)).collect();
        Ok(Self::new(
            ctx,
            Modules::Ptx(slots),
            ptx,
            LoadedImage::Ptx(because),
        ))
    }

    fn new(
        ctx: &Arc<CudaContext>,
        modules: Modules,
        ptx: &'static PtxModule,
        image: LoadedImage,
    ) -> Self {
        Kernels {
            ctx: ctx.clone(),
            modules,
            ptx,
            image,
            functions: Mutex::new(HashMap::new()),
            capacity: Mutex::new(HashMap::new()),
            cluster_capacity: Mutex::new(HashMap::new()),
        }
    }

    /// The module holding `family`'s entries: the cubin's, or the family's
    /// own PTX module, JIT-compiled by the driver on the first call (about
    /// 1/48 of the whole PTX; later calls, and calls from other threads
    /// meanwhile, wait for that one compilation).
    fn module_of(&self, family: Family) -> Result<sys::CUmodule> {
        let slots = match &self.modules {
            Modules::Sass(m) => return Ok(*m),
            Modules::Ptx(slots) => slots,
        };
        let slot = family
            .index()
            .and_then(|i| slots.get(i))
            .ok_or(crate::error::Error::WorldSize(family.world))?;
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = *slot {
            return Ok(m);
        }
        let src = CString::new(self.ptx.family_ptx(family)).expect("embedded PTX has no NUL byte");
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: `src` is a NUL-terminated PTX image that outlives the call.
        let module = unsafe { result::module::load_data(src.as_ptr() as *const c_void) }
            .during("cuModuleLoadData (JIT-compiling one family's PTX)")?;
        *slot = Some(module);
        Ok(module)
    }

    /// JIT-compiles the device's whole PTX (all entries) as one module and
    /// unloads it: what loading the PTX cost before it was loaded per
    /// family (`p2p-allreduce info --load-times --whole-ptx` times it).
    pub fn load_whole_ptx(ctx: &Arc<CudaContext>) -> Result<()> {
        let ptx = module_for_device(ctx)?;
        let src = CString::new(ptx.ptx()).expect("embedded PTX has no NUL byte");
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: `src` is a NUL-terminated PTX image that outlives the call.
        let module = unsafe { result::module::load_data(src.as_ptr() as *const c_void) }
            .during("cuModuleLoadData (JIT-compiling the whole PTX)")?;
        // SAFETY: loaded just above, unloaded once, no function taken from it.
        unsafe { result::module::unload(module) }.during("cuModuleUnload")
    }

    /// Makes `family`'s entries launchable: nothing to do for the cubin;
    /// for the PTX, JIT-compiles the family's module unless it is loaded.
    pub fn load_family(&self, family: Family) -> Result<()> {
        self.module_of(family).map(|_| ())
    }

    /// The families whose PTX modules are loaded (none for the cubin).
    pub fn loaded_families(&self) -> Vec<Family> {
        match &self.modules {
            Modules::Sass(_) => Vec::new(),
            Modules::Ptx(slots) => Family::all()
                .into_iter()
                .zip(slots)
                .filter(|(_, s)| s.lock().unwrap_or_else(|p| p.into_inner()).is_some())
                .map(|(f, _)| f)
                .collect(),
        }
    }

    /// Loads `families` at once, one thread each (the driver compiles each
    /// family's PTX on the thread that asks); the first error, if any.
    pub fn load_families(&self, families: &[Family]) -> Result<()> {
        if matches!(self.modules, Modules::Sass(_)) || families.len() <= 1 {
            return families.iter().try_for_each(|f| self.load_family(*f));
        }
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let mut handles = Vec::new();
            let mut inline = Vec::new();
            for f in &families[1..] {
                let spawned = std::thread::Builder::new()
                    .name("p2p-allreduce-jit".into())
                    .spawn_scoped(s, move || self.load_family(*f));
                match spawned {
                    Ok(h) => handles.push(h),
                    // No thread to be had: compile it here.
                    Err(_) => inline.push(self.load_family(*f)),
                }
            }
            inline.push(self.load_family(families[0]));
            for h in handles {
                inline.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            }
            inline
        });
        results.into_iter().collect()
    }

    /// The image this module was loaded from.
    pub fn image(&self) -> &LoadedImage {
        &self.image
    }

    /// Launches `entry` with one by-value [`LaunchArgs`] on `stream`, with
    /// this module's context current.
    ///
    /// # Safety
    /// Every pointer in `args` (and in the table it points to) must be valid
    /// device memory of the sizes the kernel touches for `args.count`, and
    /// `stream` must belong to this module's context.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        entry: Entry,
        grid: (u32, u32),
        threads: u32,
        args: &LaunchArgs,
    ) -> Result<()> {
        debug_assert_eq!(entry.op, crate::ptx::Op::Allreduce);
        // SAFETY: forwarded; an allreduce entry takes one LaunchArgs.
        unsafe {
            self.launch_param(
                stream,
                entry,
                grid,
                threads,
                args as *const LaunchArgs as *mut c_void,
            )
        }
    }

    /// Launches a fused entry (`Op::AddRmsNorm`) with one by-value
    /// [`NormArgs`] on `stream`, with this module's context current; in
    /// thread-block clusters of `ctas` blocks along x when `ctas > 1`
    /// (`grid.0` a multiple of it; sm_90 and newer).
    ///
    /// # Safety
    /// As for [`Kernels::launch`], for every pointer in `args` (residual,
    /// residual out, gamma, outputs, the table) and `args.base.count`.
    pub unsafe fn launch_norm(
        &self,
        stream: &CudaStream,
        entry: Entry,
        grid: (u32, u32),
        threads: u32,
        ctas: u32,
        args: &NormArgs,
    ) -> Result<()> {
        debug_assert_eq!(entry.op, crate::ptx::Op::AddRmsNorm);
        let param = args as *const NormArgs as *mut c_void;
        if ctas <= 1 {
            // SAFETY: forwarded; a fused entry takes one NormArgs.
            return unsafe { self.launch_param(stream, entry, grid, threads, param) };
        }
        debug_assert_eq!(grid.0 % ctas, 0, "the grid is whole clusters");
        let f = self.function(entry)?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let mut attr = cluster_attribute(ctas);
        let config = launch_config(grid, threads, stream.cu_stream(), &mut attr);
        let mut params = [param];
        // SAFETY: as for `launch_param` (one parameter of the entry's size
        // and layout, copied by the driver before it returns); `config`
        // and the attribute it points to live through the call.
        unsafe {
            sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()).result()
        }
        .during("cuLaunchKernelEx(cluster)")
    }

    /// # Safety
    /// `param` points to the one parameter `entry` takes (its layout and
    /// size, `Entry::param_bytes`), valid for the call; the pointers in it
    /// as the entry's contract requires.
    unsafe fn launch_param(
        &self,
        stream: &CudaStream,
        entry: Entry,
        grid: (u32, u32),
        threads: u32,
        param: *mut c_void,
    ) -> Result<()> {
        let f = self.function(entry)?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let mut params = [param];
        // SAFETY: `f` takes exactly one parameter of the entry's size and
        // layout (asserted in abi.rs and checked against the PTX by
        // tests/ptx.rs); the driver copies the parameter bytes before
        // returning; pointer validity is the caller's contract.
        unsafe {
            result::launch_kernel(
                f,
                (grid.0, grid.1, 1),
                (threads, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .during("cuLaunchKernel")
    }

    pub fn function(&self, entry: Entry) -> Result<sys::CUfunction> {
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&entry)
        {
            return Ok(*f as sys::CUfunction);
        }
        // Not under the cache's lock: this may JIT-compile a family.
        let module = self.module_of(entry.family())?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let name = CString::new(entry.name()).expect("entry names have no NUL byte");
        // SAFETY: the module is loaded and stays loaded while `self` lives.
        let f =
            unsafe { result::module::get_function(module, name) }.during("cuModuleGetFunction")?;
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry, f as usize);
        Ok(f)
    }

    /// Resolves every entry a group of `world` ranks can launch (function
    /// handle and co-resident capacity), so that no allreduce makes these
    /// driver calls later: a first call inside CUDA-graph capture must not
    /// have to.
    ///
    /// Where the PTX is loaded, this first JIT-compiles the group's three
    /// families (one per element type), concurrently.
    pub fn prepare(&self, world: usize, virtual_ranks: bool, threads: u32) -> Result<()> {
        self.load_families(&Family::of_group(world, virtual_ranks))?;
        for op in [crate::ptx::Op::Allreduce, crate::ptx::Op::AddRmsNorm] {
            for &algorithm in op.algorithms() {
                for dtype in crate::abi::Dtype::ALL {
                    let entry = Entry {
                        op,
                        algorithm,
                        dtype,
                        world,
                        virtual_ranks,
                    };
                    self.co_resident_blocks(entry, threads)?;
                }
            }
        }
        // The cluster sizes the fused push_ll splits rows over.
        if self.ptx.compute_capability.0 >= 9 {
            for dtype in crate::abi::Dtype::ALL {
                let entry = Entry {
                    op: crate::ptx::Op::AddRmsNorm,
                    algorithm: crate::abi::Algorithm::PushLl,
                    dtype,
                    world,
                    virtual_ranks,
                };
                // At every block a split plan can have (a multiple of 32
                // up to the configured one).
                let mut ctas = 2;
                while ctas as usize <= crate::abi::NORM_MAX_CTAS {
                    for t in (32..=threads).step_by(32) {
                        self.co_resident_clusters(entry, t, ctas)?;
                    }
                    ctas *= 2;
                }
            }
        }
        Ok(())
    }

    /// How many clusters of `ctas` blocks of `threads` threads of `entry`
    /// fit on the whole GPU at once (`ctas == 1`: blocks, as
    /// [`Kernels::co_resident_blocks`]). Cached, like it; [`Kernels::prepare`]
    /// asks for every cluster size the fused push_ll can use.
    pub fn co_resident_clusters(&self, entry: Entry, threads: u32, ctas: u32) -> Result<u32> {
        if ctas <= 1 {
            return self.co_resident_blocks(entry, threads);
        }
        let key = (entry, threads, ctas);
        if let Some(c) = self
            .cluster_capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(*c);
        }
        let f = self.function(entry)?;
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let mut attr = cluster_attribute(ctas);
        let config = launch_config((ctas, 1), threads, std::ptr::null_mut(), &mut attr);
        let mut n = 0i32;
        // SAFETY: `f` is a valid function of a loaded module; `config`
        // and its attribute live through the call; `n` is written.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &config).result() }
            .during("cuOccupancyMaxActiveClusters")?;
        let c = n.max(0) as u32;
        self.cluster_capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, c);
        Ok(c)
    }

    /// How many blocks of `threads` threads of `entry` fit on the whole GPU at once.
    pub fn co_resident_blocks(&self, entry: Entry, threads: u32) -> Result<u32> {
        if let Some(c) = self
            .capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(entry, threads))
        {
            return Ok(*c);
        }
        let f = self.function(entry)?;
        let sms = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("cuDeviceGetAttribute(multiprocessors)")?;
        // SAFETY: `f` is a valid function of a loaded module.
        let per_sm =
            unsafe { result::occupancy::max_active_block_per_multiprocessor(f, threads as i32, 0) }
                .during("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
        let c = (per_sm.max(0) as u32) * sms as u32;
        self.capacity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((entry, threads), c);
        Ok(c)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let loaded: Vec<sys::CUmodule> = match &mut self.modules {
            Modules::Sass(m) => vec![*m],
            Modules::Ptx(slots) => slots
                .iter_mut()
                .filter_map(|s| *s.get_mut().unwrap_or_else(|p| p.into_inner()))
                .collect(),
        };
        for module in loaded {
            let r = self.ctx.bind_to_thread().and_then(|()| {
                // SAFETY: each module was loaded by this value, is unloaded
                // once, and no function of it is used after `self` drops.
                unsafe { result::module::unload(module) }
            });
            record_drop_error(&self.ctx, r);
        }
    }
}
