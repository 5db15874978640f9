"""The JSON files the training writes (collectors/beside.py) and the keys that name a time (bitguard/timed.py)."""

from __future__ import annotations

import builtins
import io
import json
import pathlib

import pytest

from bitguard.collectors import beside, saved
from bitguard.collectors.beside import JsonWrites, json_values
from bitguard.schema import KEYS_MARK
from bitguard.timed import clock_of, compared, timed_before_10


def _values(value, keys: bool = False) -> dict:
    """A JSON value's rows, {path: number or string}; the rows of its objects' keys (`keys`) too."""
    pairs, why = json_values(value)
    assert why is None
    strings = {saved.string_tensor(s).item(): s for s in ("silu", "q", "v", "", "adamw")}
    return {path: (strings[t.item()] if path.endswith("(python str)") else t.tolist()) for path, t in pairs
            if keys or not path.endswith(KEYS_MARK)}


def test_a_json_value_s_numbers_and_strings_are_taken_but_times_and_places():
    got = _values({"r": 8, "lora_alpha": 16.0, "use_rslora": False, "act_fn": "silu", "target_modules": ["q", "v"],
                   "output_dir": "out", "_name_or_path": "gpt2", "base": "/tmp/run-a/ckpt", "url": "x",
                   "train_runtime": 1.5, "saved_at": "2026-12-05", "time_embedding_dim": 64, "dropout": None,
                   "decay_at": 200, "started_at": 1733400000.5, "step_times": [0.1, 0.2], "clip_at": 0.5,
                   "log_history": [{"loss": 0.5, "train_samples_per_second": 9.0}], "state": list(range(20)), "e": ""})
    assert got == {"['r'] (python int)": 8, "['lora_alpha'] (python float)": 16.0, "['use_rslora'] (python bool)": 0,
                   "['act_fn'] (python str)": "silu", "['target_modules'][0] (python str)": "q",
                   "['target_modules'][1] (python str)": "v", "['time_embedding_dim'] (python int)": 64,
                   "['decay_at'] (python int)": 200, "['clip_at'] (python float)": 0.5,
                   "['log_history'][0]['loss'] (python float)": 0.5, "['state'] (python int)": list(range(20)),
                   "['e'] (python str)": ""}
    assert list(got) == sorted(got, key=list(got).index)  # (in the file's order)


def test_a_json_value_too_big_is_marked(monkeypatch):
    monkeypatch.setattr(beside, "MAX_VALUES", 3)
    assert "more than 3 values" in json_values([[1], [2], [3], [4]])[1]


@pytest.mark.parametrize("key, clock, before", [
    ("train_runtime", "duration", True), ("saved_at", "instant", True), ("train_samples_per_second", "duration", True),
    ("step_time_s", "duration", True), ("timestamp_start", "instant", True), ("tokens_per_sec", "duration", True),
    ("decay_at", "instant", True), ("repeat_times", "count", True), ("time_embedding_dim", None, True),
    ("time_cond_proj_dim", None, True), ("lr", None, False)])
def test_a_key_names_a_time_by_its_last_word(key, clock, before):
    assert (clock_of(f"['{key}']"), clock_of(f".{key}"), timed_before_10(f"['{key}']")) == (clock, clock, before)
    assert timed_before_10(f"['{key}'][0]['x'] (python int)") == before  # (a number below it, before: left out)


def test_a_number_under_a_point_in_time_is_compared_when_it_is_no_timestamp():
    """Helper 21: ignite's user scheduler state `{"decay_at": 200}` is a step, not a time, and a
    checkpoint that would resume at another step compared identical; helper 22: `clip_at: 0.5` too."""
    assert [compared("instant", v) for v in (100, -3, True, 1733400000, 0.5, 1733400000.5)] == \
        [True, True, True, False, True, False]
    assert [compared("count", v) for v in (3, 0.12)] == [True, False]
    assert not compared("duration", 100) and compared(None, 1.5) and not compared(None, 1733400000.5)


def test_the_json_files_the_training_opens_for_writing_are_read_once_closed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    on = [True]
    writes = JsonWrites(lambda: on[0], str(run), lambda frame: frame.f_code.co_name).install()
    try:
        assert open is io.open and open is not writes._patches[0].original  # (one wrapper: `open is io.open` holds)
        def save_config():
            with open(tmp_path / "config.json", "w") as f:
                json.dump({"lr": 0.1}, f)
                assert writes.written() == []  # still open: read once closed
        save_config()
        log = io.open(str(tmp_path / "log.json"), "a")  # (io.open, as pathlib's write_text uses)
        log.write("[1, 2")
        (tmp_path / "state.json").write_text("{\"step\": 3}")
        (run / "manifest.json").write_text("{}")  # the run directory's: not the training's
        (tmp_path / "notes.txt").write_text("{}")
        (tmp_path / "gone.json").write_text("{}")
        (tmp_path / "gone.json").unlink()  # removed once closed: read as it is removed
        open(tmp_path / "config.json").close()  # read, not written
        on[0] = False
        (tmp_path / "paused.json").write_text("{}")  # written while the collector does not record
        on[0] = True
        assert [(name, value, where) for name, value, _, where, _ in writes.written()] == [
            ("config.json", {"lr": 0.1}, "save_config"), ("state.json", {"step": 3}, "open"),  # (Path.open's)
            ("gone.json", {}, "open")]
        assert writes.noted and writes.written() == []  # the log is still open
        (tmp_path / "config.json").write_text("{\"lr\": 0.2}")  # written again: read again
        ended = writes.written(ended=True)  # the recording ends: every file noted, open or not
        assert not writes.noted
    finally:
        writes.remove()
        log.close()
    assert [(name, value) for name, value, *_ in ended] == [("log.json", None), ("config.json", {"lr": 0.2})]
    assert "could not be read as JSON" in ended[0][2]  # (the log, cut short)
    assert builtins.open is io.open and open is builtins.open  # given back
    assert pathlib.Path(tmp_path / "x.json").write_text("{}") and not writes.noted  # removed: nothing noted


def test_a_json_file_written_atomically_or_left_open_or_by_a_child_is_not_lost(tmp_path):
    """Helper 22: a JSON file written to a temporary name and renamed (`os.replace`), one left open
    when the recording ends (its buffer not yet flushed), and one a forked child (a DataLoader
    worker) writes were not compared: the first two compared identical when they differed or
    inconclusive when they did not, the last identical."""
    import os

    children, originals = [], (os.replace, os.rename)
    active = [True]
    writes = JsonWrites(lambda: active[0], str(tmp_path / "run"), lambda frame: None, children.append).install()
    try:
        with open(tmp_path / "metrics.json.tmp", "w") as f:
            json.dump({"loss": 0.5}, f)
        os.replace(tmp_path / "metrics.json.tmp", tmp_path / "metrics.json")
        with open(tmp_path / "tmp_state.json", "w") as f:
            json.dump({"step": 1}, f)
        os.rename(tmp_path / "tmp_state.json", tmp_path / "STATE.JSON")  # (any case)
        kept = open(tmp_path / "open.json", "w")
        kept.write('{"epoch": 2}')  # (buffered: not on disk yet)
        active[0] = False  # a forked child: its collector is off
        (tmp_path / "worker.json").write_text("{}")
        active[0] = True
        ended = writes.written(ended=True)
    finally:
        writes.remove()
        kept.close()
    assert [(name, value) for name, value, *_ in ended] == [("metrics.json", {"loss": 0.5}), ("STATE.JSON", {"step": 1}),
                                                           ("open.json", {"epoch": 2})]
    assert children == ["worker.json"]
    assert os.replace is originals[0] and os.rename is originals[1]  # given back


def test_a_json_file_removed_once_written_is_read_as_it_is_removed(tmp_path):
    """Helper 67: pytorch-tabnet's save_model writes model_params.json into a folder, zips the folder and removes
    it; the file was gone at the step's end, left out as a temporary one, and two models saved with other
    parameters compared identical. A noted file removed once closed (os.remove, os.unlink, shutil.rmtree of its
    folder) is read as it goes; one still open as it is removed is not read then."""
    import os
    import shutil

    originals = (os.remove, os.unlink, shutil.rmtree)
    writes = JsonWrites(lambda: True, str(tmp_path / "run"), lambda frame: None).install()
    try:
        (tmp_path / "model").mkdir()
        with open(tmp_path / "model" / "model_params.json", "w") as f:
            json.dump({"n_shared": 2}, f)
        shutil.make_archive(str(tmp_path / "model"), "zip", tmp_path / "model")
        shutil.rmtree(tmp_path / "model")
        (tmp_path / "a.json").write_text('{"a": 1}')
        os.remove(tmp_path / "a.json")
        still = open(tmp_path / "b.json", "w")
        still.write('{"b": 2}')
        os.unlink(tmp_path / "b.json")  # (still open: nothing on disk to read)
        still.close()
        found = writes.written()
    finally:
        writes.remove()
    assert [(name, value) for name, value, *_ in found] == [("model_params.json", {"n_shared": 2}), ("a.json", {"a": 1})]
    assert (os.remove, os.unlink, shutil.rmtree) == originals  # given back


def test_what_helper_22_found_names_a_time_or_a_run_and_what_it_does_not():
    """Helper 22: a nested key was read whole as the last key (`['speed_perturb']['min']` as a time),
    a section named `runtime` hid its seed and optimizer, and stamps and ids under plain keys (`t`,
    `run_id`, `created`) made identical reruns differ."""
    got = _values({"augment": {"speed_perturb": {"min": 0.9}}, "runtime": {"seed": 0, "optimizer": "adamw"},
                   "t": 1733400000.25, "nanos": 1733400000123456789, "run_id": "0f3e9a1c2b4d5e6f7a8b9c0d",
                   "id": "3b241101-e2bb-4255-8caf-4136c566a962", "created": "2026-12-05T22:56:05",
                   "logged": "20261205_225605", "run_name": "exp-a", "act": "silu", "step_times": [0.1, 0.2]})
    assert got == {"['augment']['speed_perturb']['min'] (python float)": 0.9, "['runtime']['seed'] (python int)": 0,
                   "['runtime']['optimizer'] (python str)": "adamw", "['act'] (python str)": "silu"}


def test_a_json_file_that_is_no_regular_file_is_not_read_and_json_lines_are(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.json")  # (a log shipper's pipe: opening it to read would block)
    (tmp_path / "scalars.json").write_text('{"lr": 0.1, "time": 3.2}\n{"lr": 0.2, "time": 3.4}\n')
    writes = JsonWrites(lambda: True, str(tmp_path / "run"), lambda frame: None)
    for name in ("pipe.json", "scalars.json"):
        writes._note(str(tmp_path / name), None, __import__("sys")._getframe())
    assert [(name, value) for name, value, *_ in writes.written()] == [
        ("scalars.json", [{"lr": 0.1, "time": 3.2}, {"lr": 0.2, "time": 3.4}])]


def test_the_training_s_own_json_files_in_the_run_directory_are_read_but_bitguard_s(tmp_path):
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    writes = JsonWrites(lambda: True, str(run), lambda frame: None)
    for path in (run / "manifest.json", run / "rank-0.json", run / "out" / "metrics.json", run / "metrics.json"):
        path.write_text("{}")
        writes._note(str(path), None, __import__("sys")._getframe())
    assert [name for name, *_ in writes.written()] == ["metrics.json", "metrics.json"]


def test_an_object_s_keys_are_taken_and_a_duration_s_shorter_names_are_times():
    """A config.json's `label2id` with two labels swapped had the same values in the order of the file
    (schema 12: its keys are a row; an object is taken in the order of its keys now); skorch's history `dur` and SB3's `time/fps` are wall-clock times, not compared (helpers 27-29)."""
    got = _values({"label2id": {"cat": 0, "dog": 1}, "history": [{"epoch": 1, "dur": 0.52}], "time/fps": 311,
                   "time_taken": 2.5, "output_dir": {"x": 1}}, keys=True)
    swapped = _values({"label2id": {"dog": 0, "cat": 1}, "history": [{"epoch": 1, "dur": 0.61}], "time/fps": 290,
                       "time_taken": 2.9, "output_dir": {"x": 1}}, keys=True)
    assert set(got) == {KEYS_MARK, f"['label2id']{KEYS_MARK}", "['label2id']['cat'] (python int)",
                        "['label2id']['dog'] (python int)", f"['history'][0]{KEYS_MARK}",
                        "['history'][0]['epoch'] (python int)", "['output_dir']['x'] (python int)"}
    # (taken in the order of the keys: the swapped labels differ by their values, the keys are the same)
    assert got[f"['label2id']{KEYS_MARK}"] == swapped[f"['label2id']{KEYS_MARK}"]
    assert got["['label2id']['cat'] (python int)"] != swapped["['label2id']['cat'] (python int)"]
    assert list(_values({"b": 1, "a": 2}, keys=True)) == list(_values({"a": 2, "b": 1}, keys=True))  # (helper 42)
    assert _values({"a": 1}, keys=True)[KEYS_MARK] != _values({"a": 1, "b": 2}, keys=True)[KEYS_MARK]
    # a key naming a place is no key of its dict (helper 43: diffusers adds `_name_or_path` to a loaded config)
    assert _values({"a": 1}, keys=True)[KEYS_MARK] == _values({"a": 1, "_name_or_path": "ckpt"}, keys=True)[KEYS_MARK]
    assert {p: v for p, v in got.items() if "label2id" not in p} == {p: v for p, v in swapped.items() if "label2id" not in p}


def test_a_json_file_in_a_folder_renamed_is_read_where_it_went(tmp_path):
    """Helper 67: a checkpoint written in a temporary folder, then the folder renamed (an atomic checkpoint): the
    file noted was gone from where it was written, and left out."""
    import os

    writes = JsonWrites(lambda: True, str(tmp_path / "run"), lambda frame: None).install()
    try:
        (tmp_path / "ckpt.tmp").mkdir()
        with open(tmp_path / "ckpt.tmp" / "config.json", "w") as f:
            json.dump({"lr": 0.1}, f)
        os.rename(tmp_path / "ckpt.tmp", tmp_path / "ckpt-1")
        found = writes.written()
    finally:
        writes.remove()
    assert [(name, value) for name, value, *_ in found] == [("config.json", {"lr": 0.1})]
