//! The data of a check and the oracle: fresh adversarial inputs per seed,
//! the fused call's extra buffers, the CPU reference's outputs, and the
//! bit-for-bit comparison.

use super::*;

/// Every rank's inputs of one check (f32 bits).
pub(super) fn inputs(cfg: &Cfg, world: usize, seed: u64) -> Vec<Vec<u32>> {
    values::adversarial_inputs(Dtype::F32, world, cfg.count(), seed, true)
}

/// The fused call's residuals and gammas of one check.
pub(super) fn fused_extra(rows: usize, world: usize, seed: u64) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let res = values::adversarial_inputs(Dtype::F32, world, rows * HIDDEN, seed ^ 0x9e37, false);
    let gam = values::adversarial_inputs(Dtype::F32, world, HIDDEN, seed ^ 0x7f4a, false);
    (res, gam)
}

/// The oracle of `per_graph` fused calls in a row on rank `r` (the
/// residual updated in place by each): every call's normed rows, and the
/// residual after the last.
pub(super) fn fused_want(
    x: &[Vec<u32>],
    res: &[u32],
    gam: &[u32],
    per_graph: usize,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    let refs: Vec<&[u32]> = x.iter().map(|v| v.as_slice()).collect();
    let mut residual = res.to_vec();
    let mut normed = Vec::with_capacity(per_graph);
    for _ in 0..per_graph {
        let (r, n) = reference::add_rmsnorm_bits(Dtype::F32, &refs, &residual, gam, EPS);
        residual = r;
        normed.push(n);
    }
    (normed, residual)
}

/// Compares one rank's outputs (`got`: `per_graph` calls back to back)
/// with `want` (one per call), into (elements, wrong, first).
pub(super) fn compare_calls(
    rank: usize,
    got: &[u32],
    want: &[&[u32]],
    acc: &mut (u64, u64, Option<String>),
) {
    let n = want.first().map_or(0, |w| w.len());
    for (j, w) in want.iter().enumerate() {
        let g = &got[j * n..(j + 1) * n];
        let mut wrong = 0usize;
        let mut first = None;
        validate::compare_rank(Dtype::F32, rank, g, w, &mut wrong, &mut first);
        acc.0 += n as u64;
        acc.1 += wrong as u64;
        if acc.2.is_none() {
            acc.2 = first.map(|m| {
                format!(
                    "call {j} of the graph, element {}: got {} want {}",
                    m.index,
                    reference::fmt_bits(Dtype::F32, m.got),
                    reference::fmt_bits(Dtype::F32, m.want)
                )
            });
        }
    }
}

pub(super) fn poison_words(n: usize) -> Vec<u32> {
    vec![validate::poison_bits(Dtype::F32); n]
}
