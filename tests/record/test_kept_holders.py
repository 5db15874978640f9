"""An EMA the training keeps but never calls is found wherever the script holds it, not only in its
variables and their objects (helper 76: timm's ModelEmaV3 held by a class attribute, by a global of the
user's own module imported whole or by name, by a `functools.partial` hook's keywords, or in a
`collections.deque`: a changed decay compared identical, the EMA never recorded)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from .spots import ShadowEMA, compare_json, sgd_steps, tiny_mlp

HELPER = """\
_STATE = {}

def put(ema):
    _STATE["ema"] = ema

def update(model):
    _STATE["ema"].step(model)
"""

NUDGE = ".shadow_params[1].add_(1e-3)"  # (an edit of the EMA after the last step)
SCRIPTS = {  # how the script makes its EMA, updates it a step, edits it at the end; the name it is found by
    "class-attribute": ("class Registry:\n    ema = None\n\nRegistry.ema = ShadowEMA(model)\n",
                        "Registry.ema.step(model)", "Registry.ema" + NUDGE, "Registry.ema.shadow_params"),
    "class-attribute-module": ("import copy\nclass Registry:\n    ema = None\n\nRegistry.ema = copy.deepcopy(model)\n",
                               "pass", "Registry.ema[2].weight.add_(1e-3)", "Registry.ema"),
    "module-imported": ("import emaholder\nemaholder.put(ShadowEMA(model))\n",
                        "emaholder.update(model)", "emaholder._STATE['ema']" + NUDGE, "emaholder._STATE.ema.shadow_params"),
    "module-by-name": ("from emaholder import put, update\nput(ShadowEMA(model))\n", "update(model)",
                       "sys.modules['emaholder']._STATE['ema']" + NUDGE, "emaholder._STATE.ema.shadow_params"),
    "partial": ("import functools\nhook = functools.partial(lambda model, ema: ema.step(model), ema=ShadowEMA(model))\n",
                "hook(model)", "hook.keywords['ema']" + NUDGE, "hook.ema.shadow_params"),
    "deque": ("import collections\nemas = collections.deque([ShadowEMA(model)], maxlen=1)\n",
              "emas[0].step(model)", "emas[0]" + NUDGE, "emas.0.shadow_params"),
}


@pytest.mark.parametrize("holder", list(SCRIPTS))
def test_a_kept_ema_held_out_of_a_variables_reach_is_found(tmp_path, holder, monkeypatch):
    import torch

    import bitguard

    make, step, edit, name = SCRIPTS[holder]
    (tmp_path / "emaholder.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("import sys\nmodel, opt = tiny_mlp()\n" + make + textwrap.dedent(f"""\
        with bitguard.record(OUT, determinism=False):
            for _ in range(3):
                sgd_steps(model, opt, 1)
                {step}
            if EDIT:
                with torch.no_grad():
                    {edit}
        """))
    for run, edited in (("a", False), ("b", False), ("c", True)):
        sys.modules.pop("emaholder", None)  # (each run its own module state, as each process has)
        exec(compile(script.read_text(), str(script), "exec"),
             {"tiny_mlp": tiny_mlp, "ShadowEMA": ShadowEMA, "sgd_steps": sgd_steps, "bitguard": bitguard, "torch": torch,
              "OUT": tmp_path / run, "EDIT": edited, "__name__": "__main__"})
    sys.modules.pop("emaholder", None)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"].partition("#")[0]) == ("final", name), fd
