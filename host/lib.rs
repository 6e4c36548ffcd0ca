//! p2p-allreduce: deterministic allreduce kernels written in Rust, compiled
//! to PTX, with a host library on cudarc.
//!
//! Two ways in:
//! - as a **kernel provider**: [`ptx`] holds the PTX of every architecture
//!   built (`&'static str`) and a typed index of the entry points;
//!   [`abi`] the `#[repr(C)]` structs they take;
//! - through the **host API**: [`VirtualGroup`] (N ranks on one GPU),
//!   [`PeerGroup`] (one process, one context per rank), [`ProcessGroup`]
//!   (one process per rank over CUDA IPC, set up through an [`Exchange`]);
//! - through [`comm::Comm`], shaped like `cudarc::nccl::Comm` (one `use`
//!   line to change in an engine written against cudarc's NCCL), with the
//!   fused allreduce + residual add + RMSNorm beside it.
//!
//! ```no_run
//! use p2p_allreduce::{driver, AlgoChoice, Config, VirtualGroup};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let ctx = driver::open_device(0)?; // Error::NoDriver on a machine without libcuda
//! let stream = ctx.new_stream()?;
//! let group = VirtualGroup::new(&ctx, 2, Config::default())?;
//! let a = stream.clone_htod(&[1.0f32, 2.0, 3.0])?;
//! let b = stream.clone_htod(&[10.0f32, 20.0, 30.0])?;
//! let mut outs = vec![stream.alloc_zeros::<f32>(3)?, stream.alloc_zeros::<f32>(3)?];
//! group.allreduce(&stream, &[&a, &b], &mut outs, AlgoChoice::Auto)?;
//! group.check(&stream)?; // waits; a peer that never arrived becomes Error::PeerTimeout
//! assert_eq!(stream.clone_dtoh(&outs[1])?, vec![11.0, 22.0, 33.0]);
//! # Ok(()) }
//! ```
//!
//! Every result is bit-identical to [`reference`](mod@reference), the CPU
//! oracle of the determinism contract, on every rank and for both algorithms.
#![deny(unsafe_op_in_unsafe_fn)]

/// The kernel crate's pure pieces (element types, reduction, partitioning,
/// barrier protocol), compiled for the host.
pub use p2p_allreduce_device as device;
pub use p2p_allreduce_device::abi;
pub use p2p_allreduce_device::abi::{Algorithm, Dtype};
pub use p2p_allreduce_device::ll;

/// The cudarc this crate is built against (its types are in every
/// signature): use it instead of guessing the matching version.
pub use cudarc;

pub mod call_tag;
#[cfg(feature = "candle")]
pub mod candle;
mod checks;
mod choice;
mod collective;
pub mod comm;
pub mod config;
pub mod driver;
pub mod element;
pub mod error;
pub mod exchange;
pub mod fused;
pub mod ipc;
mod launch;
mod machine;
#[cfg(feature = "testkit")]
pub mod measure;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod peer_group;
mod peer_tables;
pub mod plan;
pub mod process_group;
// build.rs uses the writing half (container, PTX index, hash).
#[allow(dead_code)]
mod image_format;
pub mod ptx;
pub mod ptxas;
pub mod reference;
pub mod registered;
pub mod thresholds;
pub mod topology;
#[cfg(feature = "testkit")]
pub mod validate;
pub mod virtual_group;

pub use element::{DeviceElement, RoutedElement};
pub use error::{Error, Result};
pub use exchange::{DirExchange, Exchange, InProcessExchange};
pub use peer_group::{PeerGroup, Route};
pub use plan::{AlgoChoice, Config, Link, Thresholds};
pub use process_group::ProcessGroup;
pub use registered::RegisteredBuffers;
pub use virtual_group::VirtualGroup;

/// The README's code blocks, compiled (and run where they need no GPU) as
/// doc tests, so the README's API section cannot drift from the code.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
