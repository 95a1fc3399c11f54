"""Makes spillway every dask worker's default store in every Python process that has this directory
on its path (``scripts/dask-tests.sh`` puts it there, for dask's own test suite).

With ``SPILLWAY_DASK_DEFAULT_STORE=1``, once ``distributed.worker_memory`` is imported its
``SpillBuffer`` (what a worker makes when it is not given ``data=``) is ``spillway.SpillBuffer``,
which takes the same arguments. Nothing else is changed; the plugin is turned on separately, with
dask's own ``distributed.worker.preload`` config.
"""

import importlib.abc
import importlib.util
import os
import sys


class _SpillwayDefaultStore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "distributed.worker_memory":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import spillway

            module.SpillBuffer = spillway.SpillBuffer

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SPILLWAY_DASK_DEFAULT_STORE") == "1":
    sys.meta_path.insert(0, _SpillwayDefaultStore())
