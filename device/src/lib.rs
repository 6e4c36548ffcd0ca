//! Allreduce kernels for p2p-allreduce, written in Rust for the GPU.
//!
//! Built twice:
//! - for `nvptx64-nvidia-cuda` by the parent crate's `build.rs` (one PTX
//!   file per architecture), where [`cuda`] and [`kernels`] exist;
//! - for the host, as a normal dependency of the host library, which uses the
//!   shared ABI ([`abi`]), the element types ([`numeric`]), the reduction and
//!   partition functions ([`reduce`]) the barrier protocol ([`barrier`]), the flag-in-data protocol ([`ll`])
//!   and the fused RMSNorm's tree order ([`norm_tree`]).
#![no_std]
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, asm_experimental_arch, stdarch_nvptx)
)]

pub mod abi;
pub mod barrier;
pub mod ll;
pub mod norm_tree;
pub mod numeric;
pub mod reduce;

#[cfg(target_arch = "nvptx64")]
pub mod cuda;
#[cfg(target_arch = "nvptx64")]
pub mod kernels;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    cuda::trap()
}
