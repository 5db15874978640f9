"""A stand-in for the engine's drill (`bitguard.backend.drill.drill`) in the explorer's tests.

The real drill replays both runs' recorded commands (seconds of training, and the scripts must be
on this machine); the API and browser tests of the drill's routes and panel need none of that, only
its contract: a report with `to_dict()` (the `bitguard.drill/1` document) and `exit_status`, or a
`BitguardError`. `FakeDrill` takes the place of `bitguard.backend.drills._engine_drill`, records
what it was asked, waits on a gate (so a test sees the running state) and answers `DOCUMENT` or
raises. `preamble(gate)` does that inside a `bitguard serve` subprocess (live_server's `preamble`),
gated on a file the test creates.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time

# a drill/1 document as the engine writes it for the tiny GPT's residual_add fault (one flipped bit)
DOCUMENT = {
    "schema": "bitguard.drill/1",
    "verdict": "op_pivot",
    "boundary_pivot": {"boundary": "model.probe", "step": 0, "rank": 0, "phase": "forward", "blame": "source"},
    "window": {"boundary": "model.probe", "module_type": "Probe", "phase": "forward", "call": 0, "step": 0,
               "rank": 0, "why": "source pivot: the pivot module itself"},
    "op_pivot": {
        "op": "torch.Tensor.add", "file": "/src/sample_traces/tinygpt.py", "line": 121, "function": "residual_add",
        "boundary": "model.probe", "step": 0, "rank": 0, "cause": "digest", "side_only": None,
        "index_a": 12, "index_b": 12, "modules": ["model.probe"],
        "chain": ["model.probe (Probe)", "tinygpt.py:116 in forward", "tinygpt.py:121 in residual_add",
                  "torch.Tensor.add"],
        "inputs_differ": False, "args_differ": False,
        "inputs": [{"index": 0, "differs": False,
                    "a": {"path": "[0]", "shape": [4, 16, 32], "dtype": "float32", "xor": "0123456789abcdef",
                          "pos": "1111222233334444"},
                    "b": {"path": "[0]", "shape": [4, 16, 32], "dtype": "float32", "xor": "0123456789abcdef",
                          "pos": "1111222233334444"}}],
        "outputs": [{"index": 0, "differs": True,
                     "a": {"path": "", "shape": [4, 16, 32], "dtype": "float32", "xor": "aaaabbbbccccdddd",
                           "pos": "5555666677778888"},
                     "b": {"path": "", "shape": [4, 16, 32], "dtype": "float32", "xor": "aaaabbbbccccddde",
                           "pos": "5555666677778889"}}],
        "args_a": "(<t0>, <t1>)", "args_b": "(<t0>, <t1>)", "other_side": [],
    },
    "signature": {
        "kind": "bit_flip", "reading": "one flipped bit in one element: a hardware SDC or memory fault is likely",
        "elements_differing": 1, "elements_total": 2048, "fraction": 1 / 2048, "first_indices": [[0, 3, 7]],
        "max_abs": 1.1920929e-07, "max_rel": 3.1e-08, "max_ulp": 1, "bits": {"7": 1},
        "heatmap": {"rows": 4, "cols": 8, "shape2d": [64, 32], "bin_rows": 16, "bin_cols": 4,
                    "counts": [[0, 1, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8, [0] * 8]},
    },
    "boundary_signature": None,
    "replay": {"reproduced": True, "detail": "the replayed step 0 reproduces the recorded digests up to the pivot",
               "a": {}, "b": {}},
    "records": {"a": "A/drill/step-0", "b": "B/drill/step-0"},
    "cost": {"replay_s_a": 3.1, "replay_s_b": 3.0, "ops_a": 31, "ops_b": 31},
}


class FakeReport:
    def __init__(self, document: dict, exit_status: int):
        self._document = document
        self.exit_status = exit_status

    def to_dict(self) -> dict:
        return copy.deepcopy(self._document)


class FileGate:
    """A gate another process opens by creating a file."""

    def __init__(self, path: str):
        self.path = path

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


class FakeDrill:
    """Called as `_engine_drill(dir_a, dir_b, rank, rules)`: records the call, waits for the gate, then
    answers `document` (a deep copy) or raises `error` (an exception, or a callable of the call's
    folders that makes one)."""

    def __init__(self, document: dict | None = None, exit_status: int = 0, error=None, gate=None):
        self.document = DOCUMENT if document is None else document
        self.exit_status = exit_status
        self.error = error
        self.gate = gate if gate is not None else threading.Event()
        self.calls: list[dict] = []
        self.entered = threading.Event()

    def __call__(self, dir_a: str, dir_b: str, rank, rules):
        self.calls.append({"dir_a": dir_a, "dir_b": dir_b, "rank": rank, "rules": rules})
        self.entered.set()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the fake drill's gate")
        error = self.error(dir_a, dir_b) if callable(self.error) else self.error
        if error is not None:
            raise error
        return FakeReport(self.document, self.exit_status)


def preamble(gate_path: str) -> str:
    """Python run by a `bitguard serve` subprocess before it serves: its drill is a FakeDrill gated on
    `gate_path` (see install)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (f"import sys; sys.path.insert(0, {tests!r})\n"
            f"from api import drill_fake; drill_fake.install({gate_path!r})\n")


def install(gate_path: str) -> FakeDrill:
    """The server's drill becomes a FakeDrill that waits for `gate_path` to exist. An empty gate file:
    it answers DOCUMENT; a JSON object: it answers that document instead (exit status 3 if its verdict
    is not_reproduced); other text: it fails with NotSupported(that text), as the real drill of a run
    it cannot replay."""
    from bitguard.backend import drills
    from bitguard.errors import NotSupported

    def error(_a, _b):
        text = open(gate_path).read().strip()
        if text.startswith("{"):
            fake.document = json.loads(text)
            fake.exit_status = {"op_pivot": 0, "no_difference": 1, "not_reproduced": 3}[fake.document["verdict"]]
            return None
        return NotSupported(text) if text else None

    fake = FakeDrill(gate=FileGate(gate_path), error=error)
    drills._engine_drill = fake
    return fake
