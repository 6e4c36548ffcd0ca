//! Tells the parent crate's build.rs where this crate's sources are
//! (`DEP_P2P_ALLREDUCE_DEVICE_ROOT`, through `links`): it compiles them to
//! PTX, also when both crates come from a registry, where the parent's
//! package cannot carry them.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:root={dir}");
}
