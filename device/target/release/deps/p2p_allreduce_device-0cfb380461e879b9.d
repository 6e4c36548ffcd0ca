/work/main/device/target/release/deps/p2p_allreduce_device-0cfb380461e879b9.d: src/lib.rs src/abi.rs src/barrier.rs src/numeric.rs src/reduce.rs Cargo.toml

/work/main/device/target/release/deps/libp2p_allreduce_device-0cfb380461e879b9.rmeta: src/lib.rs src/abi.rs src/barrier.rs src/numeric.rs src/reduce.rs Cargo.toml

src/lib.rs:
src/abi.rs:
src/barrier.rs:
src/numeric.rs:
src/reduce.rs:
Cargo.toml:

# env-dep:CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__-W__CLIPPY_HACKERY__clippy::undocumented_unsafe_blocks__CLIPPY_HACKERY__-W__CLIPPY_HACKERY__clippy::missing_safety_doc__CLIPPY_HACKERY__
# env-dep:CLIPPY_CONF_DIR
