"""The default recipe (issue 46 item 2): periodic numeric embeddings and a TabM-style ensemble in one
``nn.Sequential``; its start is exactly its linear part, each member trains on its own loss, the prediction is the
members' mean, records without the recipe rebuild the plain wide and deep, and the report says which model won."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flowtrain.train.metrics import standard_error
from flowtrain.train.model_choice import LINEAR, NETWORK, choice_text
from flowtrain.train.model_choice import model_choice as _choice
from flowtrain.train.models import (
    Architecture,
    LinearModel,
    ModelOptions,
    TabularEnsemble,
    TabularMLP,
    build_model,
    skeleton,
)
from flowtrain.train.models.ensemble import (
    MemberCarry,
    MembersLoss,
    PeriodicNumeric,
    choose_ensemble,
    choose_numeric_embedding,
    recipe_line,
)
from flowtrain.train.models.ids import IdWideDeep
from flowtrain.train.trainer import loss_function


def _data(outputs=1, id_columns=(), rows=500):
    spec = SimpleNamespace(all_numeric=["a", "b", "c"], categorical=["c1", "c2"], id_columns=list(id_columns),
                           task="regression" if outputs == 1 else "classification")
    return SimpleNamespace(n_numeric=3, cardinalities=[4, 6], outputs=outputs, spec=spec, classes=None,
                           manifest={"rows": {"train": rows}})


def _batch(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 4, (n, 2), generator=g)


@pytest.mark.parametrize("outputs", [1, 3])
def test_the_default_is_the_ensemble_and_starts_exactly_at_its_fitted_linear_part(outputs):
    model = build_model("mlp", _data(outputs), ModelOptions(hidden=(16, 8)))
    assert isinstance(model, TabularEnsemble) and isinstance(model, TabularMLP) and model.members == 4
    linear = LinearModel(3, [4, 6], outputs)
    with torch.no_grad():
        for p in linear.parameters():
            p.normal_()
    model.init_wide(linear.state_dict())
    x_num, x_cat = _batch()
    model.eval()
    assert torch.equal(model(x_num, x_cat), linear(x_num, x_cat))  # the untrained model is its linear start
    model.train()
    members = model(x_num, x_cat)
    assert members.shape == ((7, 4) if outputs == 1 else (7, 4, outputs))


def test_the_table_chooses_the_members_and_the_embeddings():
    assert [choose_ensemble(n) for n in (500, 8_192, 8_193, 16_384, 16_385, 300_000)] == [4, 4, 2, 2, 1, 1]
    assert [choose_numeric_embedding(n) for n in (500, 65_536, 65_537)] == [16, 16, 0]
    mid = build_model("mlp", _data(rows=50_000), ModelOptions(hidden=(8,)))
    assert isinstance(mid, TabularEnsemble) and mid.members == 1 and mid.numeric_embedding == 16
    assert not hasattr(mid[0], "adapter")  # one network: no member adapters
    large = build_model("mlp", _data(rows=100_000), ModelOptions(hidden=(8,)))
    assert type(large) is TabularMLP  # the plain wide and deep on a large table
    assert build_model("mlp", _data(rows=100_000), ModelOptions(hidden=(8,), ensemble=2)).members == 2
    chosen = Architecture.from_dict({"hidden": [8], "ensemble": None, "numeric_embedding": None}, "test")
    again = chosen.build(_data(rows=10_000))  # None in a record: the table's choice, again
    assert again.members == 2 and again.numeric_embedding == 16
    assert recipe_line(2, 16) == "an ensemble of 2 members, periodic numeric embeddings 16 wide"
    assert recipe_line(1, 0) == "one network, numerics as they are"


def test_members_differ_and_the_prediction_is_their_mean():
    torch.manual_seed(0)
    model = TabularEnsemble(3, [4, 6], hidden=(16,), dropout=0.0, members=4, numeric_embedding=4)
    with torch.no_grad():
        model[-1].weight.normal_()  # heads away from zero: members now differ
    x_num, x_cat = _batch()
    model.train()
    each = model(x_num, x_cat)
    assert each.shape == (7, 4) and not torch.allclose(each[:, 0], each[:, 1])
    model.eval()
    assert torch.allclose(model(x_num, x_cat), each.mean(dim=1), atol=1e-6)


def test_each_member_trains_on_its_own_loss():
    base = nn.BCEWithLogitsLoss()
    loss = MembersLoss(base, outputs=1)
    out, y = torch.randn(5, 4), torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    want = sum(base(out[:, m], y) for m in range(4)) / 4
    assert torch.allclose(loss(out, y), want)
    assert torch.equal(loss(out[:, 0], y), base(out[:, 0], y))  # a model without members: the plain loss
    multi = loss_function("classification", 3)
    logits, labels = torch.randn(5, 2, 3), torch.tensor([0.0, 2.0, 1.0, 1.0, 0.0])
    ce = nn.CrossEntropyLoss()
    assert torch.allclose(multi(logits, labels), (ce(logits[:, 0], labels.long()) + ce(logits[:, 1], labels.long())) / 2)
    assert multi.reduction == "mean"  # what the engines' sum_loss scales by


def test_periodic_embeddings_and_id_vectors():
    emb = PeriodicNumeric(3, 5, frequencies=4)
    assert emb(torch.randn(2, 3)).shape == (2, 15)
    ids = IdWideDeep(3, [4, 6], ["user"], id_dim=4, hidden=(8,), ensemble=2, numeric_embedding=5)
    inp = ids.mlp[0]
    assert inp.periodic == 3 and inp.numerics.n == 3  # the ID vectors join as they are, not embedded
    assert inp.width == 3 * 5 + 4 + sum(e.embedding_dim for e in inp.deep.embeddings)
    assert ids.architecture((8,), 0.1)["ensemble"] == 2


def test_the_member_layers_keep_one_row_per_example():
    """Pipeline stages pass rows x features: every activation of the ensemble has one row per example."""
    torch.manual_seed(0)
    model = TabularEnsemble(3, [4, 6], hidden=(16, 8), members=4, numeric_embedding=4)
    x = torch.cat([_batch()[0], _batch()[1].float()], dim=1)
    for layer in list(model)[:-1]:
        x = layer(x)
        assert x.shape[0] == 7 and x.dim() == 2
    assert isinstance(model[1], MemberCarry) and isinstance(model[1].inner, nn.Linear)


def test_architecture_records_the_recipe_and_old_records_build_the_plain_model():
    new = Architecture.from_dict({"hidden": [8], "dropout": 0.0, "ensemble": 4, "numeric_embedding": 6}, "test")
    assert new.to_dict()["ensemble"] == 4 and isinstance(new.build(_data()), TabularEnsemble)
    old = Architecture.from_dict({"hidden": [8], "dropout": 0.0, "seed": 1}, "an older run")
    built = old.build(_data())
    assert type(built) is TabularMLP and "ensemble" not in old.to_dict()
    a, b = (Architecture.from_dict(new.to_dict(), "again").build(_data()) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))  # seeded


def test_the_recipe_builds_on_the_meta_device():
    meta = skeleton(lambda: TabularEnsemble(3, [4, 6], hidden=(16, 8), outputs=3))
    real = build_model("mlp", _data(3), ModelOptions(hidden=(16, 8)))
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}


def model_choice(**kw):
    higher = kw["metric"] != "rmse"
    return _choice(higher=higher, standard_error=standard_error, **kw)


def _history(values):
    return [{"kind": "valid", "model": "model", "step": s, "auc": v, "positive_rate": 0.3} for s, v in values]


def test_the_choice_says_which_model_won_and_by_how_much():
    won = model_choice(metric="auc", best_step=200, history=_history([(0, 0.70), (100, 0.71), (200, 0.74)]),
                       valid_rows=5_000, test_model={"auc": 0.73}, test_linear={"auc": 0.70},
                       architecture="wide and deep: X", parameters=1234)
    assert won["chosen"] == NETWORK and won["valid"]["network_best"] == 0.74 and won["test"]["relative"] > 0.04
    text = choice_text(won)
    assert "the network (wide and deep: X; 1,234 parameters), its checkpoint at step 200" in text
    assert "0.7400 against its linear start's 0.7000 (+0.0400" in text and "better by 4.3%" in text
    kept = model_choice(metric="rmse", best_step=0, history=[{"kind": "valid", "model": "model", "step": s,
                                                               "rmse": v} for s, v in [(0, 10.0), (50, 9.9)]],
                        valid_rows=100, test_model={"rmse": 10.5}, test_linear={"rmse": 10.5},
                        architecture="A", parameters=1)
    assert kept["chosen"] == LINEAR
    text = choice_text(kept)
    assert text.startswith("The reported model is the linear start") and "9.9000 at step 50" in text
    assert "(-0.1000; one standard error of validation rmse on its 100 rows is 0.7071)" in text
    worse = choice_text(model_choice(metric="auc", best_step=0, history=_history([(0, 0.7), (10, 0.69)]),
                                     valid_rows=50, test_model={}, test_linear={}, architecture="A", parameters=1))
    assert "the network never did better on validation" in worse
