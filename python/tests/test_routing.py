"""Routing between our kernels and the engine's NCCL (issue 44), without a
GPU or torch: ``p2p_allreduce.routing`` on synthetic tables, and the
drop-ins' gate (``CustomAllreduce.backend_for``, ``EngineAllreduce.takes``)
over stand-in groups. Routing is a pure function of (table, size, mode):
these tests check that it never picks a backend the table measured slower,
that every size falls in exactly one band, and that deterministic mode keeps
every size on our kernels."""

import random
import types
import unittest

from p2p_allreduce import routing
from p2p_allreduce.custom_allreduce import CustomAllreduce
from p2p_allreduce.integrations._adapter import EngineAllreduce

#: NCCL must beat ours by more than this to take a size (thresholds.rs's
#: NCCL_MUST_WIN_BY, which `p2p-allreduce tune` applies).
MUST_WIN_BY = 0.02


def measured(rng, n):
    """A synthetic sweep: sizes and each backend's time (NCCL's sometimes
    unmeasured), as `tune` times them."""
    sizes = sorted(rng.sample(range(1, 1 << 22), n))
    rows = []
    for s in sizes:
        times = {routing.OURS: rng.uniform(1, 100)}
        for b in (routing.NCCL, routing.NCCL_SYMMETRIC):
            if rng.random() < 0.7:
                times[b] = rng.uniform(1, 100)
        rows.append((s * 16, times))
    return rows


def winner_of(times):
    nccl = [(t, b) for b, t in times.items() if b != routing.OURS]
    if not nccl:
        return routing.OURS
    t, b = min(nccl)
    return b if times[routing.OURS] > t * (1 + MUST_WIN_BY) else routing.OURS


def bands_of(rows):
    """Bands as `tune` writes them: a band per run of sizes with one winner,
    ending at its last size, the last open."""
    bands = []
    for size, times in rows:
        w = winner_of(times)
        if bands and bands[-1][1] == w:
            bands[-1] = (size, w, None)
        else:
            bands.append((size, w, None))
    bands[-1] = (None, bands[-1][1], None)
    return bands


class RoutingTests(unittest.TestCase):
    def test_never_a_backend_measured_slower(self):
        rng = random.Random(44)
        for _ in range(300):
            rows = measured(rng, rng.randint(1, 20))
            bands = bands_of(rows)
            routing.check_bands(bands)
            for size, times in rows:
                got = routing.route(bands, size, deterministic=False)
                self.assertIn(got, times, f"{got} was not measured at {size} B")
                for other, t in times.items():
                    self.assertLessEqual(times[got], t * (1 + MUST_WIN_BY) * (1 + 1e-12),
                                         f"{got} picked at {size} B, {other} faster: {times}")
                if got != routing.OURS:
                    self.assertLess(times[got], times[routing.OURS])
                self.assertEqual(routing.route(bands, size, deterministic=True), routing.OURS)

    def test_every_size_falls_in_one_band(self):
        rng = random.Random(7)
        for _ in range(200):
            bands = bands_of(measured(rng, rng.randint(1, 12)))
            probes = [0, 1, 2**63 - 1] + [rng.randrange(0, 1 << 40) for _ in range(32)]
            for n in probes:
                holders = [i for i, (up_to, _, _) in enumerate(bands)
                           if (up_to is None or n <= up_to) and (i == 0 or n > bands[i - 1][0])]
                self.assertEqual(len(holders), 1, f"{n} B in bands {holders} of {bands}")
                self.assertEqual(routing.winner(bands, n), bands[holders[0]][1])

    def test_bad_tables_are_refused(self):
        for bad in ([], [(10, "ours", None)], [(10, "ours", None), (10, "nccl", None), (None, "ours", None)],
                    [(None, "ring", None)], [(None, "ours", None), (None, "nccl", None)]):
            with self.assertRaises(ValueError, msg=repr(bad)):
                routing.check_bands(bad)
        routing.check_bands([(None, "ours", None)])

    def test_env(self):
        for v, want in [("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)]:
            self.assertEqual(routing.deterministic_from_env({routing.ENV_DETERMINISTIC: v}), want, v)
        self.assertFalse(routing.deterministic_from_env({}))


TABLE = [(64 << 10, "ours", 0.3), (1 << 20, "nccl_symmetric", 0.2), (4 << 20, "nccl", 0.05), (None, "ours", -0.01)]


def stand_in_ca(deterministic, bands=TABLE, world=2):
    """A CustomAllreduce over a stand-in native group (no GPU)."""
    ca = object.__new__(CustomAllreduce)
    ca._native = types.SimpleNamespace(world=world, max_bytes=8 << 20, link="nvlink", tuned=True,
                                       choose=lambda dt, n, algo: "one_stage")
    ca.algorithm = "auto"
    ca.deterministic = deterministic
    ca.nccl_bands = list(bands)
    return ca


class DropInTests(unittest.TestCase):
    def test_custom_allreduce_leaves_nccl_bands_to_nccl(self):
        fast, det = stand_in_ca(False), stand_in_ca(True)
        for n, want in [(4096, "ours"), (64 << 10, "ours"), ((64 << 10) + 2, "nccl_symmetric"), (1 << 20, "nccl_symmetric"),
                        (2 << 20, "nccl"), (8 << 20, "ours")]:
            self.assertEqual(fast.backend_for(n), want, n)
            self.assertEqual(det.backend_for(n), "ours", n)
        # One rank: a copy, ours.
        self.assertEqual(stand_in_ca(False, world=1).backend_for(2 << 20), "ours")

    def engine(self, deterministic, ca):
        e = object.__new__(EngineAllreduce)
        e.disabled, e.max_size, e.ca = False, 8 << 20, ca
        e.deterministic = deterministic
        e.deterministic_reason = "VLLM_BATCH_INVARIANT=1" if deterministic else None
        return e

    @staticmethod
    def tensor(nbytes):
        return types.SimpleNamespace(dtype="torch.bfloat16", is_contiguous=lambda: True, numel=lambda: nbytes // 2,
                                     element_size=lambda: 2, device=types.SimpleNamespace(type="cuda"))

    def test_engine_gate_follows_the_table_unless_deterministic(self):
        fast = self.engine(False, stand_in_ca(False))
        det = self.engine(True, stand_in_ca(True))
        for n, takes in [(4096, True), (512 << 10, False), (2 << 20, False), (8 << 20, True), ((8 << 20) + 2, False)]:
            self.assertEqual(fast.takes(self.tensor(n)), takes, n)
            # Deterministic: every size, above max_size too (in chunks).
            self.assertTrue(det.takes(self.tensor(n)), n)
        self.assertIn("nccl_symmetric 65537..1048576 B", fast.mode_line())
        self.assertIn("nccl 1048577..4194304 B", fast.mode_line())
        self.assertIn("deterministic mode (VLLM_BATCH_INVARIANT=1)", det.mode_line())
        # A stand-in without routing (the engine tests' gloo sum): sizes only.
        plain = self.engine(False, types.SimpleNamespace())
        self.assertTrue(plain.takes(self.tensor(2 << 20)))


if __name__ == "__main__":
    unittest.main(verbosity=2)
