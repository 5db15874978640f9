"""The JSON files written beside the saves (collectors/beside.py)."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from bitguard.collectors import beside
from bitguard.collectors.beside import Destinations, destination


class _Writer:
    path = Path("/ckpt/step-10")


def test_where_a_save_writes_is_read_from_its_arguments(tmp_path):
    with open(tmp_path / "f.pt", "wb") as f:
        assert destination((None, f), {}) == str(tmp_path / "f.pt")  # an open file: its name
    assert destination((None, tmp_path / "m.pt"), {}) == str(tmp_path / "m.pt")
    assert destination((None,), {"filename": "a.safetensors"}) == "a.safetensors"
    assert destination((None,), {"checkpoint_id": "ckpt"}) == "ckpt"
    assert destination((None,), {"storage_writer": _Writer()}) == "/ckpt/step-10"  # dcp's writer
    assert destination((None, io.BytesIO()), {}) is None  # to memory
    assert destination((None, {"format": "pt"}), {}) is None  # safetensors' `save(tensors, metadata)`
    assert destination((None,), {}) is None


def test_the_json_files_written_since_the_recording_began_beside_the_saves_are_read(tmp_path, monkeypatch):
    old = tmp_path / "ckpt" / "old.json"
    old.parent.mkdir()
    old.write_text("{}")
    past = time.time_ns() - 10**10
    os.utime(old, ns=(past, past))  # there before the recording: not read
    found = Destinations(time.time_ns() - 10**9)
    (tmp_path / "ckpt" / "b.json").write_text(json.dumps({"lr": 0.1}))
    (tmp_path / "ckpt" / "a.json").write_text("[1, 2")  # broken: said why
    (tmp_path / "ckpt" / "w.json").write_text("{}")  # a save's own file (torch.save to a .json name)
    (tmp_path / "ckpt" / "notes.txt").write_text("{}")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "meta.json").write_text("{\"step\": 3}")
    found.note(str(tmp_path / "ckpt" / "w.json"))
    found.note(str(tmp_path / "ckpt" / "model.pt"))
    found.note(str(tmp_path / "dcp"))  # a distributed checkpoint's folder: its own files
    found.note(None)
    files = found.json_files()
    assert [(name, value) for name, value, _ in files] == [("a.json", None), ("b.json", {"lr": 0.1}),
                                                           ("meta.json", {"step": 3})]
    assert "could not be read as JSON" in files[0][2] and files[1][2] is None
    monkeypatch.setattr(beside, "MAX_FILES", 1)
    names = [name for name, _, why in found.json_files()]
    assert names == ["*.json", "a.json", "meta.json"]  # the rest of a folder's files: said to be left out
    monkeypatch.setattr(beside, "MAX_BYTES", 1)
    assert "bigger than" in found.json_files()[-1][2]
