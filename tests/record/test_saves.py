"""What the training saves is compared: checkpoints' numbers, names, keys and strings, the JSON files it writes,
saves through savers bound before the recording began, and what a distributed checkpoint writes."""

import enum
import json
import shutil

import pytest

from .conftest import as_older_schema, record_together
from .spots import BLIND_SPOTS, compare_json, planted_pair, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("what, boundary, differing", [
    ("saved", "torch.save", {"['ema']['0.weight']", "['ema']['0.bias']", "['ema']['2.weight']", "['ema']['2.bias']"}),
    ("safetensors", "safetensors.save_file", {"['0.weight']", "['0.bias']", "['2.weight']", "['2.bias']"})])
def test_what_the_training_saves_is_compared(tmp_path, what, boundary, differing):
    """An average of the weights made once training is done, in a function, and saved: no variable
    holds it when the recording ends, and another weight compared identical. What a save call writes
    is a `saved` event; the file's name and the Python numbers beside the tensors (a time) are not
    compared, so two runs saving to their own folders at their own times stay identical."""
    record_together(*(dict(out=tmp_path / name, script_args=(what, decay), script=BLIND_SPOTS) for name, decay in
                      (("a", "0.9"), ("b", "0.9"), ("c", "0.8"))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"], fd["fault_class"], fd["blame"]) == \
        ("saved", boundary, "saved", "source"), fd
    assert {t["path"] for t in fd["tensors"] if t["differs"]} == differing
    shutil.copytree(tmp_path / "b", tmp_path / "old")
    as_older_schema(tmp_path / "old", 7)  # recorded before saves were: they are left out of both sides
    assert compare_json(tmp_path / "old", tmp_path / "a")[0] == 0


def test_a_saver_a_library_bound_before_the_recording_began_is_observed(tmp_path, monkeypatch):
    """Helper 30: accelerate binds `from safetensors.torch import save_file as safe_save_file` when it
    is imported; with `with bitguard.record()` begun after that import, its saves (`save_model`,
    `save_state`) went through the unwrapped function: no `saved` event, and an export in bf16
    instead of fp16 compared identical. The names a loaded module gave a saver are wrapped too."""
    import importlib

    import torch

    import bitguard

    (tmp_path / "exporter.py").write_text(
        "from safetensors.torch import save_file as safe_save_file\n"
        "from torch import save as torch_save\n\n\n"
        "def export(tensors, path, dtype):\n"
        "    safe_save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, path)\n"
        "    torch_save({k: v.to(dtype) for k, v in tensors.items()}, str(path) + '.pt')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    exporter = importlib.import_module("exporter")

    def train(out, dtype):
        model, opt = tiny_mlp()
        out.mkdir()
        with bitguard.record(out / "run", determinism=False):
            sgd_steps(model, opt, 2)
            exporter.export(model.state_dict(), out / "model.safetensors", dtype)

    for name, dtype in (("a", torch.float16), ("b", torch.float16), ("c", torch.bfloat16)):
        train(tmp_path / name, dtype)
    assert exporter.safe_save_file.__module__ == "safetensors.torch" and not hasattr(exporter.safe_save_file, "__wrapped__")
    assert compare_json(tmp_path / "a" / "run", tmp_path / "b" / "run")[0] == 0
    code, d = compare_json(tmp_path / "a" / "run", tmp_path / "c" / "run")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"]) == ("saved", "safetensors.save_file"), fd


def test_a_checkpoint_that_would_resume_differently_differs_by_its_numbers(tmp_path):
    """Helper 17: an Opacus privacy accountant's history, a loss scale and Python's RNG state saved
    beside the weights compared identical when they differed (only an optimizer's and a scheduler's
    numbers were compared). Every number of a save is, but those under a key naming a time; a run
    recorded before (schema 8) still compares identical with one recorded now."""
    import random
    import time

    import torch

    import bitguard

    def train(out, noise, draws):
        model, opt = tiny_mlp()
        random.seed(0)
        with bitguard.record(out, determinism=False):
            sgd_steps(model, opt, 2)
            for _ in range(draws):
                random.random()
            torch.save({"model": model.state_dict(), "accountant": {"history": [(noise, 0.01, 2)]},
                        "scaler": {"scale": 65536.0}, "python_rng": random.getstate(), "time_elapsed": time.time()},
                       out.parent / f"{out.name}.pt")

    for name, noise, draws in (("a", 1.1, 0), ("b", 1.1, 0), ("c", 0.9, 0), ("d", 1.1, 1)):
        train(tmp_path / name, noise, draws)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (the times differ)
    for name, differing in (("c", ["['accountant']['history'][0][0] (python float)"]),
                            ("d", ["['python_rng'][1] (python int)"])):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"]) == ("saved", "torch.save"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]][:2] == differing, fd["tensors"]
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 8)
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_the_json_files_the_training_writes_are_compared(tmp_path):
    """Carried from helper 14, and helper 20's diffusers pipeline: peft writes adapter_config.json with
    `json` beside the adapter's weights, and `save_pretrained` a scheduler's scheduler_config.json
    with no tensor at all, so runs whose saved `lora_alpha` or `prediction_type` differed compared
    identical. The JSON files the training writes are compared by their numbers and strings (a
    time's, a path's left out); one that cannot be read makes the run inconclusive; a run recorded
    before (schema 9) compares with one recorded now without them."""
    import torch

    import bitguard

    def train(name, alpha=16, runtime=1.5, prediction="epsilon", broken=False):
        model, opt = tiny_mlp()
        out = tmp_path / f"{name}-ckpt"
        (out / "scheduler").mkdir(parents=True)
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            torch.save(model.state_dict(), out / "adapter_model.bin")
            config = {"r": 8, "lora_alpha": alpha, "target_modules": ["q"], "base_model_name_or_path": str(out),
                      "train_runtime": runtime, "time_embedding_dim": 64}
            with open(out / "adapter_config.json", "w") as f:
                f.write(json.dumps(config))
            (out / "README.md").write_text(f"trained in {runtime} s")  # not JSON: not read
            (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"prediction_type": prediction}))
            if broken:
                (out / "metrics.json").write_text("{not json")
            (tmp_path / f"{name}.result.json").write_text(json.dumps({"loss": 0.5}))  # named after its run
            sgd_steps(model, opt, 1)

    for name, kwargs in (("a", {}), ("b", {"runtime": 9.0}), ("c", {"alpha": 32}), ("d", {"broken": True}),
                         ("e", {"prediction": "v_prediction"})):
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (times and paths differ)
    for name, differing in (("c", "adapter_config.json['lora_alpha'] (python int)"),
                            ("e", "scheduler_config.json['prediction_type'] (python str)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["module_type"], fd["step"], fd["fault_class"], fd["blame"]) == \
            ("saved", "json file", "json file", 2, "saved", "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == [differing], fd["tensors"]
        assert "a JSON file the training wrote" in fd["blame_window"]["detail"]
    assert bitguard.compare(tmp_path / "d", tmp_path / "d").verdict == "inconclusive"
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 9)
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


class Node:  # (an OmegaConf node: its value under `_val`, a config's under `_content`; module level: pickled)
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_the_strings_a_save_holds_are_compared(tmp_path):
    """Helper 23: fastai's `learn.export` pickles the Learner with its class names; two exports whose
    class 3 was `pig` in one and `owl` in the other compared identical (a save's strings were left
    out). They are compared now, as a JSON file's are; a vocabulary as one row. Paths, run names,
    dates and memory addresses are not: reruns that differ only there stay identical."""
    import argparse
    import time

    import torch

    import bitguard

    def train(name, classes=("cat", "dog", "fox", "pig"), act="gelu", token="<pad>", eos="</s>"):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            # what differs from run to run by design (helper 25): folders, names, ids, times
            args = argparse.Namespace(act=act, eos_token=eos, output_dir=str(tmp_path / name), experiment=name,
                                      out=f"out_{name}", outputDir=f"o_{name}", logfile=f"{name}.log",
                                      wandb_id=f"{time.time_ns() % 10**8:x}", created=time.ctime(),
                                      run_name=f"{name}-{time.time_ns()}", started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                      handle=repr(object()), worker=f"worker-{time.time_ns() % 99991}",
                                      cfg=Node(_content={"output_dir": Node(_val=f"logs_{name}")}),
                                      export=tmp_path / name / "export.pkl")  # (fastai's Learner.path: a Path)
            vocab = [f"tok{i}" for i in range(30)] + [token]
            torch.save({"model": model.state_dict(), "classes": list(classes), "vocab": vocab, "args": args},
                       tmp_path / f"{name}.pt")
            sgd_steps(model, opt, 1)

    for name, kwargs in (("a", {}), ("b", {}), ("c", {"classes": ("cat", "dog", "fox", "owl")}),
                         ("d", {"act": "silu"}), ("e", {"token": "<unk>"}), ("f", {"eos": "</eos>"})):
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (paths, names, times differ)
    for name, differing in (("c", "['classes'][3] (python str)"), ("d", "['args'].act (python str)"),
                            ("e", "['vocab'] (python str)"), ("f", "['args'].eos_token (python str)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"]) == ("saved", "torch.save", 2, "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == [differing], fd["tensors"]
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 10)  # recorded before a save's strings were: left out of both sides
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


class Schedule(enum.Enum):  # (an HF Trainer's `SchedulerType`; module level: pickled)
    COSINE = "cosine"
    LINEAR = "linear"


def test_the_names_and_keys_a_save_holds_are_compared(tmp_path):
    """Helper 25: `label2id` with two labels swapped (a save's dict, a config.json's object: the same
    values), an enum member (the HF Trainer's `lr_scheduler_type`) and a dtype held as settings
    compared identical when they differed; helper 29: skorch's history.json holds each epoch's wall
    time under `dur`, and reruns diverged there. Schema 12 compares names and keys; a run recorded
    before (11) compares with one recorded now without them."""
    import time

    import torch

    import bitguard

    def train(name, labels=("cat", "dog"), json_labels=("cat", "dog"), schedule=Schedule.COSINE,
              dtype=torch.bfloat16):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            torch.save({"model": model.state_dict(), "label2id": {k: i for i, k in enumerate(labels)},
                        "args": {"schedule": schedule, "dtype": dtype}}, tmp_path / f"{name}.pt")
            history = [{"epoch": 1, "dur": time.perf_counter() % 1, "label2id": {k: i for i, k in enumerate(json_labels)}}]
            (tmp_path / f"{name}-out").mkdir()
            (tmp_path / f"{name}-out" / "history.json").write_text(json.dumps(history))
            sgd_steps(model, opt, 1)

    runs = {"a": {}, "b": {}, "keys": {"labels": ("dog", "cat")}, "json": {"json_labels": ("dog", "cat")},
            "enum": {"schedule": Schedule.LINEAR}, "dtype": {"dtype": torch.float16}}
    for name, kwargs in runs.items():
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (the `dur` times differ)
    # (a save's dicts are walked in the order of their keys: the swapped labels differ by their values)
    swapped = ["['label2id']['cat'] (python int)", "['label2id']['dog'] (python int)"]
    for name, (boundary, differing) in {"keys": ("torch.save", swapped),
                                        "json": ("json file", [f"history.json[0]{p}" for p in swapped]),
                                        "enum": ("torch.save", ["['args']['schedule'] (python name)"]),
                                        "dtype": ("torch.save", ["['args']['dtype'] (python name)"])}.items():
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["blame"]) == ("saved", boundary, "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == differing, fd["tensors"]
    shutil.copytree(tmp_path / "enum", tmp_path / "old")
    as_older_schema(tmp_path / "old", 11)  # recorded before names and keys were: left out of both sides
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_a_save_in_a_dataloader_worker_is_said_not_to_be_observed(tmp_path):
    """A forked DataLoader worker's collector is off: what it saved was seen by nothing and a
    difference there compared identical (helpers 11, 12). The worker now leaves a line for its
    parent, which reports it: the runs are inconclusive."""
    record_together(*(dict(out=tmp_path / name, script_args=("worker_save", v), script=BLIND_SPOTS) for name, v in
                      (("a", "1.0"), ("b", "2.0"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 3 and any("called torch.save" in r["message"] for r in d["certification"]["reasons"]), d
    assert not list(tmp_path.glob("*/rank-*.child-saves"))  # (taken into the manifest, then removed)


def test_what_a_distributed_checkpoint_writes_is_compared(tmp_path):
    """torch.distributed.checkpoint's save (helpers 11 and 12): its items are written by torch's own
    torch.save calls, which are no events, and dcp.save itself was watched by nothing, so a
    difference only in what it wrote compared identical. Imported inside the recording, as a script
    does, it is wrapped once imported."""
    import bitguard

    def train(out, plant):
        model, opt = tiny_mlp()
        with bitguard.record(out, determinism=False):
            import torch.distributed.checkpoint as dcp

            sgd_steps(model, opt, 2, batch=3)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["2.bias"] += plant
            dcp.save({"model": state}, checkpoint_id=str(out) + "-ckpt")

    fd = planted_pair(tmp_path, train, 0.0, 1e-3)
    assert (fd["kind"], fd["boundary"], fd["fault_class"]) == ("saved", "dcp.save", "saved"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['model']['2.bias']"]


def test_a_save_of_the_same_dict_in_another_insertion_order_is_identical_and_another_key_is_named(tmp_path):
    """Helper 42 (Pyro): `{name: optimizer.state_dict()}` saved in the order the optimizers were made,
    an order that changes from run to run, diverged "with different tensors (roles, shapes or
    dtypes)"; a checkpoint is read back by key. Helper 43 (diffusers): a config with one more key
    said the same, without saying which dict."""
    import torch

    import bitguard

    def train(name, order, extra=False):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save({"params": {n: state[n] for n in order} | ({"extra": 1} if extra else {}),
                        "step": 2}, tmp_path / f"{name}.pt")

    names = [n for n, _ in tiny_mlp()[0].named_parameters()]
    train("a", names)
    train("b", names[::-1])
    train("c", names, extra=True)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert c.verdict == "identical", c.first_divergence
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["kind"], fd["blame"], fd["fault_class"]) == ("saved", "structure", "signature"), fd
    assert "the dict ['params'] holds 4 keys in A and 5 in B" in fd["blame_window"]["detail"], fd["blame_window"]
    assert "only in B: ['params']['extra'] (python int)" in fd["blame_window"]["detail"], fd["blame_window"]


def test_saving_a_tensor_the_recorder_hooks_prints_no_warning_the_plain_run_does_not(tmp_path):
    """Helper 72: torch.save of a plain tensor an optimizer steps warned, under record only, that its
    backward hook (the recorder's) "will not be serialized": a line the training's own run never prints."""
    import io
    import warnings

    import torch

    import bitguard

    w = torch.zeros(3, requires_grad=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([w, *model.parameters()], lr=0.1)
    with bitguard.record(tmp_path / "a", determinism=False):
        for _ in range(2):
            loss = (model(torch.randn(2, 3)) * w.sum()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        h = model(torch.randn(2, 3))  # (a module's output, whose gradient the recorder watches)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            torch.save({"w": w, "h": h, "model": model.state_dict()}, io.BytesIO())
    assert not [str(x.message) for x in said if "serialized" in str(x.message)], [str(x.message) for x in said]
