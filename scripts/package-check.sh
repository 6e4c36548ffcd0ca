#!/usr/bin/env bash
# What a crates.io user gets: packages the kernel crate (device/) and the
# library the way `cargo publish` would, checks both against crates.io's
# upload limit, then, in a clean directory, builds a small consumer crate
# against the two tarballs alone: the library's build.rs compiles the
# kernels from the packaged device sources (PTX, SASS with ptxas,
# compressed), and the consumer checks what it got.
#
# The kernel build there covers P2P_ALLREDUCE_PACKAGE_ARCHS (default sm_90:
# one PTX and one cubin, to keep CI short); the default set is what every
# other build here covers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ROOT=$PWD
LIMIT=10000000 # crates.io refuses uploads over 10 MB
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

say() { printf 'package-check: %s\n' "$*"; }

# 1. The two packages (crates.io has neither yet, so the library's packaging
#    resolves the kernel crate through a patch to the path).
(cd device && cargo package --no-verify --allow-dirty --quiet --target-dir "$WORK/target-device")
cargo package --no-verify --allow-dirty --quiet --target-dir "$WORK/target-host" \
  --config "patch.crates-io.p2p-allreduce-device.path=\"$ROOT/device\""
DEVICE_CRATE="$WORK/target-device/package/p2p-allreduce-device-$VERSION.crate"
HOST_CRATE="$WORK/target-host/package/p2p-allreduce-$VERSION.crate"
for c in "$DEVICE_CRATE" "$HOST_CRATE"; do
  size=$(stat -c %s "$c")
  say "$(basename "$c"): $size bytes"
  [ "$size" -le "$LIMIT" ] || { echo "package-check: $(basename "$c") is over crates.io's $LIMIT-byte limit" >&2; exit 1; }
done
# The kernel sources travel in the kernel crate's package.
FILES=$(tar tzf "$DEVICE_CRATE")
grep -qx "p2p-allreduce-device-$VERSION/src/kernels.rs" <<<"$FILES" \
  || { echo "package-check: the kernel crate's package lacks src/kernels.rs" >&2; exit 1; }

# 2. A clean directory holding only the unpacked tarballs and a consumer.
mkdir -p "$WORK/src" "$WORK/user/src"
tar xzf "$DEVICE_CRATE" -C "$WORK/src"
tar xzf "$HOST_CRATE" -C "$WORK/src"
cat > "$WORK/user/Cargo.toml" <<TOML
[package]
name = "package-check-user"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
p2p-allreduce = { path = "../src/p2p-allreduce-$VERSION" }

# As crates.io would serve it: the kernel crate from its own package.
[patch.crates-io]
p2p-allreduce-device = { path = "../src/p2p-allreduce-device-$VERSION" }

[workspace]
TOML
cat > "$WORK/user/src/main.rs" <<'RS'
use p2p_allreduce::ptx::{self, Entry, Op};
use p2p_allreduce::{Algorithm, Dtype};

fn main() {
    let archs = ptx::built_archs();
    let module = ptx::MODULES.first().expect("at least one module");
    let entry = Entry { op: Op::Allreduce, algorithm: Algorithm::PushLl, dtype: Dtype::Bf16, world: 2, virtual_ranks: false };
    assert!(module.ptx().contains(&format!(".entry {}(", entry.name())), "PTX lacks {}", entry.name());
    let cubin = module.cubin().expect("SASS: the package build found ptxas");
    assert_eq!(&cubin[..4], b"\x7fELF");
    assert_eq!(module.family_ptx(entry.family()).matches(".entry ").count(), 9);
    println!("ok: archs {archs:?}; {} bytes of PTX and {} of SASS for {}, from the packaged sources", module.ptx().len(), cubin.len(), module.arch);
}
RS
# The packaged lock file, so the consumer builds the versions CI tested.
cp "$WORK/src/p2p-allreduce-$VERSION/Cargo.lock" "$WORK/user/Cargo.lock"
say "building a consumer from the tarballs (kernels for ${P2P_ALLREDUCE_PACKAGE_ARCHS:-sm_90})"
P2P_ALLREDUCE_ARCHS="${P2P_ALLREDUCE_PACKAGE_ARCHS:-sm_90}" \
P2P_ALLREDUCE_PTXAS="${P2P_ALLREDUCE_PTXAS:-$ROOT/.tools/cuda-nvcc/nvidia/cuda_nvcc/bin/ptxas}" \
CARGO_TARGET_DIR="$WORK/target-user" \
  cargo run --release --quiet --manifest-path "$WORK/user/Cargo.toml"
say "ok"
