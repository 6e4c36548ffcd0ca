//! Timing allreduces the way the project reports them: CUDA events around
//! replays of a CUDA graph holding `per_graph` back-to-back collectives,
//! median over replays. Used by `benches/allreduce.rs` and `p2p-allreduce bench`.

use crate::abi::Algorithm;
use crate::driver::DeviceAlloc;
use crate::element::DeviceElement;
use crate::error::{Context as _, Result};
use crate::plan::AlgoChoice;
use crate::VirtualGroup;
use cudarc::driver::{sys, CudaStream};
use std::sync::Arc;

/// How to time one configuration.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Collectives captured back to back in one graph.
    pub per_graph: usize,
    /// Untimed replays first.
    pub warmup: usize,
    /// Timed replays; the median is reported.
    pub replays: usize,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            per_graph: 20,
            warmup: 3,
            replays: 25,
        }
    }
}

/// Result of timing one configuration.
#[derive(Clone, Debug)]
pub struct Sample {
    pub algorithm: Algorithm,
    /// Median microseconds per allreduce.
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

/// Times `group` on `count` elements of `T` in registered buffers filled with
/// `fill` (the same on every rank), with `algo`.
pub fn time_registered<T: DeviceElement>(
    group: &VirtualGroup,
    stream: &Arc<CudaStream>,
    count: usize,
    fill: &[T],
    algo: AlgoChoice,
    timing: Timing,
) -> Result<Sample> {
    let reg = group.alloc_registered::<T>(count.max(1))?;
    if count > 0 {
        let src = stream
            .clone_htod(&fill[..count])
            .during("cuMemcpyHtoD (bench input)")?;
        for r in 0..group.world() {
            reg.copy_from(r, stream, &src)?;
        }
    }
    // Plain allocations, not cudarc slices: with cudarc's event tracking
    // on (its default), taking a slice's pointer inside the capture would
    // wait for an event recorded before it, which CUDA refuses.
    let outs = (0..group.world())
        .map(|_| DeviceAlloc::zeroed(group.kernels().context(), count.max(1) * T::DTYPE.size()))
        .collect::<Result<Vec<_>>>()?;
    let out_ptrs: Vec<u64> = outs.iter().map(DeviceAlloc::ptr).collect();
    let streams = [stream.clone()];
    let mut used = Algorithm::OneStage;
    let times = time_graphs(
        &streams,
        timing,
        || {
            // SAFETY: every output holds `count` elements and outlives the
            // graph (dropped after `time_graphs` has waited for it).
            used = unsafe { group.allreduce_registered_raw(stream, &reg, count, &out_ptrs, algo)? };
            Ok(())
        },
        || Ok(()),
        || group.check(stream),
    )?;
    drop(outs);
    Ok(Sample::from_times(used, times))
}

impl Sample {
    /// Median, min and max of per-collective times in microseconds.
    pub fn from_times(algorithm: Algorithm, mut times: Vec<f64>) -> Sample {
        times.sort_by(f64::total_cmp);
        Sample {
            algorithm,
            median_us: times[times.len() / 2],
            min_us: times[0],
            max_us: times[times.len() - 1],
        }
    }
}

/// The project's timing method for any collective on any number of streams
/// (one per rank driven from this process): every stream is captured into
/// its own CUDA graph holding `per_graph` calls of `enqueue` (which enqueues
/// one collective on every stream); the graphs are replayed `warmup` times,
/// then `replays` times between CUDA events recorded on each stream. A
/// replay's time is the slowest stream's; the result is microseconds per
/// collective, one entry per replay. `after_capture` runs once between
/// capture and the first replay (e.g. `ProcessGroup::register_captured`);
/// `check` runs after the warm-up and at the end (it should wait for the
/// streams and report kernel errors).
///
/// Ranks in other processes time their own streams the same way; the
/// collectives' barriers keep the ranks in step.
pub fn time_graphs(
    streams: &[Arc<CudaStream>],
    timing: Timing,
    mut enqueue: impl FnMut() -> Result<()>,
    after_capture: impl FnOnce() -> Result<()>,
    check: impl Fn() -> Result<()>,
) -> Result<Vec<f64>> {
    // Ending one stream's capture instantiates its graph, which allocates;
    // in thread-local mode that is refused while this thread still captures
    // the other streams (and invalidates their captures). Several streams
    // are therefore captured in relaxed mode.
    let mode = if streams.len() > 1 {
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED
    } else {
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    };
    for s in streams {
        s.begin_capture(mode).during("cuStreamBeginCapture")?;
    }
    let mut r = Ok(());
    for _ in 0..timing.per_graph {
        r = enqueue();
        if r.is_err() {
            break;
        }
    }
    // Every capture is ended, also after an error.
    let mut graphs = Vec::with_capacity(streams.len());
    let mut end_err = Ok(());
    for s in streams {
        match s.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(g)) => graphs.push(g),
            Ok(None) => {
                end_err = Err(crate::Error::Config("captured graph is empty".into()));
            }
            Err(e) => end_err = Err(e).during("cuStreamEndCapture"),
        }
    }
    r?;
    end_err?;
    after_capture()?;
    for _ in 0..timing.warmup {
        for g in &graphs {
            g.launch().during("cuGraphLaunch")?;
        }
    }
    check()?;
    let events = |s: &Arc<CudaStream>| {
        let ctx = s.context();
        Ok::<_, crate::Error>((
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .during("cuEventCreate")?,
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .during("cuEventCreate")?,
        ))
    };
    let ev = streams.iter().map(events).collect::<Result<Vec<_>>>()?;
    let mut times = Vec::with_capacity(timing.replays.max(1));
    for _ in 0..timing.replays.max(1) {
        for ((s, g), (start, _)) in streams.iter().zip(&graphs).zip(&ev) {
            start.record(s).during("cuEventRecord")?;
            g.launch().during("cuGraphLaunch")?;
        }
        for (s, (_, end)) in streams.iter().zip(&ev) {
            end.record(s).during("cuEventRecord")?;
        }
        let mut slowest = 0f64;
        for (start, end) in &ev {
            end.synchronize().during("cuEventSynchronize")?;
            let ms = start.elapsed_ms(end).during("cuEventElapsedTime")?;
            slowest = slowest.max(ms as f64);
        }
        times.push(slowest * 1000.0 / timing.per_graph as f64);
    }
    check()?;
    Ok(times)
}

/// nccl-tests' bandwidth conventions: algbw = bytes / time, busbw = algbw x 2(N-1)/N.
pub fn bandwidths(bytes: usize, world: usize, us: f64) -> (f64, f64) {
    let algbw = bytes as f64 / (us * 1e-6) / 1e9;
    let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
    (algbw, busbw)
}
