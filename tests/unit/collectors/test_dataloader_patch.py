"""The determinism controls' DataLoader patch (collectors/determinism.py) changes nothing else a
loader does (helper 15): Lightning rebuilds loaders from DataLoader.__init__'s signature, and spawn
workers get the worker_init_fn pickled."""

from __future__ import annotations

import inspect
import pickle

import torch
from torch.utils.data import DataLoader

from bitguard.collectors import determinism


def _seen(worker_id):  # (module level: a spawn worker unpickles it)
    torch.manual_seed(1000 + worker_id)


def test_the_patched_loader_keeps_its_signature_and_a_picklable_worker_init():
    determinism._patch_dataloader()
    try:
        params = inspect.signature(DataLoader.__init__).parameters
        assert {"batch_size", "shuffle", "sampler", "worker_init_fn"} <= set(params), params
        data = torch.arange(8.0)
        by_keyword = DataLoader(data, batch_size=4, worker_init_fn=_seen)
        by_position = DataLoader(data, 4, False, None, None, 0, None, False, False, 0, _seen)
        for loader in (by_keyword, by_position):
            assert loader.batch_size == 4 and isinstance(loader.worker_init_fn, determinism._WorkerInit)
            assert loader.worker_init_fn.user_fn is _seen
            pickle.loads(pickle.dumps(loader.worker_init_fn))  # (a closure could not be)
        rebuilt = DataLoader(data, batch_size=2, worker_init_fn=by_keyword.worker_init_fn)  # (not wrapped twice)
        assert rebuilt.worker_init_fn is by_keyword.worker_init_fn
        assert [b.tolist() for b in DataLoader(data, batch_size=4, num_workers=1,
                                              multiprocessing_context="spawn")] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        determinism.unpatch_dataloader()
    assert not getattr(DataLoader.__init__, "_bitguard", False)
