#!/usr/bin/env bash
# The test command: installs what is missing (scripts/setup.sh), then runs
# every test. Without a GPU the GPU suite prints SKIPPED with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --release "$@"
# The torch-facing package: wheel, install, python/tests.
bash scripts/test-python.sh
