#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the p2p-allreduce
# command (no arguments: `info`, plus a short `check` and `bench` on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo run --release --features cli --bin p2p-allreduce -- "$@"
