// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The per-pack arithmetic of a fused row ([`add_pack`]: the residual add
// and its squares in lane order; [`normed_pack`]: `(residual_out * inv) *
// gamma`) and the row by any shape ([`norm_row`], the two-pass path
// through memory). The register path (reg_rows.rs) uses the same
// functions, so both paths give the same bits.

/// Residual add of one pack: returns the `residual_out` pack and its
/// squares added in lane order onto `acc` (`first`: the chunk's first
/// pack). The caller stores the pack.
#[inline(always)]
fn add_pack<E: Element>(sum: Pack, res: Pack, acc: f32, first: bool) -> (Pack, f32) {
    let (sum, res) = (E::unpack(sum), E::unpack(res));
    let mut ro = [0f32; 8];
    let mut l = 0;
    while l < E::LANES {
        ro[l] = sum[l] + res[l];
        l += 1;
    }
    let rop = E::pack(&ro);
    let q = E::unpack(rop);
    let mut acc = acc;
    let mut l = 0;
    while l < E::LANES {
        let sq = q[l] * q[l];
        acc = if first && l == 0 { sq } else { acc + sq };
        l += 1;
    }
    (rop, acc)
}

/// One pack of the normed row: `(residual_out * inv) * gamma`, lane by lane.
#[inline(always)]
fn normed_pack<E: Element>(q: Pack, g: Pack, inv: f32) -> Pack {
    let (q, g) = (E::unpack(q), E::unpack(g));
    let mut n = [0f32; 8];
    let mut l = 0;
    while l < E::LANES {
        n[l] = (q[l] * inv) * g[l];
        l += 1;
    }
    E::pack(&n)
}

/// Row `row` of the fused operation, by every thread of the block: the
/// rounded sums (from `sums`, [`RowSums`]), the residual add, the sum of squares (chunk partials in shared memory `sh`,
/// then the pairwise tree), and the normed row into `res_out` and `normed`.
///
/// # Safety
/// Every pointer is valid for the row's elements (the sums' sources,
/// `res_in`, `res_out`, `normed`; `gamma` for `hidden`); `sh` is the
/// block's shared array of at least `ceil(hidden / 8)` words; `hidden <=
/// NORM_MAX_HIDDEN`; every thread of the block calls it (it contains
/// `bar.sync`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn norm_row<E: Element, S: RowSums>(
    sums: &mut S,
    res_in: u64,
    res_out: u64,
    gamma: u64,
    normed: u64,
    row: u64,
    hidden: u64,
    eps: f32,
    sh: SharedWords,
) {
    let tid = thread_idx_x() as u64;
    let nthreads = block_dim_x() as u64;
    const CH: u64 = NORM_CHUNK as u64;
    let chunks = hidden.div_ceil(CH);
    let base = row * hidden;
    // Whole 16-byte packs when every chunk is whole: rows then start at
    // multiples of 8 elements, so packs stay aligned.
    let packed = hidden % CH == 0;
    let lanes = E::LANES as u64;
    let per_chunk = CH / lanes;
    let res_p = res_in as *const Pack;
    // Pass 1: sums, residual add, squares of each chunk in column order.
    let mut k = tid;
    // Two chunks per iteration where the registers allow (one pack per
    // chunk, or few ranks): both chunks' loads are in flight before the
    // first add, one remote round trip instead of two.
    if packed && S::pairs(per_chunk) {
        while k + nthreads < chunks {
            let (ka, kb) = (k, k + nthreads);
            let mut acc_a = 0f32;
            let mut acc_b = 0f32;
            let mut m = 0;
            while m < per_chunk {
                let pa = (base + ka * CH) / lanes + m;
                let pb = (base + kb * CH) / lanes + m;
                // SAFETY: packs pa, pb lie inside the row of every buffer.
                // The residuals first: their loads are then in flight while
                // the sums arrive (push_ll: while the lines are waited for).
                unsafe {
                    let (ra, rb) = (
                        ld_pack(res_p.add(pa as usize)),
                        ld_pack(res_p.add(pb as usize)),
                    );
                    let (sa, sb) = (sums.pack::<E>(pa), sums.pack::<E>(pb));
                    let (qa, qb);
                    (qa, acc_a) = add_pack::<E>(sa, ra, acc_a, m == 0);
                    (qb, acc_b) = add_pack::<E>(sb, rb, acc_b, m == 0);
                    st_pack((res_out as *mut Pack).add(pa as usize), qa);
                    st_pack((res_out as *mut Pack).add(pb as usize), qb);
                }
                m += 1;
            }
            // SAFETY: ka < kb < chunks <= NORM_MAX_CHUNKS words of `sh`.
            unsafe {
                sh.store(ka as u32, acc_a);
                sh.store(kb as u32, acc_b);
            }
            k += 2 * nthreads;
        }
    }
    while k < chunks {
        let c0 = k * CH;
        let mut acc = 0f32;
        if packed {
            let mut m = 0;
            while m < per_chunk {
                let pi = (base + c0) / lanes + m;
                // SAFETY: pack pi lies inside the row of every buffer.
                // The residual first, as above.
                unsafe {
                    let r = ld_pack(res_p.add(pi as usize));
                    let s = sums.pack::<E>(pi);
                    let q;
                    (q, acc) = add_pack::<E>(s, r, acc, m == 0);
                    st_pack((res_out as *mut Pack).add(pi as usize), q);
                }
                m += 1;
            }
        } else {
            let c1 = if c0 + CH < hidden { c0 + CH } else { hidden };
            let mut c = c0;
            while c < c1 {
                let idx = base + c;
                // SAFETY: idx is inside the row of every buffer (contract).
                let q = unsafe {
                    let sum = sums.elem::<E>(idx);
                    let ro = E::from_f32(sum + E::to_f32(ld_elem::<E>(res_in, idx)));
                    st_elem::<E>(res_out, idx, ro);
                    E::to_f32(ro)
                };
                let sq = q * q;
                acc = if c == c0 { sq } else { acc + sq };
                c += 1;
            }
        }
        // SAFETY: k < chunks <= NORM_MAX_CHUNKS words of `sh`.
        unsafe { sh.store(k as u32, acc) };
        k += nthreads;
    }
    sync_threads();
    // SAFETY: `sh` holds the `chunks` partials; every thread of the block.
    let total = unsafe { tree_sum(sh, chunks as u32) };
    let inv = 1.0 / sqrt_rn(total / hidden as f32 + eps);
    // Pass 2: the normed row, from the residual out this thread wrote.
    let mut k = tid;
    while k < chunks {
        let c0 = k * CH;
        if packed {
            let mut m = 0;
            while m < per_chunk {
                let pi = (base + c0) / lanes + m;
                // SAFETY: as in pass 1; gamma pack c0 / lanes + m < hidden /
                // lanes.
                unsafe {
                    let qp = ld_pack((res_out as *const Pack).add(pi as usize));
                    let gp = ld_pack((gamma as *const Pack).add((c0 / lanes + m) as usize));
                    st_pack_streaming(
                        (normed as *mut Pack).add(pi as usize),
                        normed_pack::<E>(qp, gp, inv),
                    );
                }
                m += 1;
            }
        } else {
            let mut c = c0;
            while c < c0 + CH && c < hidden {
                let idx = base + c;
                // SAFETY: as in pass 1; gamma holds `hidden` elements.
                unsafe {
                    let q = E::to_f32(ld_elem::<E>(res_out, idx));
                    let g = E::to_f32(ld_elem::<E>(gamma, c));
                    st_elem::<E>(normed, idx, E::from_f32((q * inv) * g));
                }
                c += 1;
            }
        }
        k += nthreads;
    }
    // The next row reuses `sh`.
    sync_threads();
}
