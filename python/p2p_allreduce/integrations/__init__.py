"""Drop-in adapters that make a serving engine's tensor-parallel allreduce
ours, without editing the engine: ``integrations.vllm.install()`` and
``integrations.sglang.install()``, or the environment variable
``P2P_ALLREDUCE_ENGINE`` (``vllm``, ``sglang``, or ``1`` for whichever runs):
the wheel registers a general plugin with each engine, which loads it in
every process it starts, and the plugin installs the adapter when the
variable names that engine. ``install_from_env()`` does the same from a
``sitecustomize`` or a launcher.
"""

import importlib
import os

from ._adapter import EngineAllreduce, enabled_by_env, host_identity

ENV = "P2P_ALLREDUCE_ENGINE"

__all__ = ["ENV", "EngineAllreduce", "enabled_by_env", "host_identity", "install_from_env"]


def install_from_env() -> list:
    """Installs the adapters ``P2P_ALLREDUCE_ENGINE`` names for the engines
    importable here; returns the engines installed."""
    done = []
    for engine in ("vllm", "sglang"):
        if not enabled_by_env(engine):
            continue
        try:
            importlib.import_module(engine)
        except ImportError:
            if engine in {s.strip() for s in os.environ.get(ENV, "").lower().split(",")}:
                raise
            continue
        importlib.import_module(f"{__name__}.{engine}").install()
        done.append(engine)
    return done
