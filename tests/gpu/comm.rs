//! `comm::Comm` (issue 45) on the device: the one-thread-per-rank shape
//! (`Comm::from_devices`, pegainfer's) eager, captured in CUDA graphs by
//! each rank's thread, and a call the kernels do not serve.

use crate::harness::{all_gpus, assert_ranks, download_on, poisoned_on, upload_on, Gpu};
use cudarc::driver::sys;
use half::bf16;
use p2p_allreduce::comm::{Comm, ReduceOp};
use p2p_allreduce::peer_group::Route;
use p2p_allreduce::reference::{self, values};
use p2p_allreduce::{Dtype, Error};

const ROWS: usize = 4;
const HIDDEN: usize = 2048;
const EPS: f32 = 1e-5;
const REPLAYS: u64 = 10;

/// One rank's results: the eager sum, the eager fused residual and normed
/// rows, and each replay's (residual, normed).
struct Got {
    sum: Vec<u32>,
    residual: Vec<u32>,
    normed: Vec<u32>,
    replays: Vec<(Vec<u32>, Vec<u32>)>,
}

/// One call's data: every rank's input, the residual and gamma (the same
/// on every rank), and what each rank must get.
struct Data {
    inputs: Vec<Vec<u32>>,
    residual: Vec<u32>,
    gamma: Vec<u32>,
    sum: Vec<u32>,
    residual_out: Vec<u32>,
    normed: Vec<u32>,
}

fn data(world: usize, seed: u64) -> Data {
    let n = ROWS * HIDDEN;
    let inputs = values::adversarial_inputs(Dtype::Bf16, world, n, seed, false);
    let residual = values::adversarial_inputs(Dtype::Bf16, 1, n, seed + 1, false).remove(0);
    let gamma = values::adversarial_inputs(Dtype::Bf16, 1, HIDDEN, seed + 2, false).remove(0);
    let refs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
    let sum = reference::allreduce_bits(Dtype::Bf16, &refs);
    let (residual_out, normed) =
        reference::add_rmsnorm_bits(Dtype::Bf16, &refs, &residual, &gamma, EPS);
    Data {
        inputs,
        residual,
        gamma,
        sum,
        residual_out,
        normed,
    }
}

/// Two ranks (GPUs 0 and 1, or both on GPU 0), one thread each: an eager
/// all_reduce and fused call, a `ReduceOp::Max` (NCCL's where the NCCL
/// fallback is there: checked; `CommUnserved` where not), then the fused
/// call captured in a graph by each thread (thread-local capture mode)
/// and replayed with new data, every result bit-exact on every rank.
pub fn threads(g: &Gpu) {
    let ctxs = all_gpus(g);
    let place: Vec<usize> = if ctxs.len() >= 2 {
        vec![0, 1]
    } else {
        vec![0, 0]
    };
    let world = place.len();
    let streams: Vec<_> = place
        .iter()
        .map(|&d| ctxs[d].new_stream().expect("stream"))
        .collect();
    let comms = Comm::from_devices(streams).expect("Comm::from_devices");
    let n = ROWS * HIDDEN;
    let eager = data(world, 4500);
    let replays: Vec<Data> = (0..REPLAYS).map(|it| data(world, 4600 + 10 * it)).collect();

    let results: Vec<Got> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (eager, replays) = (&eager, &replays);
                s.spawn(move || {
                    let r = comm.rank();
                    let st = comm.stream();
                    // Eager all_reduce.
                    let x = upload_on::<bf16>(&st, &eager.inputs[r]);
                    let mut out = poisoned_on::<bf16>(&st, n);
                    let route = comm
                        .all_reduce(&x, &mut out, &ReduceOp::Sum)
                        .unwrap_or_else(|e| panic!("rank {r}: all_reduce: {e}"));
                    assert!(matches!(route, Route::Kernel(_)), "rank {r}: {route:?}");
                    comm.check().expect("check");
                    let sum = download_on(&st, &out, n);
                    // Eager fused call.
                    let mut res = upload_on::<bf16>(&st, &eager.residual);
                    let gam = upload_on::<bf16>(&st, &eager.gamma);
                    let mut normed = poisoned_on::<bf16>(&st, n);
                    comm.all_reduce_add_rms_norm(&x, &mut res, &gam, EPS, &mut normed)
                        .unwrap_or_else(|e| panic!("rank {r}: fused: {e}"));
                    comm.check().expect("check");
                    let res_eager = download_on(&st, &res, n);
                    let normed_eager = download_on(&st, &normed, n);
                    // A reduction the kernels do not serve.
                    let mut mx = poisoned_on::<bf16>(&st, n);
                    match comm.all_reduce(&x, &mut mx, &ReduceOp::Max) {
                        Ok(Route::Nccl) => {
                            comm.check().expect("check");
                            let got = download_on(&st, &mx, n);
                            for (i, b) in got.iter().enumerate() {
                                let want = eager
                                    .inputs
                                    .iter()
                                    .map(|v| reference::widen(Dtype::Bf16, v[i]))
                                    .fold(f32::NEG_INFINITY, f32::max);
                                let g = reference::widen(Dtype::Bf16, *b);
                                assert_eq!(g, want, "rank {r}: NCCL max at {i}");
                            }
                            println!("  rank {r}: ReduceOp::Max went to NCCL, checked");
                        }
                        Err(Error::CommUnserved { why, .. }) => {
                            println!("  rank {r}: ReduceOp::Max refused (typed): {why}")
                        }
                        other => panic!("rank {r}: ReduceOp::Max: {other:?}"),
                    }
                    // The fused call captured by this rank's thread.
                    let mut xin = upload_on::<bf16>(&st, &eager.inputs[r]);
                    let mut res = upload_on::<bf16>(&st, &eager.residual);
                    let mut gam = upload_on::<bf16>(&st, &eager.gamma);
                    let mut normed = poisoned_on::<bf16>(&st, n);
                    st.synchronize().expect("sync");
                    st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                        .expect("begin capture");
                    let captured =
                        comm.all_reduce_add_rms_norm(&xin, &mut res, &gam, EPS, &mut normed);
                    let graph = st
                        .end_capture(sys::CUgraphInstantiate_flags(0))
                        .expect("end capture")
                        .expect("a graph");
                    captured.unwrap_or_else(|e| panic!("rank {r}: captured fused: {e}"));
                    let mut outs = Vec::new();
                    for d in replays {
                        let h = |b: &[u32]| -> Vec<bf16> {
                            b.iter().map(|&x| bf16::from_bits(x as u16)).collect()
                        };
                        st.memcpy_htod(&h(&d.inputs[r]), &mut xin).expect("input");
                        st.memcpy_htod(&h(&d.residual), &mut res).expect("residual");
                        st.memcpy_htod(&h(&d.gamma), &mut gam).expect("gamma");
                        graph.launch().expect("replay");
                        comm.check().expect("check after replay");
                        outs.push((download_on(&st, &res, n), download_on(&st, &normed, n)));
                    }
                    Got {
                        sum,
                        residual: res_eager,
                        normed: normed_eager,
                        replays: outs,
                    }
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    });
    let pick = |f: fn(&Got) -> &Vec<u32>| results.iter().map(|g| f(g).clone()).collect::<Vec<_>>();
    assert_ranks(
        "eager all_reduce",
        Dtype::Bf16,
        &pick(|g| &g.sum),
        &eager.sum,
    );
    assert_ranks(
        "eager fused residual",
        Dtype::Bf16,
        &pick(|g| &g.residual),
        &eager.residual_out,
    );
    assert_ranks(
        "eager fused normed",
        Dtype::Bf16,
        &pick(|g| &g.normed),
        &eager.normed,
    );
    for (it, d) in replays.iter().enumerate() {
        let res: Vec<Vec<u32>> = results.iter().map(|x| x.replays[it].0.clone()).collect();
        let nrm: Vec<Vec<u32>> = results.iter().map(|x| x.replays[it].1.clone()).collect();
        assert_ranks(
            &format!("replay {it} residual"),
            Dtype::Bf16,
            &res,
            &d.residual_out,
        );
        assert_ranks(&format!("replay {it} normed"), Dtype::Bf16, &nrm, &d.normed);
    }
    println!(
        "  Comm::from_devices on GPUs {place:?}: eager all_reduce + fused, and the fused call captured per thread, {REPLAYS} replays with new data, bit-exact"
    );
}
