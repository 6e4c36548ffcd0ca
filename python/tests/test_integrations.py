"""The engine adapters (p2p_allreduce.integrations) against the real engine
packages, on CPU: two processes over gloo import the engine, install the
adapter, and let the engine's own code build and call it (see
integration_worker.py). Skips, with the reason, where torch or the engine
cannot be imported; scripts/test-engines.sh installs pinned engine versions
into .tools/engines and runs this file there."""

import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def missing(*mods):
    for m in mods:
        try:
            if importlib.util.find_spec(m) is None:
                return f"{m} is not installed here (scripts/test-engines.sh installs it)"
        except (ImportError, ValueError) as e:
            return f"{m} cannot be found: {e}"
    return None


TORCH = missing("torch")
DEADLINE = float(os.environ.get("P2P_TEST_DEADLINE", "400"))


def _entry(rank, world, port, outdir, engine):
    import integration_worker

    integration_worker.main(rank, world, port, outdir, engine)


def run(engine, world=2):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, port, outdir, engine), nprocs=world, start_method="spawn",
                                 join=False)
        deadline = time.monotonic() + DEADLINE
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(f"{engine} ranks still running after {DEADLINE:.0f} s: killed")
        out = {}
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out[r] = json.load(f)
        return out


class EngineTests(unittest.TestCase):
    def check(self, engine, expect):
        results = run(engine)
        self.assertEqual(sorted(results), [0, 1], f"ranks that reported: {sorted(results)}")
        failed = []
        for r, cases in sorted(results.items()):
            self.assertEqual([c for c, _ in cases], expect, f"rank {r} ran other cases")
            for name, err in cases:
                print(f"  {engine} rank {r}: {'ok  ' if err is None else 'FAIL'} {name}", flush=True)
                if err is not None:
                    failed.append(f"rank {r}: {name}\n{err}")
        self.assertFalse(failed, "\n".join(failed))

    SETUP = ["setup without a GPU disables every rank", "a group across hosts is off before any setup",
             "one rank's failed setup disables every rank"]

    @unittest.skipIf(TORCH or missing("vllm"), TORCH or missing("vllm") or "")
    def test_vllm(self):
        self.check("vllm", ["install, plugin and env", *self.SETUP,
                            "vLLM's dispatch calls ours, and falls back for the rest",
                            "VLLM_BATCH_INVARIANT=1: ours in deterministic mode at every size"])

    @unittest.skipIf(TORCH or missing("sglang"), TORCH or missing("sglang") or "")
    def test_sglang(self):
        self.check("sglang", ["install, plugin and env", *self.SETUP, "SGLang's group and fused op call ours",
                              "--enable-deterministic-inference keeps ours on, in deterministic mode"])


@unittest.skipIf(TORCH, TORCH or "")
class EnvTests(unittest.TestCase):
    def test_switch(self):
        from p2p_allreduce.integrations import enabled_by_env

        old = os.environ.get("P2P_ALLREDUCE_ENGINE")
        try:
            for v, vllm, sglang in [("", False, False), ("vllm", True, False), ("sglang,vllm", True, True),
                                    ("1", True, True), ("0", False, False), ("VLLM", True, False)]:
                os.environ["P2P_ALLREDUCE_ENGINE"] = v
                self.assertEqual((enabled_by_env("vllm"), enabled_by_env("sglang")), (vllm, sglang), v)
        finally:
            if old is None:
                os.environ.pop("P2P_ALLREDUCE_ENGINE", None)
            else:
                os.environ["P2P_ALLREDUCE_ENGINE"] = old


if __name__ == "__main__":
    unittest.main(verbosity=2)
