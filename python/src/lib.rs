//! `p2p_allreduce._native`: one rank of a [`ProcessGroup`] as a Python
//! object. The torch side (tensor checks, the current stream, the
//! rendezvous over `torch.distributed`) is the Python package around it
//! (`python/p2p_allreduce`); this module sees only device pointers,
//! element counts, dtype names and stream handles, so it needs no torch to
//! build.
//!
//! Every pointer a caller passes is checked against the driver's view of
//! this device's memory before any work is enqueued: it must lie, with the
//! whole message, inside one live allocation of this rank's context
//! (`check_range`). A wrong integer from Python is a typed error, not a
//! stray read or write. Stream handles cannot be checked that way: like
//! `torch.cuda.ExternalStream`, a `stream` argument must be a live CUDA
//! stream of this rank's device (the package passes torch's current one);
//! this module is the package's private layer, not a public API.

use p2p_allreduce::cudarc::driver::{sys, CudaContext, CudaStream};
use p2p_allreduce::{
    driver, AlgoChoice, Algorithm, Config, Dtype, Error, Exchange, Link, ProcessGroup,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::sync::Arc;
use std::time::Duration;

/// The Python exception for `e`: a class of `p2p_allreduce.errors` chosen
/// by kind, with the fields a caller acts on as keyword arguments.
fn to_py(e: Error) -> PyErr {
    Python::attach(|py| match raise(py, &e) {
        Ok(err) | Err(err) => err,
    })
}

fn raise(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let errors = py.import("p2p_allreduce.errors")?;
    let kw = PyDict::new(py);
    let class = match e {
        Error::PeerTimeout {
            rank,
            peer,
            barrier,
            ..
        } => {
            kw.set_item("rank", *rank)?;
            kw.set_item("peers", vec![*peer as usize])?;
            kw.set_item("barrier", format!("{barrier:?}"))?;
            "PeerTimeoutError"
        }
        Error::RendezvousTimeout { missing, .. } => {
            kw.set_item("peers", missing.clone())?;
            "PeerTimeoutError"
        }
        Error::StaleRecord { rank, .. } | Error::PeerExited { rank, .. } => {
            kw.set_item("peers", vec![*rank])?;
            "PeerTimeoutError"
        }
        // IPC cannot cross hosts: engines fall back to NCCL there.
        Error::CrossHost { peer, .. } => {
            kw.set_item("peers", vec![*peer])?;
            "UnavailableError"
        }
        // A peer's setup failed (no kernels for its GPU, out of memory, its
        // own table): this group cannot form; engines fall back to NCCL.
        Error::PeerSetupFailed { peer, .. } => {
            kw.set_item("peers", vec![*peer])?;
            "UnavailableError"
        }
        // A peer's mapped buffer is smaller than its record says (a broken
        // or foreign peer); its other ranks get PeerSetupFailed, as above.
        Error::PeerBufferTooSmall { rank, peer, .. } => {
            kw.set_item("rank", *rank)?;
            kw.set_item("peers", vec![*peer])?;
            "UnavailableError"
        }
        // Ranks that disagree about a call, found by the kernels' words.
        Error::CallMismatch { rank, peer, .. } => {
            kw.set_item("rank", *rank)?;
            kw.set_item("peers", vec![*peer as usize])?;
            "GroupError"
        }
        Error::Poisoned(_) => "PoisonedError",
        Error::NoDriver | Error::NoPtxForDevice { .. } => "UnavailableError",
        Error::WorldSize(_)
        | Error::RankCount { .. }
        | Error::Misaligned { .. }
        | Error::BufferTooSmall { .. }
        | Error::MessageTooLarge { .. }
        | Error::NotRegistered { .. }
        | Error::ZoneTooSmall { .. }
        | Error::ScratchTooSmall { .. }
        | Error::NormShape(_)
        | Error::NormAlgorithm(_)
        | Error::NormPushLlShape { .. }
        | Error::StreamSwitchInCapture
        | Error::StreamDevice { .. }
        | Error::SharedStream { .. }
        | Error::CaptureInvalidated { .. }
        | Error::RankOutOfRange { .. }
        | Error::Config(_) => "UsageError",
        Error::RankMismatch { .. } | Error::GroupMismatch { .. } | Error::Rendezvous(_) => {
            "GroupError"
        }
        _ => "P2PAllreduceError",
    };
    let class = errors.getattr(class)?;
    Ok(PyErr::from_value(class.call((e.to_string(),), Some(&kw))?))
}

/// `p2p_allreduce.errors.UsageError(msg)`: a call refused before any work.
fn usage(msg: impl Into<String>) -> PyErr {
    let msg = msg.into();
    Python::attach(|py| {
        let class = py.import("p2p_allreduce.errors")?.getattr("UsageError")?;
        Ok::<_, PyErr>(PyErr::from_value(class.call1((msg.clone(),))?))
    })
    .unwrap_or_else(|e| e)
}

trait OrPy<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> OrPy<T> for p2p_allreduce::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

fn dtype(name: &str) -> PyResult<Dtype> {
    Dtype::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| usage(format!("dtype {name:?} is not one of f32, f16, bf16")))
}

fn algo(name: &str) -> PyResult<AlgoChoice> {
    if name == "auto" {
        return Ok(AlgoChoice::Auto);
    }
    Algorithm::ALL
        .into_iter()
        .find(|a| a.name() == name)
        .map(AlgoChoice::from)
        .ok_or_else(|| {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
            usage(format!(
                "algorithm {name:?} is not auto or one of {names:?}"
            ))
        })
}

fn link_name(link: Link) -> &'static str {
    match link {
        Link::SameDevice => "same_device",
        Link::NvLink => "nvlink",
        Link::Pcie => "pcie",
    }
}

/// The all-gather of a `torch.distributed` group, as a Python callable
/// `f(bytes) -> list[bytes]` (the Python package builds it).
struct PyExchange {
    rank: usize,
    world: usize,
    all_gather: Py<PyAny>,
}

impl Exchange for PyExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(&self, mine: &[u8]) -> p2p_allreduce::Result<Vec<Vec<u8>>> {
        Python::attach(|py| {
            let got = self.all_gather.call1(py, (PyBytes::new(py, mine),))?;
            got.extract::<Vec<Vec<u8>>>(py)
        })
        .map_err(|e| Error::Rendezvous(format!("the exchange callable raised: {e}")))
    }
}

/// One rank of a group of processes (one per GPU, or several on one GPU)
/// whose buffers are shared through CUDA IPC.
#[pyclass(module = "p2p_allreduce._native", name = "Group", frozen)]
struct Group {
    group: ProcessGroup,
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
}

impl Group {
    /// The caller's stream: a `cudaStream_t` of this rank's device as an
    /// integer (0 is the legacy default stream).
    fn stream(&self, handle: usize) -> Arc<CudaStream> {
        // SAFETY: the Python layer passes `torch.cuda.current_stream(device)
        // .cuda_stream` of this rank's device, a stream torch keeps alive for
        // the whole call; the wrapper does not own it, and work on it is
        // ordered by the stream itself.
        unsafe { self.ctx.wrap_borrowed_stream(handle as sys::CUstream) }
    }

    /// `bytes` bytes at `ptr` lie inside one live allocation of this
    /// rank's context.
    fn check_range(&self, what: &str, ptr: u64, bytes: usize) -> PyResult<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (base, size) = driver::address_range(&self.ctx, ptr).map_err(|_| {
            usage(format!(
                "{what} {ptr:#x} is not device memory of this rank's GPU"
            ))
        })?;
        if ptr + bytes as u64 > base + size as u64 {
            return Err(usage(format!(
                "{what}: {bytes} bytes at {ptr:#x} run past the end of its allocation"
            )));
        }
        Ok(())
    }

    fn call(&self, route: Route, c: Call<'_>) -> PyResult<&'static str> {
        let Call {
            stream,
            dtype_name,
            count,
            input,
            output,
            algo_name,
        } = c;
        let (dt, choice) = (dtype(dtype_name)?, algo(algo_name)?);
        let bytes = count
            .checked_mul(dt.size())
            .ok_or_else(|| usage("count overflows"))?;
        self.check_range("input", input, bytes)?;
        self.check_range("output", output, bytes)?;
        let s = self.stream(stream);
        // SAFETY: both ranges lie inside live allocations of this context
        // (checked above); the Python layer holds the tensors until the work
        // is enqueued and torch's allocator does not reuse them before the
        // stream's work completes (record_stream semantics of the current
        // stream). Registered and captured inputs are kept alive by the
        // Python object that registered them.
        let used = unsafe {
            match route {
                Route::Staged => self
                    .group
                    .allreduce_raw(&s, dt, count, input, output, choice),
                Route::Registered => self
                    .group
                    .allreduce_registered_raw(&s, dt, count, input, output, choice),
                Route::Captured => self
                    .group
                    .allreduce_in_graph(&s, dt, count, input, output, choice),
            }
        }
        .py()?;
        Ok(used.name())
    }
}

/// One allreduce call as Python passes it.
struct Call<'a> {
    stream: usize,
    dtype_name: &'a str,
    count: usize,
    input: u64,
    output: u64,
    algo_name: &'a str,
}

#[derive(Clone, Copy)]
enum Route {
    Staged,
    Registered,
    Captured,
}

#[pymethods]
impl Group {
    /// Forms rank `rank` of `world` on CUDA device `device`. `all_gather`
    /// is called (in the same order on every rank) with this rank's bytes
    /// and returns every rank's, indexed by rank.
    #[new]
    #[pyo3(signature = (rank, world, device, all_gather, *, max_bytes=None, timeout_s=None, threads_per_block=None))]
    fn new(
        rank: usize,
        world: usize,
        device: usize,
        all_gather: Py<PyAny>,
        max_bytes: Option<usize>,
        timeout_s: Option<f64>,
        threads_per_block: Option<u32>,
    ) -> PyResult<Self> {
        if rank >= world {
            return Err(usage(format!("rank {rank} is outside a world of {world}")));
        }
        let mut config = Config::default();
        if let Some(b) = max_bytes {
            config.max_bytes = b;
        }
        if let Some(t) = timeout_s {
            config.timeout = Duration::try_from_secs_f64(t)
                .map_err(|_| usage(format!("timeout_s {t} is not a duration in seconds")))?;
        }
        if let Some(t) = threads_per_block {
            config.threads_per_block = t;
        }
        let ctx = driver::open_device(device).py()?;
        let ex = PyExchange {
            rank,
            world,
            all_gather,
        };
        let group = ProcessGroup::new(&ctx, &ex, config).py()?;
        Ok(Group {
            group,
            ctx,
            rank,
            world,
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
    #[getter]
    fn world(&self) -> usize {
        self.world
    }
    #[getter]
    fn device(&self) -> usize {
        self.ctx.ordinal()
    }
    /// "nvlink", "pcie" or "same_device": the link to the slowest peer.
    #[getter]
    fn link(&self) -> &'static str {
        link_name(self.group.link())
    }
    /// Staging and scratch bytes per rank (`Config::max_bytes`).
    #[getter]
    fn max_bytes(&self) -> usize {
        self.group.config().max_bytes
    }
    /// Whether `Auto`'s table comes from a `p2p-allreduce tune` file.
    #[getter]
    fn tuned(&self) -> bool {
        matches!(
            self.group.config().thresholds.origin(),
            p2p_allreduce::thresholds::Origin::File { .. }
        )
    }

    /// Who the table gives each size to, for this group's link and world:
    /// `[(up_to bytes or None for no limit, winner, margin or None)]`,
    /// winner one of "ours", "nccl", "nccl_symmetric" (what
    /// `p2p-allreduce tune` measured; all "ours" without a table).
    #[getter]
    fn nccl_bands(&self) -> Vec<(Option<usize>, &'static str, Option<f64>)> {
        self.group
            .config()
            .thresholds
            .winners(self.group.link(), self.world)
            .iter()
            .map(|b| {
                (
                    (b.up_to != usize::MAX).then_some(b.up_to),
                    b.winner.name(),
                    b.margin,
                )
            })
            .collect()
    }

    /// Who runs `count` elements of `dtype`: "ours", "nccl" or
    /// "nccl_symmetric" (`deterministic`: always "ours").
    fn route(&self, dtype_name: &str, count: usize, deterministic: bool) -> PyResult<&'static str> {
        let mode = if deterministic {
            p2p_allreduce::thresholds::Mode::Deterministic
        } else {
            p2p_allreduce::thresholds::Mode::Fastest
        };
        Ok(self.group.route(count, dtype(dtype_name)?, mode).name())
    }

    /// The algorithm `algo` resolves to for `count` elements of `dtype`.
    fn choose(&self, dtype_name: &str, count: usize, algo_name: &str) -> PyResult<&'static str> {
        let (dt, choice) = (dtype(dtype_name)?, algo(algo_name)?);
        let bytes = count.saturating_mul(dt.size());
        let cfg = self.group.config();
        Ok(cfg
            .choose(choice, bytes, self.world, self.group.link())
            .name())
    }

    /// Staged allreduce (any input pointer; `output == input` allowed).
    /// Returns the algorithm's name.
    fn allreduce(
        &self,
        stream: usize,
        dtype: &str,
        count: usize,
        input: u64,
        output: u64,
        algo: &str,
    ) -> PyResult<&'static str> {
        self.call(
            Route::Staged,
            Call {
                stream,
                dtype_name: dtype,
                count,
                input,
                output,
                algo_name: algo,
            },
        )
    }

    /// Zero-copy allreduce of an input inside a registered buffer; the
    /// output must not overlap it.
    fn allreduce_registered(
        &self,
        stream: usize,
        dtype: &str,
        count: usize,
        input: u64,
        output: u64,
        algo: &str,
    ) -> PyResult<&'static str> {
        self.call(
            Route::Registered,
            Call {
                stream,
                dtype_name: dtype,
                count,
                input,
                output,
                algo_name: algo,
            },
        )
    }

    /// Zero-copy allreduce captured in a CUDA graph, registered later by
    /// `register_captured`; the output must not overlap the input.
    fn allreduce_in_graph(
        &self,
        stream: usize,
        dtype: &str,
        count: usize,
        input: u64,
        output: u64,
        algo: &str,
    ) -> PyResult<&'static str> {
        self.call(
            Route::Captured,
            Call {
                stream,
                dtype_name: dtype,
                count,
                input,
                output,
                algo_name: algo,
            },
        )
    }

    /// The fused allreduce + residual add + RMSNorm: `input` and
    /// `residual` hold `rows * hidden` elements, `gamma` `hidden`;
    /// `residual` is updated in place, `normed` written. `route`: "staged",
    /// "registered" (input inside a registered buffer) or "captured"
    /// (zero-copy inside a graph capture); zero-copy outputs must not
    /// overlap the input. Returns the algorithm's name.
    #[pyo3(signature = (route, stream, dtype, rows, hidden, eps, input, residual, gamma, normed, algo))]
    #[allow(clippy::too_many_arguments)]
    fn allreduce_add_rmsnorm(
        &self,
        route: &str,
        stream: usize,
        dtype: &str,
        rows: usize,
        hidden: usize,
        eps: f32,
        input: u64,
        residual: u64,
        gamma: u64,
        normed: u64,
        algo: &str,
    ) -> PyResult<&'static str> {
        let (dt, choice) = (self::dtype(dtype)?, self::algo(algo)?);
        let bytes = rows
            .checked_mul(hidden)
            .and_then(|n| n.checked_mul(dt.size()))
            .ok_or_else(|| usage("rows * hidden overflows"))?;
        self.check_range("input", input, bytes)?;
        self.check_range("residual", residual, bytes)?;
        self.check_range("weight", gamma, hidden * dt.size())?;
        self.check_range("output", normed, bytes)?;
        let s = self.stream(stream);
        let ptrs = [input, residual, gamma, normed];
        // SAFETY: every range lies inside a live allocation of this context
        // (checked above); the Python layer holds the tensors until the work
        // is enqueued (captured ones as long as the graph), checks that
        // `normed` and, zero-copy, `residual` overlap none of the inputs,
        // and torch's allocator orders reuse after the stream's work.
        let used = unsafe {
            match route {
                "staged" => self
                    .group
                    .allreduce_add_rmsnorm_raw(&s, dt, rows, hidden, eps, ptrs, choice),
                "registered" => self
                    .group
                    .allreduce_add_rmsnorm_registered_raw(&s, dt, rows, hidden, eps, ptrs, choice),
                "captured" => self
                    .group
                    .allreduce_add_rmsnorm_in_graph(&s, dt, rows, hidden, eps, ptrs, choice),
                other => {
                    return Err(usage(format!(
                        "route {other:?} is not staged, registered or captured"
                    )))
                }
            }
        }
        .py()?;
        Ok(used.name())
    }

    /// Registers `bytes` bytes at `ptr` with every rank's (collective).
    fn register_buffer(&self, all_gather: Py<PyAny>, ptr: u64, bytes: usize) -> PyResult<usize> {
        self.check_range("registered buffer", ptr, bytes.max(1))?;
        let ex = PyExchange {
            rank: self.rank,
            world: self.world,
            all_gather,
        };
        // SAFETY: the range is live device memory of this context (checked);
        // the Python object keeps the tensor alive as long as the group.
        unsafe { self.group.register_buffer(&ex, ptr, bytes) }.py()
    }

    fn is_registered(&self, ptr: u64) -> bool {
        self.group.is_registered(ptr)
    }

    /// Fills the tables of the allreduces captured since the last call
    /// (collective). Returns how many.
    fn register_captured(&self, all_gather: Py<PyAny>) -> PyResult<usize> {
        let ex = PyExchange {
            rank: self.rank,
            world: self.world,
            all_gather,
        };
        self.group.register_captured(&ex).py()
    }

    /// Whether `stream` is capturing a CUDA graph.
    fn is_capturing(&self, stream: usize) -> PyResult<bool> {
        driver::is_capturing(&self.stream(stream)).py()
    }

    /// Raises an error a kernel has recorded so far, without waiting.
    fn poll(&self) -> PyResult<()> {
        self.group.poll().py()
    }

    /// Waits for `stream`, then raises an error a kernel recorded.
    fn check(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let s = self.stream(stream);
        py.detach(|| self.group.check(&s)).py()
    }

    /// Waits for the device and zeroes this rank's signal (every rank must
    /// reset before the next collective).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.group.reset()).py()
    }

    /// Fault injection for tests: every rank calls it; the ranks in the
    /// bit mask `absent_ranks` leave at once, the others time out.
    fn launch_with_absent_ranks(
        &self,
        stream: usize,
        absent_ranks: u32,
        dtype_name: &str,
        algorithm: &str,
        count: usize,
    ) -> PyResult<()> {
        let a = algo(algorithm)?
            .explicit()
            .ok_or_else(|| usage("name an algorithm, not auto"))?;
        let s = self.stream(stream);
        self.group
            .launch_with_absent_ranks(&s, absent_ranks, dtype(dtype_name)?, a, count)
            .py()
    }

    fn __repr__(&self) -> String {
        format!(
            "Group(rank={}, world={}, device={}, link={})",
            self.rank,
            self.world,
            self.ctx.ordinal(),
            self.link()
        )
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
#[pyfunction]
fn driver_present() -> bool {
    driver::driver_present()
}

/// The algorithm names `algo=` accepts (besides "auto").
#[pyfunction]
fn algorithms() -> Vec<&'static str> {
    Algorithm::ALL.iter().map(|a| a.name()).collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Group>()?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
