"""The Hugging Face Trainer (a Llama from its config, 4 steps on CPU): the stacks tier's four
claims (see harness.py). The script never imports bitguard; it is recorded as
`bitguard record --out D -- python hf_trainer.py`."""

import pytest

from . import harness as h

FAULT = {"STACK_FAULT": "module:step=2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    got = h.together({"plain": lambda: h.plain("hf_trainer.py", tmp),
                      "a": lambda: h.recorded("hf_trainer.py", tmp / "a"),
                      "b": lambda: h.recorded("hf_trainer.py", tmp / "b"),
                      "fault": lambda: h.recorded("hf_trainer.py", tmp / "fault", env=FAULT)})
    plain, (a, ra), (b, _), (fault, _) = (got[k] for k in ("plain", "a", "b", "fault"))
    return {"plain": plain, "a": a, "ra": ra, "b": b, "fault": fault}


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])
    m = h.manifest(runs["a"])
    assert m["status"] == "complete" and not m["collector_errors"] and m["steps_completed"] == 4
    import accelerate
    import transformers

    # what the script imported is in the manifest: an upgrade of either is the first thing compare says
    assert m["versions"]["transformers"] == transformers.__version__
    assert m["versions"]["accelerate"] == accelerate.__version__


def test_rerun_identical(runs):
    h.assert_identical(runs["a"], runs["b"])


def test_fault_localized(runs):
    h.assert_compare_localizes(runs["a"], runs["fault"], step=2, rank=0, boundary="model.layers.1.mlp", blame="source",
                               fault_class="forward")
