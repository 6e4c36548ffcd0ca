//! CPU throughput of the reference reduction (the oracle every GPU result is
//! checked against) and of the kernels' own pack reduction compiled for the
//! host. Needs no GPU: `cargo bench --bench cpu_reference`.
//!
//! The reference numbers bound how fast `p2p-allreduce check` and the
//! `#wrong` column of `p2p-allreduce bench` can validate large messages.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::device::numeric::{Bf16, Element, Pack, F32};
use p2p_allreduce::device::reduce::reduce_pack_dyn;
use p2p_allreduce::reference::{self, values};
use std::hint::black_box;

/// Elements per rank.
const LEN: usize = 1 << 20;
const WORLDS: [usize; 2] = [2, 8];

fn reference_allreduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("reference::allreduce_bits");
    g.sample_size(10);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for world in WORLDS {
            let inputs = values::adversarial_inputs(dtype, world, LEN, 7, false);
            let refs = reference::as_slices(&inputs);
            // Bytes of input read per allreduce, as the GPU benchmark counts them.
            g.throughput(Throughput::Bytes((LEN * world * dtype.size()) as u64));
            g.bench_with_input(
                BenchmarkId::new(dtype.name(), format!("world{world}")),
                &refs,
                |b, refs| b.iter(|| reference::allreduce_bits(dtype, black_box(refs))),
            );
        }
    }
    g.finish();
}

/// Packs of `world` ranks laid out rank-major, as the kernels read them.
fn packs_for(dtype: Dtype, world: usize) -> Vec<Vec<Pack>> {
    let lanes = dtype.lanes();
    let inputs = values::adversarial_inputs(dtype, world, LEN, 11, false);
    inputs
        .iter()
        .map(|rank| {
            rank.chunks_exact(lanes)
                .map(|c| {
                    let mut p: Pack = [0; 4];
                    for (l, &bits) in c.iter().enumerate() {
                        // 32-bit lanes fill one word each; 16-bit lanes two per word.
                        if lanes == 4 {
                            p[l] = bits;
                        } else {
                            p[l / 2] |= bits << (16 * (l % 2));
                        }
                    }
                    p
                })
                .collect()
        })
        .collect()
}

fn reduce_all<E: Element>(ranks: &[Vec<Pack>], scratch: &mut Vec<Pack>, out: &mut Vec<Pack>) {
    out.clear();
    for i in 0..ranks[0].len() {
        scratch.clear();
        scratch.extend(ranks.iter().map(|r| r[i]));
        out.push(reduce_pack_dyn::<E>(scratch));
    }
}

fn device_reduce(c: &mut Criterion) {
    let mut g = c.benchmark_group("device::reduce::reduce_pack_dyn");
    g.sample_size(10);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for world in WORLDS {
            let ranks = packs_for(dtype, world);
            let mut scratch = Vec::with_capacity(world);
            let mut out = Vec::with_capacity(ranks[0].len());
            g.throughput(Throughput::Bytes((LEN * world * dtype.size()) as u64));
            g.bench_function(
                BenchmarkId::new(dtype.name(), format!("world{world}")),
                |b| {
                    b.iter(|| {
                        match dtype {
                            Dtype::Bf16 => {
                                reduce_all::<Bf16>(black_box(&ranks), &mut scratch, &mut out)
                            }
                            _ => reduce_all::<F32>(black_box(&ranks), &mut scratch, &mut out),
                        }
                        black_box(out.len())
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, reference_allreduce, device_reduce);
criterion_main!(benches);
