"""Tests of python/bench/bench_tp.py that need neither torch nor a GPU: the
model shapes and their per-rank shards, the memory estimate that refuses
what does not fit, argument checks, and the report (gains, table, plot).
The decode step itself runs in test_gpu.py."""

import json
import math
import os
import sys
import tempfile
import unittest
import xml.dom.minidom

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))

import bench_tp  # noqa: E402


class ShapeTests(unittest.TestCase):
    def test_presets_make_the_step_the_issue_names(self):
        a = bench_tp.parse_args(["--gpus", "0,1", "--model", "deepseek-v3-dense"])
        s, changed = bench_tp.model_shape(a, 2)
        self.assertEqual((s.hidden, s.layers, changed), (7168, 61, []))
        # 122 allreduces of 3 x 7168 bf16 = 42 KiB in a speculative verify.
        self.assertEqual(2 * s.layers, 122)
        self.assertEqual(s.allreduce_bytes(3), 43008)
        l70 = bench_tp.model_shape(bench_tp.parse_args(["--model", "llama-70b"]), 8)[0]
        self.assertEqual((l70.hidden, l70.layers, l70.q_heads, l70.kv_local, l70.inter_local), (8192, 80, 8, 1, 3584))

    def test_shards(self):
        s = bench_tp.Shape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, head_dim=128, tp=2)
        self.assertEqual((s.q_heads, s.kv_local, s.inter_local), (32, 4, 14336))
        # qkv + o + gate/up + down + two norms, per rank.
        want = 8192 * (32 + 8) * 128 + 32 * 128 * 8192 + 8192 * 2 * 14336 + 14336 * 8192 + 2 * 8192
        self.assertEqual(s.layer_weight_elems(), want)
        # 70B at TP 2: about 64 GiB of bf16 layer weights per rank (the issue says ~78 GB with embeddings).
        self.assertAlmostEqual(2 * 80 * want / 2**30, 63.8, delta=1.0)
        # KV heads replicate when there are fewer than ranks.
        s8 = bench_tp.Shape(hidden=7168, layers=1, intermediate=18432, heads=56, kv_heads=4, head_dim=128, tp=8)
        self.assertEqual(s8.kv_local, 1)

    def test_what_does_not_split_is_refused(self):
        with self.assertRaises(ValueError):
            bench_tp.Shape(hidden=7168, layers=1, intermediate=18432, heads=56, kv_heads=8, head_dim=128, tp=3)
        with self.assertRaises(ValueError):
            bench_tp.Shape(hidden=7168, layers=0, intermediate=18432, heads=56, kv_heads=8, head_dim=128, tp=2)
        with self.assertRaises(ValueError):
            bench_tp.Shape(hidden=64, layers=1, intermediate=64, heads=6, kv_heads=4, head_dim=8, tp=2)

    def test_memory_estimate_names_the_layers_that_fit(self):
        s = bench_tp.Shape(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, head_dim=128, tp=2)
        need = s.bytes_per_rank(128, 1024)
        budget = 60 * 2**30
        self.assertGreater(need, budget)
        fit = s.max_layers(128, 1024, budget)
        self.assertGreater(fit, 0)
        self.assertLess(fit, 80)
        s.layers = fit
        self.assertLessEqual(s.bytes_per_rank(128, 1024), budget)
        s.layers = fit + 1
        self.assertGreater(s.bytes_per_rank(128, 1024), budget)

    def test_overrides_are_reported(self):
        a = bench_tp.parse_args(["--model", "llama-70b", "--layers", "20"])
        s, changed = bench_tp.model_shape(a, 2)
        self.assertEqual(s.layers, 20)
        self.assertEqual(changed, ["layers 20 (preset 80)"])


class ArgTests(unittest.TestCase):
    def bad(self, *argv):
        with self.assertRaises(SystemExit) as cm:
            bench_tp.parse_args(list(argv))
        self.assertEqual(cm.exception.code, 2)

    def test_refusals(self):
        self.bad("--gpus", "0")
        self.bad("--backends", "ours,gloo")
        self.bad("--tokens", "1,x")
        self.bad("--tokens", "0")
        self.bad("--kv-len", "0")
        self.bad("--gpus", "0,1,2", "--model", "llama-70b")  # 64 heads over 3 ranks

    def test_defaults(self):
        a = bench_tp.parse_args([])
        self.assertEqual(a.tokens, [1, 3, 8, 32, 128])
        self.assertEqual(a.backends, bench_tp.BACKENDS)
        self.assertEqual(bench_tp.parse_args(["--pattern", "verify"]).tokens, [3])
        self.assertEqual(bench_tp.parse_args(["--pattern", "verify", "--tokens", "1,3"]).tokens, [1, 3])


class ReportTests(unittest.TestCase):
    ROWS = [
        {"tokens": 3, "backend": "nccl", "step_us": 30000.0},
        {"tokens": 3, "backend": "ours", "step_us": 12000.0, "checks": "FAILED"},
        {"tokens": 3, "backend": "none", "step_us": 10000.0},
        {"tokens": 3, "backend": "symm-mem", "skipped": "why"},
        {"tokens": 8, "backend": "ours", "step_us": 13000.0},
        {"tokens": 8, "backend": "none", "step_us": 11000.0},
    ]

    def rows(self):
        return bench_tp.gains([dict(r) for r in self.ROWS])

    def test_gains(self):
        r = {(x["tokens"], x["backend"]): x for x in self.rows()}
        self.assertEqual(r[(3, "ours")]["allreduce_us"], 2000.0)
        self.assertAlmostEqual(r[(3, "ours")]["allreduce_share"], 2000 / 12000, places=3)
        self.assertAlmostEqual(r[(3, "ours")]["gain_over_nccl"], 2.5)
        self.assertAlmostEqual(r[(3, "ours")]["tokens_per_s"], 250.0)
        self.assertNotIn("gain_over_nccl", r[(8, "ours")])  # no NCCL row at 8 tokens
        self.assertNotIn("allreduce_us", r[(3, "none")])
        self.assertNotIn("tokens_per_s", r[(3, "symm-mem")])

    def test_table_and_plot(self):
        rows = self.rows()
        t = bench_tp.table(rows, "step")
        self.assertEqual(len(t.splitlines()), 2 + len(rows))
        self.assertIn("| 3 | symm-mem | why |", t)
        self.assertIn("2.50x", t)
        self.assertIn("| 2.50x | - | FAILED |", t)  # a failed check shows in its row
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "p.svg")
            bench_tp.svg_plot(rows, "a <title>", path)
            doc = xml.dom.minidom.parse(path)  # well-formed
            lines = doc.getElementsByTagName("polyline")
            self.assertEqual(len(lines), 3)  # nccl, none, ours: skipped rows draw nothing
            for pl in lines:
                for pt in pl.getAttribute("points").split():
                    x, y = map(float, pt.split(","))
                    self.assertTrue(math.isfinite(x) and math.isfinite(y))

    def test_verify_table(self):
        rows = bench_tp.gains([
            {"tokens": 3, "backend": "nccl", "bytes": 43008, "allreduces": 122, "step_us": 24400.0,
             "per_allreduce_us": 200.0},
            {"tokens": 3, "backend": "ours", "bytes": 43008, "allreduces": 122, "step_us": 610.0,
             "per_allreduce_us": 5.0},
        ])
        t = bench_tp.table(rows, "verify")
        self.assertIn("| 3 | 43008 | ours | 122 | 610.0 | 5.00 | 40.00x |", t)
        json.dumps(rows)


if __name__ == "__main__":
    unittest.main(verbosity=2)
