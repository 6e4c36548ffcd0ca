//! Candle ops over [`Comm`] (feature `candle`, off by default): the shape
//! mistral.rs uses for its `SumAllReduce` (a `CustomOp1` over
//! `cudarc::nccl::Comm`), on this crate's communicator, plus the fused
//! allreduce + residual add + RMSNorm.
//!
//! ```ignore
//! // was: mistral.rs's SumAllReduce over cudarc::nccl::Comm
//! let comm = Arc::new(Comm::from_rank(device.cuda_stream(), rank, world, id)?);
//! let sum = SumAllReduce::new(&comm);
//! let y = sum.sum_all_reduce(&partial)?;                       // CustomOp1
//! let fused = AllReduceAddRmsNorm::new(&comm, 1e-6);
//! let (residual, normed) = fused.apply(&partial, &residual, &gamma)?; // CustomOp3
//! ```
//!
//! Build the communicator on the candle device's own stream
//! (`CudaDevice::cuda_stream`), so the ops are ordered with the rest of the
//! model's work. Tensors must be contiguous (a typed candle error says so
//! otherwise). `SumAllReduce` takes bf16, f16 and f32 (the kernels) and, where
//! the communicator has its NCCL fallback, f64, u8, u32, i32 and i64; the
//! fused op takes bf16, f16 and f32. Both run on CUDA only (their CPU forms
//! are a candle error). The ops have no backward pass.
//!
//! Not built on machines without the CUDA toolkit: candle-core's `cuda`
//! feature compiles candle-kernels with nvcc (see README).

use crate::comm::{Comm, CommElement, ReduceOp};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};
use cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use std::sync::Arc;

/// A candle error from this crate's.
fn err(e: crate::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The contiguous elements of `storage` under `layout`, as a view.
fn contiguous<'a, T: CudaDType>(
    op: &str,
    what: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::msg(format!(
            "{op}: {what} is not contiguous: call .contiguous() on it first"
        ))
    })?;
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// The allreduce of a tensor over the ranks of a [`Comm`], as a candle
/// `CustomOp1` (mistral.rs's `AllReduce`): every rank applies it to its
/// tensor of the same shape and gets the sum.
#[derive(Clone, Debug)]
pub struct AllReduce {
    comm: Arc<Comm>,
}

impl AllReduce {
    pub fn new(comm: &Arc<Comm>) -> Self {
        AllReduce { comm: comm.clone() }
    }

    fn reduce<T: CommElement + CudaDType + DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let input = contiguous::<T>("AllReduce", "the tensor", s, l)?;
        let dev = s.device().clone();
        // SAFETY: every element is written by the allreduce before the
        // buffer is read (a failed call returns the error, not the buffer).
        let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(input.len()) }?;
        self.comm
            .all_reduce(&input, &mut out, &ReduceOp::Sum)
            .map_err(err)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        "p2p-allreduce-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("AllReduce runs on CUDA tensors only (p2p-allreduce's kernels)")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match s.dtype() {
            DType::BF16 => self.reduce::<half::bf16>(s, l)?,
            DType::F16 => self.reduce::<half::f16>(s, l)?,
            DType::F32 => self.reduce::<f32>(s, l)?,
            DType::F64 => self.reduce::<f64>(s, l)?,
            DType::U8 => self.reduce::<u8>(s, l)?,
            DType::U32 => self.reduce::<u32>(s, l)?,
            DType::I32 => self.reduce::<i32>(s, l)?,
            DType::I64 => self.reduce::<i64>(s, l)?,
            other => candle_core::bail!(
                "AllReduce: no allreduce of {other:?} tensors (the kernels sum bf16, f16 and f32; NCCL takes f64, u8, u32, i32, i64)"
            ),
        };
        Ok((out, l.shape().clone()))
    }
}

/// mistral.rs's `SumAllReduce` on [`Comm`]: `sum_all_reduce(&x)` is the
/// sum of `x` over the ranks.
#[derive(Clone, Debug)]
pub struct SumAllReduce {
    all_reduce: AllReduce,
}

impl SumAllReduce {
    pub fn new(comm: &Arc<Comm>) -> Self {
        SumAllReduce {
            all_reduce: AllReduce::new(comm),
        }
    }

    pub fn sum_all_reduce(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        xs.apply_op1_no_bwd(&self.all_reduce)
    }
}

/// The fused allreduce + residual add + RMSNorm of a tensor-parallel
/// block, as a candle `CustomOp3` over `(x, residual, gamma)`: `x` (rows x
/// hidden, the rank's partial) is summed over the ranks, the residual
/// becomes `sum + residual`, and the output its RMSNorm times `gamma`; one
/// kernel ([`Comm::all_reduce_add_rms_norm`], bits of docs/numerics.md).
/// The op's output holds both, stacked (`[2, ..x's shape]`);
/// [`AllReduceAddRmsNorm::apply`] returns them as two tensors.
#[derive(Clone, Debug)]
pub struct AllReduceAddRmsNorm {
    comm: Arc<Comm>,
    eps: f32,
}

impl AllReduceAddRmsNorm {
    pub fn new(comm: &Arc<Comm>, eps: f32) -> Self {
        AllReduceAddRmsNorm {
            comm: comm.clone(),
            eps,
        }
    }

    /// `(residual + sum over ranks of x, RMSNorm(that) * gamma)`.
    pub fn apply(
        &self,
        x: &Tensor,
        residual: &Tensor,
        gamma: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let both = x.apply_op3_no_bwd(residual, gamma, self)?;
        Ok((both.get(0)?, both.get(1)?))
    }

    fn fused<T: crate::DeviceElement + CudaDType>(
        &self,
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
    ) -> candle_core::Result<CudaStorage> {
        const OP: &str = "AllReduceAddRmsNorm";
        let x = contiguous::<T>(OP, "x", s1, l1)?;
        let residual = contiguous::<T>(OP, "the residual", s2, l2)?;
        let gamma = contiguous::<T>(OP, "gamma", s3, l3)?;
        if l2.shape() != l1.shape() {
            candle_core::bail!(
                "{OP}: the residual's shape {:?} is not x's {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        let n = x.len();
        let dev = s1.device().clone();
        // Both outputs in one buffer: the residual (updated in place by
        // the kernel, so it starts as a copy), then the normed rows.
        // SAFETY: the first half is written by the copy and the second by
        // the fused call before the buffer is read.
        let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * n) }?;
        {
            let (mut res_out, mut normed) = out.split_at_mut(n);
            dev.memcpy_dtod(&residual, &mut res_out)?;
            self.comm
                .all_reduce_add_rms_norm(&x, &mut res_out, &gamma, self.eps, &mut normed)
                .map_err(err)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp3 for AllReduceAddRmsNorm {
    fn name(&self) -> &'static str {
        "p2p-allreduce-all-reduce-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "AllReduceAddRmsNorm runs on CUDA tensors only (p2p-allreduce's kernels)"
        )
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let args = ((s1, l1), (s2, l2), (s3, l3));
        let out = match s1.dtype() {
            DType::BF16 => self.fused::<half::bf16>(args.0, args.1, args.2)?,
            DType::F16 => self.fused::<half::f16>(args.0, args.1, args.2)?,
            DType::F32 => self.fused::<f32>(args.0, args.1, args.2)?,
            other => candle_core::bail!(
                "AllReduceAddRmsNorm: {other:?} tensors are not served (the fused kernels take bf16, f16 and f32)"
            ),
        };
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
    }
}
