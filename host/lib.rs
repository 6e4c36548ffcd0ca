//! p2p-allreduce: deterministic allreduce kernels written in Rust, compiled
//! to PTX, with a host library on cudarc.
//!
//! - [`ptx`]: the embedded PTX modules and the entry-point index (kernel
//!   provider interface).
//! - [`abi`]: the `#[repr(C)]` structs shared with the kernels.
//! - [`reference`]: the CPU oracle of the determinism contract.
#![deny(unsafe_op_in_unsafe_fn)]

/// The kernel crate's pure pieces (element types, reduction, partitioning,
/// barrier protocol), compiled for the host.
pub use p2p_allreduce_device as device;
pub use p2p_allreduce_device::abi;
pub use p2p_allreduce_device::abi::{Algorithm, Dtype};

pub mod driver;
pub mod error;
pub mod group;
pub mod plan;
pub mod ptx;
pub mod ptxas;
pub mod reference;

pub use error::{Error, Result};
pub use group::{DeviceElement, PeerGroup, RegisteredBuffers, VirtualGroup};
pub use plan::{AlgoChoice, Config, Link, Thresholds};
pub mod exchange;
pub mod ipc;
pub mod measure;

pub use exchange::{DirExchange, Exchange, InProcessExchange};
pub use ipc::ProcessGroup;
pub mod topology;
pub mod validate;
