"""Tests of the torch-facing package that need no GPU and no torch: the
extension loads, its names and errors are what the docs say, and setup
without a driver (or with bad arguments) fails with a typed error."""

import unittest

import p2p_allreduce as pa
from p2p_allreduce import _native


def gather_self(data):
    return [data]


class NoGpuTests(unittest.TestCase):
    def test_module(self):
        self.assertTrue(pa.__version__)
        self.assertEqual(
            pa.algorithms(),
            ["one_stage", "two_stage", "push", "push_ll", "push_two_stage", "push_islands"],
        )
        self.assertIsInstance(pa.driver_present(), bool)
        self.assertEqual(pa.DTYPES, {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"})

    def test_error_classes(self):
        self.assertTrue(issubclass(pa.UsageError, ValueError))
        for cls in (pa.PeerTimeoutError, pa.PoisonedError, pa.UsageError, pa.GroupError, pa.UnavailableError):
            self.assertTrue(issubclass(cls, pa.P2PAllreduceError))
        e = pa.PeerTimeoutError("late", rank=0, peers=[1], barrier="Start")
        self.assertEqual((e.rank, e.peers, e.barrier, str(e)), (0, [1], "Start", "late"))

    def test_bad_rank_is_value_error(self):
        with self.assertRaises(ValueError):
            _native.Group(2, 2, 0, gather_self)

    @unittest.skipIf(pa.driver_present(), "a CUDA driver is present: covered by test_gpu.py")
    def test_no_driver_is_typed(self):
        with self.assertRaises(pa.UnavailableError) as cm:
            _native.Group(0, 1, 0, gather_self)
        self.assertIn("driver", str(cm.exception))

    def test_unknown_algorithm_is_refused_before_setup(self):
        with self.assertRaises(pa.UsageError):
            pa.CustomAllreduce(algorithm="fastest")


if __name__ == "__main__":
    unittest.main(verbosity=2)
