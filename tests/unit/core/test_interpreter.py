"""`bitguard record -- python SCRIPT` runs under an interpreter that can import bitguard (bitguard/cli.py):
a bare `python` on PATH that cannot (no venv activated) is replaced by the one bitguard runs under,
and said so; an interpreter given by its path is used as given, or refused."""

from __future__ import annotations

import sys

import pytest

from bitguard import cli
from bitguard.errors import BadInput


def _python_without_bitguard(folder, name="python"):
    folder.mkdir(exist_ok=True)
    fake = folder / name
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # isolated: no site-packages, no bitguard
    fake.chmod(0o755)
    return fake


def test_a_bare_python_on_path_without_bitguard_is_replaced_by_bitguards_own(tmp_path, monkeypatch, capsys):
    _python_without_bitguard(tmp_path / "bin", "python3")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert cli._interpreter("python3") == sys.executable
    err = capsys.readouterr().err
    assert "'python3' on PATH" in err and "cannot import bitguard" in err and sys.executable in err


def test_a_bare_python_not_on_path_is_bitguards_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli._interpreter("python") == sys.executable
    assert "not on PATH" in capsys.readouterr().err


def test_a_bare_python_on_path_with_bitguard_is_kept(tmp_path, monkeypatch, capsys):
    # a wrapper, not a symlink: a symlinked venv python finds no pyvenv.cfg beside it, so it is the base
    # interpreter (which in the checkout's root finds the bitguard/ folder, but not bitguard.collectors)
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert cli._interpreter("python") == str(tmp_path / "bin" / "python")
    assert capsys.readouterr().err == ""


def test_bitguards_own_interpreter_is_not_started_to_be_probed(tmp_path, monkeypatch):
    """The interpreter bitguard runs under, given by its path (as torchrun's and the tests' launches
    give it), imports bitguard: a second Python (0.4 s) is not started to find out; a symlink to it
    (a venv's python is one) is another interpreter, probed."""
    started = []
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: started.append(cmd) or type("P", (), {"returncode": 1}))
    assert cli._interpreter(sys.executable) == sys.executable and started == []
    link = tmp_path / "python"
    link.symlink_to(sys.executable)
    with pytest.raises(BadInput, match="cannot import bitguard"):
        cli._interpreter(str(link))
    assert [cmd[0] for cmd in started] == [str(link)]


def test_a_python_given_by_its_path_is_used_as_given_or_refused(tmp_path):
    fake = _python_without_bitguard(tmp_path / "bin")
    with pytest.raises(BadInput, match="cannot import bitguard"):
        cli._interpreter(str(fake))
    with pytest.raises(BadInput, match="not found"):
        cli._interpreter(str(tmp_path / "nowhere" / "python"))


@pytest.mark.parametrize("launcher", [["accelerate", "launch", "--num_processes", "2"], ["torchrun", "--standalone"]])
def test_a_launcher_after_the_dashes_is_refused_with_the_form_that_works(tmp_path, capsys, launcher):
    out = tmp_path / "run"
    assert cli.main(["record", "--out", str(out), "--", *launcher, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    name = " ".join(launcher[:2]) if launcher[0] == "accelerate" else launcher[0]
    assert len(err.splitlines()) == 1 and f"'{name} [OPTIONS] -m bitguard record --out {out} -- SCRIPT" in err, err
    assert not out.exists()


def test_a_python_that_finds_only_the_checkouts_bitguard_folder_is_replaced(tmp_path, monkeypatch, capsys):
    """In the repository's root a python without bitguard installed imports the bitguard/ folder
    itself; the recording would then fail on bitguard.collectors (found on a new user's first try)."""
    root = tmp_path / "checkout"
    (root / "bitguard").mkdir(parents=True)
    (root / "bitguard" / "__init__.py").write_text("")
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # no site-packages, but the current folder
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.chdir(root)
    assert cli._interpreter("python") == sys.executable
    assert "cannot import bitguard" in capsys.readouterr().err


@pytest.mark.parametrize("launcher", [["fabric", "run"], ["lightning", "run", "model"]])
def test_a_launcher_without_a_module_option_is_not_told_to_take_one(tmp_path, capsys, launcher):
    """helper 13: `fabric run` was told to run `fabric [OPTIONS] -m bitguard record ...`, which it refuses."""
    out = tmp_path / "run"
    assert cli.main(["record", "--out", str(out), "--", *launcher, "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "-m bitguard" not in err and "bitguard.record(" in err, err
    assert not out.exists()


def test_python_options_given_as_two_words_keep_their_value(tmp_path, monkeypatch):
    """Helper 16: `-- python -W ignore train.py` took `ignore` for the script (exit 2, "script ignore not
    found"); `-W`, `-X` and `--check-hash-based-pycs` take the next word as their value."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    launched = []
    monkeypatch.setattr(cli, "_launch", lambda child, out, command, **options: launched.append(child) or 0)
    assert cli.main(["record", "--out", str(tmp_path / "run"), "--", sys.executable, "-W", "ignore", "-X", "dev",
                     "-u", str(script), "--lr", "1"]) == 0
    child = launched[0]
    assert child[1:6] == ["-W", "ignore", "-X", "dev", "-u"] and child[-3:] == [str(script), "--lr", "1"]


@pytest.mark.parametrize("options, given, seed", [([], None, "0"), ([], "7", "7"), (["--no-determinism"], None, None)])
def test_the_script_starts_with_python_s_string_hashes_fixed(tmp_path, monkeypatch, options, given, seed):
    """Helper 22: peft writes `target_modules` as `list(set(...))`, whose order follows Python's
    string hashing, random per process: identical reruns differed in adapter_config.json. With the
    determinism controls the script starts with PYTHONHASHSEED=0, unless the user set it."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    envs = []

    class Child:
        def wait(self):
            return 0

    popen = cli.subprocess.Popen
    monkeypatch.setattr(cli.subprocess, "Popen", lambda child, env=None, **kw: envs.append(env) or Child()
                        if env is not None else popen(child, **kw))
    if given is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", given)
    cli.main(["record", "--out", str(tmp_path / "run"), *options, "--", sys.executable, str(script)])
    assert envs[0].get("PYTHONHASHSEED") == seed
