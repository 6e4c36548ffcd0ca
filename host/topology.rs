//! How GPUs reach each other: the link between two devices, as
//! [`PeerGroup::new`](crate::PeerGroup::new) and `p2p-allreduce info` see it.
//!
//! The link is read from two driver queries: `cuDeviceCanAccessPeer` (is
//! there a P2P path at all) and `cuDeviceGetP2PAttribute(NATIVE_ATOMIC_SUPPORTED)`.
//! Native peer atomics are an NVLink property (PCIe P2P lacks them), so a
//! pair with them is taken as NVLink and one without as PCIe.
//!
//! Where PCIe traffic goes is read from sysfs ([`PciPlace`]): the chain of
//! bridges from the root complex down to each GPU and its NUMA node. GPUs
//! that share a bridge below the root port sit behind one PCIe switch;
//! [`islands`] groups them (e.g. 4 + 4 on an 8-GPU box with two
//! switches), which `p2p-allreduce info` shows.

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

/// Where a GPU sits in the PCIe tree (from `/sys/bus/pci/devices`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciPlace {
    /// `dddd:bb:dd.f`, lower case.
    pub bus_id: String,
    /// The host bridge (root complex), e.g. `pci0000:00`.
    pub root: String,
    /// The bridges from the root port down to the GPU's parent, e.g.
    /// `["0000:00:01.0", "0000:01:00.0", "0000:02:08.0"]`.
    pub bridges: Vec<String>,
    /// The NUMA node the kernel reports (`None`: unknown or -1).
    pub numa: Option<u32>,
}

/// How close two GPUs are on PCIe: what their traffic shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PciAffinity {
    /// A bridge below the root port: the same PCIe switch.
    SameSwitch,
    /// The same root complex, through its root ports.
    SameRoot,
    /// Different root complexes of one NUMA node.
    SameNuma,
    /// Across sockets (the inter-socket link).
    CrossNuma,
}

/// The driver's bus id (`0000:3B:00.0`, or with an 8-digit domain) in
/// sysfs form (`0000:3b:00.0`).
pub fn sysfs_bus_id(driver_id: &str) -> String {
    let id = driver_id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

/// The place of the PCI device `bus_id` (sysfs form) under `sysfs` (the
/// `/sys` directory; a parameter for tests), or `None` if it is not there.
pub fn pci_place_in(sysfs: &std::path::Path, bus_id: &str) -> Option<PciPlace> {
    let dev = sysfs.join("bus/pci/devices").join(bus_id);
    let real = std::fs::canonicalize(&dev).ok()?;
    // .../devices/pci0000:00/0000:00:01.0/.../<bus_id>
    let parts: Vec<String> = real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let root_at = parts.iter().position(|p| p.starts_with("pci"))?;
    let bridges = parts[root_at + 1..parts.len().saturating_sub(1)].to_vec();
    let numa = std::fs::read_to_string(dev.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    Some(PciPlace {
        bus_id: bus_id.to_string(),
        root: parts[root_at].clone(),
        bridges,
        numa,
    })
}

/// [`pci_place_in`] under `/sys`.
pub fn pci_place(bus_id: &str) -> Option<PciPlace> {
    pci_place_in(std::path::Path::new("/sys"), &sysfs_bus_id(bus_id))
}

/// What the traffic between `a` and `b` shares.
pub fn pci_affinity(a: &PciPlace, b: &PciPlace) -> PciAffinity {
    let common = a
        .bridges
        .iter()
        .zip(&b.bridges)
        .take_while(|(x, y)| x == y)
        .count();
    if a.root == b.root && common >= 2 {
        // Below the shared root port there is a shared bridge: a switch.
        PciAffinity::SameSwitch
    } else if a.root == b.root {
        PciAffinity::SameRoot
    } else if a.numa.is_some() && a.numa == b.numa {
        PciAffinity::SameNuma
    } else {
        PciAffinity::CrossNuma
    }
}

/// The GPUs (indices into `places`) grouped into islands: GPUs behind one
/// switch together; where no switch is shared, by root complex. Islands
/// are listed by their first GPU; each is in index order.
pub fn islands(places: &[PciPlace]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, p) in places.iter().enumerate() {
        let home = out.iter_mut().find(|isl| {
            let q = &places[isl[0]];
            let switch = places
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && pci_affinity(p, o) == PciAffinity::SameSwitch);
            if switch {
                pci_affinity(p, q) == PciAffinity::SameSwitch
            } else {
                pci_affinity(p, q) <= PciAffinity::SameRoot
            }
        });
        match home {
            Some(isl) => isl.push(i),
            None => out.push(vec![i]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/sys` with GPUs at the given bridge paths.
    fn fake_sysfs(gpus: &[(&str, &str, i32)]) -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "p2p-sysfs-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let devices = root.join("bus/pci/devices");
        std::fs::create_dir_all(&devices).expect("mkdir");
        for (id, path, numa) in gpus {
            let real = root.join("devices").join(path).join(id);
            std::fs::create_dir_all(&real).expect("mkdir");
            std::fs::write(real.join("numa_node"), format!("{numa}\n")).expect("write");
            std::os::unix::fs::symlink(&real, devices.join(id)).expect("symlink");
        }
        root
    }

    #[test]
    fn places_and_islands_from_sysfs() {
        // Two switches under root complex 0 (NUMA 0) and one GPU on its own
        // root port of root complex 1 (NUMA 1).
        let sw_a = "pci0000:00/0000:00:01.0/0000:01:00.0";
        let sw_b = "pci0000:00/0000:00:03.0/0000:11:00.0";
        let root = fake_sysfs(&[
            ("0000:02:00.0", &format!("{sw_a}/0000:02:08.0")[..], 0),
            ("0000:03:00.0", &format!("{sw_a}/0000:02:10.0")[..], 0),
            ("0000:12:00.0", &format!("{sw_b}/0000:12:08.0")[..], 0),
            ("0000:13:00.0", &format!("{sw_b}/0000:12:10.0")[..], 0),
            ("0000:81:00.0", "pci0000:80/0000:80:01.0", 1),
        ]);
        let ids = [
            "0000:02:00.0",
            "0000:03:00.0",
            "0000:12:00.0",
            "0000:13:00.0",
            "0000:81:00.0",
        ];
        let places: Vec<PciPlace> = ids
            .iter()
            .map(|id| pci_place_in(&root, id).expect("place"))
            .collect();
        assert_eq!(places[0].root, "pci0000:00");
        assert_eq!(
            places[0].bridges,
            vec!["0000:00:01.0", "0000:01:00.0", "0000:02:08.0"]
        );
        assert_eq!(places[4].numa, Some(1));
        assert_eq!(
            pci_affinity(&places[0], &places[1]),
            PciAffinity::SameSwitch
        );
        assert_eq!(pci_affinity(&places[0], &places[2]), PciAffinity::SameRoot);
        assert_eq!(pci_affinity(&places[0], &places[4]), PciAffinity::CrossNuma);
        assert_eq!(islands(&places), vec![vec![0, 1], vec![2, 3], vec![4]]);
        assert!(pci_place_in(&root, "0000:99:00.0").is_none());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn driver_bus_ids_become_sysfs_ids() {
        assert_eq!(sysfs_bus_id("0000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(sysfs_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
    }

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
