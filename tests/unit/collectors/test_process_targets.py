"""Which processes a training starts are reported as unobserved (collectors/processes.py): environments
stepped in worker processes are not (helper 62: torchrl's ParallelEnv made every two identical runs
inconclusive, with advice to launch them with torchrun); a target that may train still is."""

from __future__ import annotations

import types

import pytest

from bitguard.collectors.processes import ProcessWatch


def _target(module: str, name: str):
    def target():
        pass
    target.__module__, target.__qualname__ = module, name
    return target


@pytest.mark.parametrize("module, name, reported", [
    ("torchrl.envs.batched_envs", "_run_worker_pipe_shared_mem", False),
    ("torchrl.envs.batched_envs", "_run_worker_pipe_direct", False),
    ("gymnasium.vector.async_vector_env", "_async_worker", False),
    ("stable_baselines3.common.vec_env.subproc_vec_env", "_worker", False),
    ("torch.utils.data._utils.worker", "_worker_loop", False),
    ("__main__", "train", True),
])
def test_environment_workers_are_helpers_and_a_training_is_not(module, name, reported):
    said = []
    ProcessWatch(said.append, lambda: None).started(types.SimpleNamespace(_target=_target(module, name), _args=()))
    assert bool(said) == reported, said
