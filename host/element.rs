//! The element types the kernels reduce.

use crate::abi::Dtype;

/// Element types with kernels: `f32`, `half::f16`, `half::bf16`.
pub trait DeviceElement:
    cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + crate::driver::PlainData
    + Copy
    + 'static
{
    const DTYPE: Dtype;
}
impl DeviceElement for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl DeviceElement for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}
impl DeviceElement for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}

/// Element types that both the kernels and (with the `nccl` feature) NCCL
/// take: every [`DeviceElement`].
pub trait RoutedElement: DeviceElement {}
impl<T: DeviceElement> RoutedElement for T {}
