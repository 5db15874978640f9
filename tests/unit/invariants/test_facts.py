"""step_facts from rows shaped like the tables, and facts_from_run on a real run directory."""

import json

import pytest

from bitguard.backend.invariants.facts import NO_API_EVENTS, facts_from_run, step_facts
from bitguard.errors import BadInput
from invariant_loops import Loop, f32_bits, write_run


def test_one_step_rows_become_grads_updates_batch_and_loss():
    api = [{"step": 3, "rank": 1, "ord": 9, "kind": "optimizer_step", "target": "SGD#0",
            "value": json.dumps({"groups": [{"lr": 0.1, "params": ["w"]}]}), "t_ns": 2},
           {"step": 3, "rank": 1, "ord": 7, "kind": "params", "target": "M",
            "value": json.dumps({"w": {"requires_grad": True, "dtype": "float32", "xor": "00000000000000ff",
                                       "storage": 1}}), "t_ns": 1}]
    events = [{"seq": 0, "rank": 1, "world_size": 2, "step": 3, "phase": "data", "kind": "batch", "boundary": "M",
               "depth": 0},
              {"seq": 1, "rank": 1, "world_size": 2, "step": 3, "phase": "forward", "kind": "module",
               "boundary": "M", "depth": 0},
              {"seq": 2, "rank": 1, "world_size": 2, "step": 3, "phase": "backward", "kind": "grad", "boundary": "w",
               "depth": 0},
              {"seq": 3, "rank": 1, "world_size": 2, "step": 3, "phase": "optimizer", "kind": "step",
               "boundary": "w", "depth": 0}]
    t = lambda seq, role, xor, pos=1, **kw: {"seq": seq, "role": role, "idx": 0, "xor": xor, "pos": pos,  # noqa: E731
                                            "dtype": "float32", "shape": [4], "unobserved": None, **kw}
    tensors = [t(0, "input", 5, 6), {**t(0, "rng", 99, 98), "idx": 0},
               t(1, "output", f32_bits(2.5), shape=[]),
               t(2, "grad_input", 11, 12), t(2, "grad", 13, 14),
               t(3, "param", 0x1ff), t(3, "grad", 0, 0)]
    f = step_facts(api, events, tensors)
    assert (f.step, f.rank, f.world_size, f.training_step) == (3, 1, 2, True)
    assert [a["ord"] for a in f.api] == [7, 9] and f.api[1]["value"]["groups"][0]["lr"] == 0.1
    assert f.grads == {"w": {"grad_input": (11, 12), "grad": (13, 14)}}
    assert f.updates == {"w": (0xff, 0x1ff)}
    assert f.batch == (5, 6) and f.batches == [(5, 6)], "the RNG row is not part of the batch"
    assert f.losses == [2.5]
    assert f.grad_zero == {"w": True}


def test_rows_of_two_steps_are_refused():
    rows = [{"step": 0, "rank": 0, "ord": 0, "kind": "zero_grad", "value": "{}"},
            {"step": 1, "rank": 0, "ord": 1, "kind": "zero_grad", "value": "{}"}]
    with pytest.raises(ValueError, match="one step"):
        step_facts(rows, [], [])


def test_a_run_directory_reads_as_the_rows_it_was_written_from(tmp_path):
    loop = Loop(world_size=2, accum=2)
    read = facts_from_run(write_run(tmp_path, loop))
    direct = loop.run()
    assert sorted(read) == [0, 1]
    for rank in (0, 1):
        assert [f.step for f in read[rank]] == [f.step for f in direct[rank]]
        for a, b in zip(read[rank], direct[rank]):
            assert (a.grads, a.updates, a.batches, a.losses, a.training_step) == \
                   (b.grads, b.updates, b.batches, b.losses, b.training_step)
            assert [x["value"] for x in a.api] == [x["value"] for x in b.api]


def test_a_run_without_api_events_is_bad_input_not_an_empty_pass(tmp_path):
    run = write_run(tmp_path, Loop(), api_events=False)
    with pytest.raises(BadInput, match="no API events recorded"):
        facts_from_run(run)
    assert "re-record" in NO_API_EVENTS


def test_the_parameters_of_every_root_the_step_s_optimizers_step_are_the_step_s():
    """Helper 79: a loss with a weight and an optimizer of its own (pytorch-metric-learning's ArcFaceLoss): only
    the trained model's parameters were the step's, and its weight frozen mid-run broke no invariant. A root no
    optimizer steps (an EMA, a teacher) stays out, and a name the trained root takes stays its own."""
    def row(ord_, kind, target, value):
        return {"step": 1, "rank": 0, "ord": ord_, "kind": kind, "target": target, "value": json.dumps(value), "t_ns": ord_}

    p = {"requires_grad": True, "dtype": "float32"}
    api = [row(1, "params", "Teacher", {"w": {**p, "dtype": "float16"}, "t": p}),
           row(2, "params", "Model", {"w": p, "b": p}),
           row(3, "params", "Loss", {"W": {**p, "requires_grad": False}, "w": {**p, "dtype": "bfloat16"}}),
           row(4, "optimizer_step", "Adam#0", {"groups": [{"lr": 0.1, "params": ["w", "b"]}]}),
           row(5, "optimizer_step", "SGD#0", {"groups": [{"lr": 0.1, "params": ["W"]}]})]
    f = step_facts(api, [], [])
    assert f.params == {"w": p, "b": p, "W": {**p, "requires_grad": False}}
