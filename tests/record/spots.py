"""What the record tier's files on blind spots share: a tiny seeded MLP and its SGD steps, a compare
in JSON, a planted pair of runs, a run's events, a shadow EMA as diffusers keeps one."""

from incli import cli_json

from .conftest import SCRIPTS

BLIND_SPOTS = SCRIPTS / "blind_spots.py"


def tiny_mlp():
    """A tiny MLP and its SGD, seeded: the in-process recordings' model."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def sgd_steps(model, opt, steps: int, batch: int = 2, clip: float | None = None) -> None:
    """`steps` steps of `tiny_mlp()`'s model on random batches (`clip`: its gradients' norm clipped first)."""
    import torch

    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(batch, 4)).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def compare_json(a, b) -> tuple[int, dict]:
    return cli_json("compare", "--json", a, b)


def planted_pair(tmp_path, make, same, changed) -> dict:
    """Runs a and b made by `make(path, same)`, c by `make(path, changed)`: a and b compare
    identical, a and c diverge; the first divergence of a against c."""
    for name, value in (("a", same), ("b", same), ("c", changed)):
        make(tmp_path / name, value)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 1, d
    return d["first_divergence"]


class ShadowEMA:
    """diffusers' EMAModel in small: a list of shadow tensors updated in place, which `to()`
    replaces by a new list (as an EMA offloaded between steps is moved at every step)."""

    def __init__(self, model):
        self.shadow_params = [p.detach().clone() for p in model.parameters()]

    def step(self, model):
        import torch

        with torch.no_grad():
            for s, p in zip(self.shadow_params, model.parameters()):
                s.lerp_(p, 0.1)

    def to(self, dtype):
        self.shadow_params = [s.to(dtype) for s in self.shadow_params]


def run_events(run_dir) -> list[dict]:
    from bitguard.backend.ingest import load_rank, open_run

    return load_rank(open_run(run_dir), 0)[0].to_dicts()
