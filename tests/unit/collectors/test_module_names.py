"""Module boundary names: a module no root registers (a function made a module object at import, as
`kernels` makes transformers' apply_rotary_pos_emb from 5.25 on) is named by the call it is made in,
so one such object called from every layer gives each layer's call that layer's name."""

import duckdb
import torch

import bitguard


class Rotate(torch.nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, dims=-1)


SHARED = Rotate()  # one object, registered with no model: every layer calls it


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return SHARED(self.proj(x))


def test_a_shared_unregistered_module_is_named_by_each_layer_that_calls_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(), Layer())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", mode="full"):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    con = duckdb.connect(str(tmp_path / "run" / "rank-0.duckdb"), read_only=True)
    try:
        got = con.execute("SELECT step, boundary, count(*) FROM events WHERE phase = 'forward' AND module_type = "
                          "'Rotate' GROUP BY ALL ORDER BY ALL").fetchall()
    finally:
        con.close()
    assert got == [(s, f"{i}.<Rotate>", 1) for s in (0, 1) for i in (0, 1)], got
