#!/usr/bin/env bash
# The engine adapters (p2p_allreduce.integrations) against the real SGLang
# and vLLM packages, on CPU: installs the pinned versions in
# python/tests/engines-requirements.txt (torch, vllm, sglang and what their
# imported modules need, ~6.5 GB) into .tools/engines once, installs the
# wheel there and runs python/tests/test_integrations.py with it.
# If pip cannot install the engines (no network, another Python than the
# pins were made for), says so and skips; test failures fail.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.tools/engines
PY=${PYTHON:-python3}
ready() { [ -x "$V/bin/python" ] && "$V/bin/python" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("vllm") and u.find_spec("sglang") and u.find_spec("torch")))' 2>/dev/null; }
if ! ready; then
  echo "test-engines: installing the pinned engines into $V (once)" >&2
  rm -rf "$V"
  "$PY" -m venv "$V"
  if ! "$V/bin/pip" install -q --no-deps -r python/tests/engines-requirements.txt; then
    echo "test-engines: SKIPPED: pip could not install python/tests/engines-requirements.txt (pins made for CPython 3.11, x86_64)"
    exit 0
  fi
  # Installed but not importable: the pins are wrong (a skip here would hide it).
  if ! ready; then
    echo "test-engines: pip installed python/tests/engines-requirements.txt, but torch, vllm or sglang does not import from $V: fix the pins" >&2
    exit 1
  fi
fi
bash scripts/wheel.sh >/dev/null
"$V/bin/pip" install -q --force-reinstall --no-deps "$(ls -t .whl/p2p_allreduce-*.whl | head -1)"
cd python/tests && "../../$V/bin/python" -m unittest -v test_integrations
