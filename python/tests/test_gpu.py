"""GPU tests of the torch-facing package: real processes, one per rank,
over torch.distributed (gloo carries the setup exchange).

Placements: world 1; two processes on GPU 0; and, when two GPUs exist,
world 2 across GPUs 0 and 1 (which must then run: a missing second GPU is
never passed off as a pass). Each placement runs the correctness cases
(gpu_worker.correctness) and a dead-rank case. Skips, with the reason,
where torch or a GPU is missing.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import torch
    import torch.multiprocessing as mp

    GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
    WHY = None if GPUS else "torch sees no CUDA GPU"
except ImportError as e:  # no torch on this machine
    torch = None
    GPUS = 0
    WHY = f"torch is not installed ({e})"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, devices, port, outdir, mode):
    import gpu_worker

    gpu_worker.main(rank, world, devices, port, outdir, mode)


#: Seconds a placement may take before its ranks are killed and it fails.
DEADLINE = float(os.environ.get("P2P_TEST_DEADLINE", "240"))


def run_ranks(devices, mode):
    world = len(devices)
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(world, devices, free_port(), outdir, mode), nprocs=world, start_method="spawn", join=False
        )
        deadline = time.monotonic() + DEADLINE
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(f"ranks on {devices} ({mode}) still running after {DEADLINE:.0f} s: killed")
        results = {}
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[r] = json.load(f)
        return results


@unittest.skipIf(WHY is not None, WHY or "")
class GpuTests(unittest.TestCase):
    def check(self, devices, mode, expect_ranks):
        results = run_ranks(devices, mode)
        self.assertEqual(sorted(results), expect_ranks, f"ranks that reported: {sorted(results)}")
        failed = []
        for r, cases in sorted(results.items()):
            self.assertTrue(cases, f"rank {r} ran no case")
            for name, err in cases:
                print(f"  rank {r} on cuda:{devices[r]}: {'ok  ' if err is None else 'FAIL'} {name}", flush=True)
                if err is not None:
                    failed.append(f"rank {r}: {name}\n{err}")
        self.assertFalse(failed, "\n".join(failed))

    def test_world1(self):
        self.check([0], "correctness", [0])

    def test_two_processes_on_gpu0(self):
        self.check([0, 0], "correctness", [0, 1])

    def test_two_processes_on_gpu0_engine_adapter(self):
        self.check([0, 0], "adapter", [0, 1])

    def test_two_processes_on_gpu0_dead_rank(self):
        self.check([0, 0], "timeout", [0])

    def test_two_processes_on_gpu0_calls_that_differ(self):
        self.check([0, 0], "mismatch", [0, 1])

    def test_group_across_hosts_is_unavailable(self):
        """Issue 31: a group whose ranks are on two hosts is refused at
        construction, before any IPC handle is opened, with
        UnavailableError (engines fall back to NCCL). Rank 1 is forged from
        rank 0's identity record (text, ``key=value`` lines) as if it ran
        on another host; the construction must fail in the first round."""
        import p2p_allreduce as pa

        rounds = []

        def other_host(data):
            rounds.append(data)
            lines = bytes(data).decode().splitlines()
            peer = []
            for line in lines:
                key, _, value = line.partition("=")
                if key == "rank":
                    line = "rank=1"
                elif key == "pid":
                    line = f"pid={int(value) + 1}"
                elif key == "host":
                    line = "host=another-host"
                elif key == "boot":
                    line = "boot=ffffffff-0000-0000-0000-000000000000"
                peer.append(line)
            return [bytes(data), ("\n".join(peer) + "\n").encode()]

        other_host.rank, other_host.world = 0, 2
        with self.assertRaises(pa.UnavailableError) as cm:
            pa.CustomAllreduce(device=torch.device("cuda", 0), exchange=other_host)
        self.assertIn("NCCL", str(cm.exception))
        self.assertIn("another-host", str(cm.exception))
        self.assertEqual(list(cm.exception.peers), [1])
        self.assertEqual(len(rounds), 1, "refused in the identity round, before the IPC records")
        self.assertTrue(bytes(rounds[0]).startswith(b"p2p-allreduce identity "))

    @unittest.skipIf(GPUS < 2, f"needs 2 GPUs, torch sees {GPUS}")
    def test_two_gpus(self):
        self.check([0, 1], "correctness", [0, 1])

    @unittest.skipIf(GPUS < 2, f"needs 2 GPUs, torch sees {GPUS}")
    def test_two_gpus_dead_rank(self):
        self.check([0, 1], "timeout", [0])


BENCH_TP = os.path.join(HERE, "..", "bench", "bench_tp.py")
#: A small model: every layer kind, two layers, seconds to run.
TINY = ["--hidden", "1024", "--layers", "2", "--intermediate", "2048", "--heads", "8", "--kv-heads", "2",
        "--head-dim", "128", "--tokens", "1,3,8", "--kv-len", "64", "--reps", "3", "--warmup", "1"]


@unittest.skipIf(WHY is not None, WHY or "")
class BenchTpTests(unittest.TestCase):
    """python/bench/bench_tp.py end to end: the decode step in a CUDA graph
    with its bit checks, as a user runs it."""

    def run_bench(self, gpus, *extra):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "out.json")
            p = subprocess.run([sys.executable, BENCH_TP, "--gpus", gpus, *TINY, "--json", path, *extra],
                               capture_output=True, text=True, timeout=DEADLINE)
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n", flush=True)
            rows = None
            if os.path.exists(path):
                with open(path) as f:
                    rows = json.load(f)["rows"]
            return p, rows

    def expect_timed(self, rows, backends, tokens):
        got = {(r["tokens"], r["backend"]): r for r in rows}
        for t in tokens:
            for b in backends:
                r = got[(t, b)]
                self.assertIsInstance(r.get("step_us"), float, f"{b} at {t} tokens: {r}")
                self.assertGreater(r["step_us"], 0.0)
        return got

    def test_step_two_processes_on_gpu0(self):
        p, rows = self.run_bench("0,0")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        got = self.expect_timed(rows, ["ours", "ours-fused", "none"], [1, 3, 8])
        for t in (1, 3, 8):
            for b in ("nccl", "symm-mem"):
                self.assertIn("share a GPU", got[(t, b)]["skipped"])
            self.assertEqual(got[(t, "ours")]["max_ulps_vs_ours"], 0)
            for b in ("ours", "ours-fused", "none"):
                self.assertEqual(got[(t, b)]["checks"], "passed")
            for b in ("ours", "ours-fused"):
                self.assertEqual(got[(t, b)]["calls_checked"], 4)  # 2 layers, 2 calls each
            self.assertIsInstance(got[(t, "ours-fused")]["max_ulps_vs_ours"], int)

    def test_verify_two_processes_on_gpu0(self):
        p, rows = self.run_bench("0,0", "--pattern", "verify", "--tokens", "3")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        got = self.expect_timed(rows, ["ours", "ours-fused"], [3])
        self.assertEqual(got[(3, "ours")]["allreduces"], 4)

    def test_a_flipped_bit_fails_the_run(self):
        p, rows = self.run_bench("0,0", "--inject-fault", "--backends", "ours,none", "--tokens", "3")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("CHECK FAILED", p.stderr)
        # The run still reports: the table, with the failed row marked, and the failure named.
        # Two checks see a flipped bit: rank 1's step against rank 0's, and
        # rank 1's first call of ours made again eagerly on its recorded inputs.
        self.assertIn("CHECKS FAILED (2)", p.stdout)
        self.assertIn("rank 1's tensor 0 differs from rank 0's in 1 of", p.stdout)
        self.assertIn("rank 1, ours, 3 tokens: 1 of the step's 4 calls of ours gave other bits eager than replayed, "
                      "on the same inputs (call 0: 1 elements)", p.stdout)
        got = {(r["tokens"], r["backend"]): r for r in rows}
        self.assertEqual(got[(3, "ours")]["checks"], "FAILED")
        self.assertEqual(got[(3, "none")]["checks"], "passed")

    @unittest.skipIf(GPUS < 2, f"needs 2 GPUs, torch sees {GPUS}")
    def test_step_two_gpus_every_backend(self):
        p, rows = self.run_bench("0,1")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.expect_timed(rows, ["nccl", "ours", "ours-fused", "symm-mem", "none"], [1, 3, 8])


if __name__ == "__main__":
    unittest.main(verbosity=2)
