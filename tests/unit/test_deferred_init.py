"""Deferred construction (#49 item 1): a model built on the meta device, each parameter's initial values from its
own seeded calls, so a parameter made alone (a ZeRO-3 rank keeping its slice) equals the one a whole materialisation
makes, for any nn.Module family, and a ZeRO-3 sharder over a deferred model trains as one process does."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from flowtrain.parallel import DistContext, sum_loss
from flowtrain.parallel.deferred import Materializer, deferred, is_deferred, materialize, set_target
from flowtrain.parallel.zero.sharder import ZeroSharder
from flowtrain.train.models.tabular import TabularMLP

FAMILIES = {
    "wide and deep": lambda: TabularMLP(5, [3, 7, 40], hidden=(32, 16), dropout=0.1),
    "padding_idx and batch norm": lambda: nn.Sequential(nn.Embedding(9, 4, padding_idx=0), nn.Flatten(),
                                                        nn.Linear(8, 6), nn.BatchNorm1d(6), nn.LayerNorm(6)),
    "attention": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
    "lstm (weak references to its parameters)": lambda: nn.LSTM(3, 4, num_layers=2),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_parameter_made_alone_equals_the_whole_materialisation(name):
    build = FAMILIES[name]
    whole = materialize(deferred(build, seed=7))
    assert not is_deferred(whole) and all(p.device.type == "cpu" for p in whole.parameters())
    alone = deferred(build, seed=7)
    assert is_deferred(alone) and all(p.device.type == "meta" for p in alone.parameters())
    source = Materializer(alone)
    names = [n for n, _ in alone.named_parameters()]
    params = dict(alone.named_parameters())
    for n in reversed(names):  # in another order than construction: each from its own seeded calls
        assert torch.equal(source.value(params[n]), whole.state_dict()[n]), n
    again = materialize(deferred(build, seed=7))
    for k, v in whole.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k  # the same seed, the same values
    other = materialize(deferred(build, seed=8))
    assert any(not torch.equal(v, other.state_dict()[k]) for k, v in whole.state_dict().items()
               if v.is_floating_point() and v.numel() > 4)
    # initialisers ran: not the meta device's garbage, not all zeros
    assert all(torch.isfinite(v).all() for v in whole.state_dict().values() if v.is_floating_point())


def test_constructor_writes_are_replayed():
    """What a constructor writes after creating a parameter (a zeroed head, a padding row, a loaded state)."""
    state = {"weight": torch.full((2, 3), 0.5), "bias": torch.tensor([1.0, -1.0])}

    def build():
        model = nn.Sequential(nn.Linear(3, 2), nn.Embedding(4, 2, padding_idx=1))
        model[0].load_state_dict(state)  # a fitted part loaded into the meta parameters
        nn.init.zeros_(model[1].weight[3])
        return model
    model = materialize(deferred(build, seed=1))
    assert torch.equal(model[0].weight, state["weight"]) and torch.equal(model[0].bias, state["bias"])
    assert torch.equal(model[1].weight[1], torch.zeros(2)) and torch.equal(model[1].weight[3], torch.zeros(2))
    assert model[1].weight[0].abs().sum() > 0


def test_target_dtype_and_the_zero3_sharder_equal_one_process():
    """A ZeRO-3 sharder over a deferred model (one rank: its shards are the whole) makes the same initial values as a
    whole materialisation and trains to the plain Adam run's parameters, in float64 exactly as in float32."""
    def build():
        return nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 65), nn.BatchNorm1d(65), nn.ReLU(),
                             nn.Linear(65, 5))
    for dtype in (torch.float32, torch.float64):
        ref = materialize(deferred(build, 3), dtype=dtype)
        assert all(p.dtype == dtype for p in ref.parameters())
        opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        model = deferred(build, 3)
        set_target(model, dtype=dtype)
        zero = ZeroSharder(model, DistContext(), stage="parameters",
                           make_optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
        assert not any(u.gathered for u in zero.units)  # only the shards were made
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(16, 7, generator=gen, dtype=dtype), torch.randn(16, 5, generator=gen, dtype=dtype)
            opt.zero_grad()
            nn.MSELoss()(ref(x), y).backward()
            opt.step()
            zero.zero_grad()
            zero.backward(sum_loss(nn.MSELoss(), model(x), y), 16)
            zero.step()
        model.eval(), ref.eval()
        with torch.no_grad():  # an evaluation of the sharded model: each layer gathered for its forward, then freed
            assert torch.equal(model(x), ref(x))
        assert not any(u.gathered for u in zero.units)
        zero.gather()
        for k, v in ref.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        zero.close()
