// Included into `kernels::norm` by norm.rs (see there why `include!`).
//
// The fused entries
// (`allreduce_rmsnorm_{one_stage|two_stage|push_ll}_{f32|f16|bf16}_w{N}[_virtual]`):
// a real-rank and a virtual-rank entry per algorithm, element type and
// rank count, each a call of its kernel body.

macro_rules! ll_norm_entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal; )*) => { $(
        /// A real-rank fused push_ll entry: this rank is `p.base.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `p` filled as `allreduce_rmsnorm_ll`
        /// requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm_ll::<$E, $N>(&p, p.base.rank) }
        }
        /// A virtual-rank fused push_ll entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm_ll::<$E, $N>(&p, block_idx_y()) }
        }
    )* };
}

ll_norm_entries! {
    allreduce_rmsnorm_push_ll_f32_w1, allreduce_rmsnorm_push_ll_f32_w1_virtual: F32, 1;
    allreduce_rmsnorm_push_ll_f32_w2, allreduce_rmsnorm_push_ll_f32_w2_virtual: F32, 2;
    allreduce_rmsnorm_push_ll_f32_w3, allreduce_rmsnorm_push_ll_f32_w3_virtual: F32, 3;
    allreduce_rmsnorm_push_ll_f32_w4, allreduce_rmsnorm_push_ll_f32_w4_virtual: F32, 4;
    allreduce_rmsnorm_push_ll_f32_w5, allreduce_rmsnorm_push_ll_f32_w5_virtual: F32, 5;
    allreduce_rmsnorm_push_ll_f32_w6, allreduce_rmsnorm_push_ll_f32_w6_virtual: F32, 6;
    allreduce_rmsnorm_push_ll_f32_w7, allreduce_rmsnorm_push_ll_f32_w7_virtual: F32, 7;
    allreduce_rmsnorm_push_ll_f32_w8, allreduce_rmsnorm_push_ll_f32_w8_virtual: F32, 8;
    allreduce_rmsnorm_push_ll_f16_w1, allreduce_rmsnorm_push_ll_f16_w1_virtual: F16, 1;
    allreduce_rmsnorm_push_ll_f16_w2, allreduce_rmsnorm_push_ll_f16_w2_virtual: F16, 2;
    allreduce_rmsnorm_push_ll_f16_w3, allreduce_rmsnorm_push_ll_f16_w3_virtual: F16, 3;
    allreduce_rmsnorm_push_ll_f16_w4, allreduce_rmsnorm_push_ll_f16_w4_virtual: F16, 4;
    allreduce_rmsnorm_push_ll_f16_w5, allreduce_rmsnorm_push_ll_f16_w5_virtual: F16, 5;
    allreduce_rmsnorm_push_ll_f16_w6, allreduce_rmsnorm_push_ll_f16_w6_virtual: F16, 6;
    allreduce_rmsnorm_push_ll_f16_w7, allreduce_rmsnorm_push_ll_f16_w7_virtual: F16, 7;
    allreduce_rmsnorm_push_ll_f16_w8, allreduce_rmsnorm_push_ll_f16_w8_virtual: F16, 8;
    allreduce_rmsnorm_push_ll_bf16_w1, allreduce_rmsnorm_push_ll_bf16_w1_virtual: Bf16, 1;
    allreduce_rmsnorm_push_ll_bf16_w2, allreduce_rmsnorm_push_ll_bf16_w2_virtual: Bf16, 2;
    allreduce_rmsnorm_push_ll_bf16_w3, allreduce_rmsnorm_push_ll_bf16_w3_virtual: Bf16, 3;
    allreduce_rmsnorm_push_ll_bf16_w4, allreduce_rmsnorm_push_ll_bf16_w4_virtual: Bf16, 4;
    allreduce_rmsnorm_push_ll_bf16_w5, allreduce_rmsnorm_push_ll_bf16_w5_virtual: Bf16, 5;
    allreduce_rmsnorm_push_ll_bf16_w6, allreduce_rmsnorm_push_ll_bf16_w6_virtual: Bf16, 6;
    allreduce_rmsnorm_push_ll_bf16_w7, allreduce_rmsnorm_push_ll_bf16_w7_virtual: Bf16, 7;
    allreduce_rmsnorm_push_ll_bf16_w8, allreduce_rmsnorm_push_ll_bf16_w8_virtual: Bf16, 8;
}

macro_rules! norm_entries {
    ($( $name:ident, $vname:ident: $E:ty, $N:literal, $two:literal; )*) => { $(
        /// A real-rank fused entry: this rank is `p.base.rank`.
        ///
        /// # Safety
        /// Launched by the host under the launch contract of the module
        /// documentation, with `p` filled as `allreduce_rmsnorm` requires.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $name(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm::<$E, $N, $two>(&p, p.base.rank) }
        }
        /// A virtual-rank fused entry: this rank is `blockIdx.y`.
        ///
        /// # Safety
        /// As for the real-rank entry, with `gridDim.y == N` and every
        /// block co-resident.
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $vname(p: NormArgs) {
            // SAFETY: the launch contract is the caller's.
            unsafe { allreduce_rmsnorm::<$E, $N, $two>(&p, block_idx_y()) }
        }
    )* };
}

norm_entries! {
    allreduce_rmsnorm_one_stage_f32_w1, allreduce_rmsnorm_one_stage_f32_w1_virtual: F32, 1, false;
    allreduce_rmsnorm_one_stage_f32_w2, allreduce_rmsnorm_one_stage_f32_w2_virtual: F32, 2, false;
    allreduce_rmsnorm_one_stage_f32_w3, allreduce_rmsnorm_one_stage_f32_w3_virtual: F32, 3, false;
    allreduce_rmsnorm_one_stage_f32_w4, allreduce_rmsnorm_one_stage_f32_w4_virtual: F32, 4, false;
    allreduce_rmsnorm_one_stage_f32_w5, allreduce_rmsnorm_one_stage_f32_w5_virtual: F32, 5, false;
    allreduce_rmsnorm_one_stage_f32_w6, allreduce_rmsnorm_one_stage_f32_w6_virtual: F32, 6, false;
    allreduce_rmsnorm_one_stage_f32_w7, allreduce_rmsnorm_one_stage_f32_w7_virtual: F32, 7, false;
    allreduce_rmsnorm_one_stage_f32_w8, allreduce_rmsnorm_one_stage_f32_w8_virtual: F32, 8, false;
    allreduce_rmsnorm_one_stage_f16_w1, allreduce_rmsnorm_one_stage_f16_w1_virtual: F16, 1, false;
    allreduce_rmsnorm_one_stage_f16_w2, allreduce_rmsnorm_one_stage_f16_w2_virtual: F16, 2, false;
    allreduce_rmsnorm_one_stage_f16_w3, allreduce_rmsnorm_one_stage_f16_w3_virtual: F16, 3, false;
    allreduce_rmsnorm_one_stage_f16_w4, allreduce_rmsnorm_one_stage_f16_w4_virtual: F16, 4, false;
    allreduce_rmsnorm_one_stage_f16_w5, allreduce_rmsnorm_one_stage_f16_w5_virtual: F16, 5, false;
    allreduce_rmsnorm_one_stage_f16_w6, allreduce_rmsnorm_one_stage_f16_w6_virtual: F16, 6, false;
    allreduce_rmsnorm_one_stage_f16_w7, allreduce_rmsnorm_one_stage_f16_w7_virtual: F16, 7, false;
    allreduce_rmsnorm_one_stage_f16_w8, allreduce_rmsnorm_one_stage_f16_w8_virtual: F16, 8, false;
    allreduce_rmsnorm_one_stage_bf16_w1, allreduce_rmsnorm_one_stage_bf16_w1_virtual: Bf16, 1, false;
    allreduce_rmsnorm_one_stage_bf16_w2, allreduce_rmsnorm_one_stage_bf16_w2_virtual: Bf16, 2, false;
    allreduce_rmsnorm_one_stage_bf16_w3, allreduce_rmsnorm_one_stage_bf16_w3_virtual: Bf16, 3, false;
    allreduce_rmsnorm_one_stage_bf16_w4, allreduce_rmsnorm_one_stage_bf16_w4_virtual: Bf16, 4, false;
    allreduce_rmsnorm_one_stage_bf16_w5, allreduce_rmsnorm_one_stage_bf16_w5_virtual: Bf16, 5, false;
    allreduce_rmsnorm_one_stage_bf16_w6, allreduce_rmsnorm_one_stage_bf16_w6_virtual: Bf16, 6, false;
    allreduce_rmsnorm_one_stage_bf16_w7, allreduce_rmsnorm_one_stage_bf16_w7_virtual: Bf16, 7, false;
    allreduce_rmsnorm_one_stage_bf16_w8, allreduce_rmsnorm_one_stage_bf16_w8_virtual: Bf16, 8, false;
    allreduce_rmsnorm_two_stage_f32_w1, allreduce_rmsnorm_two_stage_f32_w1_virtual: F32, 1, true;
    allreduce_rmsnorm_two_stage_f32_w2, allreduce_rmsnorm_two_stage_f32_w2_virtual: F32, 2, true;
    allreduce_rmsnorm_two_stage_f32_w3, allreduce_rmsnorm_two_stage_f32_w3_virtual: F32, 3, true;
    allreduce_rmsnorm_two_stage_f32_w4, allreduce_rmsnorm_two_stage_f32_w4_virtual: F32, 4, true;
    allreduce_rmsnorm_two_stage_f32_w5, allreduce_rmsnorm_two_stage_f32_w5_virtual: F32, 5, true;
    allreduce_rmsnorm_two_stage_f32_w6, allreduce_rmsnorm_two_stage_f32_w6_virtual: F32, 6, true;
    allreduce_rmsnorm_two_stage_f32_w7, allreduce_rmsnorm_two_stage_f32_w7_virtual: F32, 7, true;
    allreduce_rmsnorm_two_stage_f32_w8, allreduce_rmsnorm_two_stage_f32_w8_virtual: F32, 8, true;
    allreduce_rmsnorm_two_stage_f16_w1, allreduce_rmsnorm_two_stage_f16_w1_virtual: F16, 1, true;
    allreduce_rmsnorm_two_stage_f16_w2, allreduce_rmsnorm_two_stage_f16_w2_virtual: F16, 2, true;
    allreduce_rmsnorm_two_stage_f16_w3, allreduce_rmsnorm_two_stage_f16_w3_virtual: F16, 3, true;
    allreduce_rmsnorm_two_stage_f16_w4, allreduce_rmsnorm_two_stage_f16_w4_virtual: F16, 4, true;
    allreduce_rmsnorm_two_stage_f16_w5, allreduce_rmsnorm_two_stage_f16_w5_virtual: F16, 5, true;
    allreduce_rmsnorm_two_stage_f16_w6, allreduce_rmsnorm_two_stage_f16_w6_virtual: F16, 6, true;
    allreduce_rmsnorm_two_stage_f16_w7, allreduce_rmsnorm_two_stage_f16_w7_virtual: F16, 7, true;
    allreduce_rmsnorm_two_stage_f16_w8, allreduce_rmsnorm_two_stage_f16_w8_virtual: F16, 8, true;
    allreduce_rmsnorm_two_stage_bf16_w1, allreduce_rmsnorm_two_stage_bf16_w1_virtual: Bf16, 1, true;
    allreduce_rmsnorm_two_stage_bf16_w2, allreduce_rmsnorm_two_stage_bf16_w2_virtual: Bf16, 2, true;
    allreduce_rmsnorm_two_stage_bf16_w3, allreduce_rmsnorm_two_stage_bf16_w3_virtual: Bf16, 3, true;
    allreduce_rmsnorm_two_stage_bf16_w4, allreduce_rmsnorm_two_stage_bf16_w4_virtual: Bf16, 4, true;
    allreduce_rmsnorm_two_stage_bf16_w5, allreduce_rmsnorm_two_stage_bf16_w5_virtual: Bf16, 5, true;
    allreduce_rmsnorm_two_stage_bf16_w6, allreduce_rmsnorm_two_stage_bf16_w6_virtual: Bf16, 6, true;
    allreduce_rmsnorm_two_stage_bf16_w7, allreduce_rmsnorm_two_stage_bf16_w7_virtual: Bf16, 7, true;
    allreduce_rmsnorm_two_stage_bf16_w8, allreduce_rmsnorm_two_stage_bf16_w8_virtual: Bf16, 8, true;
}
