//! How GPUs reach each other: the link between two devices, as
//! [`PeerGroup::new`](crate::PeerGroup::new) and `p2p-allreduce info` see it.
//!
//! The link is read from two driver queries: `cuDeviceCanAccessPeer` (is
//! there a P2P path at all) and `cuDeviceGetP2PAttribute(NATIVE_ATOMIC_SUPPORTED)`.
//! Native peer atomics are an NVLink property (PCIe P2P lacks them), so a
//! pair with them is taken as NVLink and one without as PCIe.

use crate::driver;
use crate::error::Result;
use crate::plan::Link;
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

/// The link between the devices of `a` and `b`: `Some(Link::SameDevice)` for
/// one device, `None` when `a` cannot access `b` as a peer (no P2P path),
/// else NVLink or PCIe. Queries only; peer access is not enabled.
pub fn link_between(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<Option<Link>> {
    link_between_devices(a.cu_device(), b.cu_device())
}

/// [`link_between`] on raw device handles (from `cuDeviceGet`).
pub fn link_between_devices(a: sys::CUdevice, b: sys::CUdevice) -> Result<Option<Link>> {
    if a == b {
        return Ok(Some(Link::SameDevice));
    }
    if !driver::can_access_peer(a, b)? {
        return Ok(None);
    }
    Ok(Some(if driver::p2p_native_atomics(a, b)? {
        Link::NvLink
    } else {
        Link::Pcie
    }))
}

/// The slower of two links, for a group whose pairs have different links:
/// PCIe if either is PCIe, else NVLink if either is NVLink, else same device.
pub fn slowest(a: Link, b: Link) -> Link {
    match (a, b) {
        (Link::Pcie, _) | (_, Link::Pcie) => Link::Pcie,
        (Link::NvLink, _) | (_, Link::NvLink) => Link::NvLink,
        _ => Link::SameDevice,
    }
}

/// A short name for tables: "same", "NVLink", "PCIe", or "none" for no P2P path.
pub fn link_name(link: Option<Link>) -> &'static str {
    match link {
        Some(Link::SameDevice) => "same",
        Some(Link::NvLink) => "NVLink",
        Some(Link::Pcie) => "PCIe",
        None => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_link_wins() {
        use Link::*;
        assert_eq!(slowest(SameDevice, SameDevice), SameDevice);
        assert_eq!(slowest(SameDevice, NvLink), NvLink);
        assert_eq!(slowest(NvLink, SameDevice), NvLink);
        assert_eq!(slowest(NvLink, Pcie), Pcie);
        assert_eq!(slowest(Pcie, SameDevice), Pcie);
        assert_eq!(link_name(None), "none");
        assert_eq!(link_name(Some(NvLink)), "NVLink");
    }
}
