//! Timing allreduces the way the project reports them: CUDA events around
//! replays of a CUDA graph holding `per_graph` back-to-back collectives,
//! median over replays. Used by `benches/allreduce.rs` and `p2p-allreduce bench`.

use crate::abi::{Algorithm, Dtype};
use crate::error::{Context as _, Result};
use crate::group::{DeviceElement, VirtualGroup};
use crate::plan::AlgoChoice;
use cudarc::driver::{sys, CudaSlice, CudaStream};
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
    let ctx = stream.context().clone();
    let reg = group.alloc_registered::<T>(count.max(1))?;
    if count > 0 {
        let src = stream
            .clone_htod(&fill[..count])
            .during("cuMemcpyHtoD (bench input)")?;
        for r in 0..group.world() {
            reg.copy_from(r, stream, &src)?;
        }
    }
    let mut outs: Vec<CudaSlice<T>> = (0..group.world())
        .map(|_| {
            stream
                .alloc_zeros::<T>(count.max(1))
                .during("cuMemAlloc (bench output)")
        })
        .collect::<Result<_>>()?;
    let mut used = Algorithm::OneStage;
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .during("cuStreamBeginCapture")?;
    let mut r = Ok(());
    for _ in 0..timing.per_graph {
        match group.allreduce_registered(stream, &reg, count, &mut outs, algo) {
            Ok(a) => used = a,
            Err(e) => {
                r = Err(e);
                break;
            }
        }
    }
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .during("cuStreamEndCapture")?;
    r?;
    let graph = graph.ok_or_else(|| crate::Error::Config("captured graph is empty".into()))?;
    for _ in 0..timing.warmup {
        graph.launch().during("cuGraphLaunch")?;
    }
    group.check(stream)?;
    let mut times = Vec::with_capacity(timing.replays);
    let start = ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .during("cuEventCreate")?;
    let end = ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .during("cuEventCreate")?;
    for _ in 0..timing.replays.max(1) {
        start.record(stream).during("cuEventRecord")?;
        graph.launch().during("cuGraphLaunch")?;
        end.record(stream).during("cuEventRecord")?;
        end.synchronize().during("cuEventSynchronize")?;
        let ms = start.elapsed_ms(&end).during("cuEventElapsedTime")?;
        times.push(ms as f64 * 1000.0 / timing.per_graph as f64);
    }
    group.check(stream)?;
    times.sort_by(f64::total_cmp);
    Ok(Sample {
        algorithm: used,
        median_us: times[times.len() / 2],
        min_us: times[0],
        max_us: times[times.len() - 1],
    })
}

/// nccl-tests' bandwidth conventions: algbw = bytes / time, busbw = algbw x 2(N-1)/N.
pub fn bandwidths(bytes: usize, world: usize, us: f64) -> (f64, f64) {
    let algbw = bytes as f64 / (us * 1e-6) / 1e9;
    let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
    (algbw, busbw)
}

/// Bytes of one element of `dtype`, for sizing sweeps.
pub fn elements_for_bytes(bytes: usize, dtype: Dtype) -> usize {
    bytes / dtype.size()
}
