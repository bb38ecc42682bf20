"""The default recipe's layers: periodic numeric embeddings and a TabM-style ensemble inside one ``nn.Sequential``.

What the tabular deep-learning literature measured to make an MLP match gradient-boosted trees on medium tables,
in the form flowtrain's engines cut and shard:

- **Periodic numeric embeddings** (Gorishniy et al. 2022, "On Embeddings for Numerical Features in Tabular Deep
  Learning", the PLR embedding; ``rtdl_num_embeddings.PeriodicEmbeddings(lite=False)``): each numeric ``x`` becomes
  ``ReLU(Linear_j([cos(2 pi f_j x), sin(2 pi f_j x)]))``, ``k`` trained frequencies ``f_j ~ N(0, sigma)`` and a
  linear map of its own per feature, ``d`` wide (``PeriodicNumeric``).
- **A parameter-efficient ensemble** (Gorishniy et al. 2024, "TabM", its *mini* form): ``members`` models share the
  backbone's weights and differ by a multiplicative adapter on the backbone's input (``r_i``, random signs at the
  start) and by their own output head; each member is trained on its own loss (``MembersLoss``: the mean of the
  members' losses) and the prediction is the members' mean (of logits, of regression values).

The members travel in the feature dimension, ``[N, members * width + outputs]`` (the linear part's scores carried
at the end, as in ``tabular.Carry``), so the model stays an ``nn.Sequential`` whose every activation has one row per
example: pipeline stages cut it anywhere (their buffers are ``rows x features``), and ``MemberCarry`` is a carrying
wrapper (``inner``, ``width``) whose ``nn.Linear`` tensor parallelism splits as column/row like ``Carry``'s.
In training mode the head returns every member's output (``[N, members]`` or ``[N, members, K]``), in eval mode
their mean (``[N]`` or ``[N, K]``), which is what every prediction path (evaluation, the bundle, the scorer) sees.

Nothing here looks at data: the layers build on the meta device (``flowtrain.train.models.skeleton``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from flowtrain.train.models.tabular import Carry, LinearModel, TabularInput, TabularMLP

#: The recipe's defaults (``ModelOptions``): frequencies per numeric and their initial scale.
FREQUENCIES = 16
FREQUENCY_SCALE = 1.0
#: The ensemble chosen from the table (``choose_ensemble``): members cost a step's work each, so a table gets at most
#: ``MAX_MEMBERS`` and no more than keep ``train rows x members`` within ``MEMBER_ROWS``.
MAX_MEMBERS, MEMBER_ROWS = 4, 1 << 15


def choose_ensemble(train_rows: int) -> int:
    """The members of a table of ``train_rows`` training rows: a power of two, ``MAX_MEMBERS`` for small tables,
    fewer as the table grows (``train_rows x members <= MEMBER_ROWS``), one above ``MEMBER_ROWS`` rows."""
    members = 1
    while members < MAX_MEMBERS and train_rows * members * 2 <= MEMBER_ROWS:
        members *= 2
    return members


#: The numeric embeddings chosen from the table (``choose_numeric_embedding``): ``EMBEDDING`` wide up to
#: ``EMBEDDING_ROWS`` training rows, none above (a step costs about twice the plain MLP's with them: on the demo's
#: 245k rows they ran at 0.55x its speed and did not beat the linear start on validation; docs/models.md).
EMBEDDING, EMBEDDING_ROWS = 16, 1 << 16


def recipe_line(ensemble: int, numeric_embedding: int) -> str:
    """The recipe chosen, in words (what the batch run prints)."""
    members = f"an ensemble of {ensemble} members" if ensemble > 1 else "one network"
    numerics = (f"periodic numeric embeddings {numeric_embedding} wide" if numeric_embedding else
                "numerics as they are")
    return f"{members}, {numerics}"


def choose_numeric_embedding(train_rows: int) -> int:
    """The periodic embeddings' width for a table of ``train_rows`` training rows: ``EMBEDDING`` up to
    ``EMBEDDING_ROWS``, 0 (the numerics as they are) above."""
    return EMBEDDING if train_rows <= EMBEDDING_ROWS else 0


class PeriodicNumeric(nn.Module):
    """``[N, n]`` numerics -> ``[N, n * dim]``: per feature, ``ReLU(W_i [cos(2 pi f x), sin(2 pi f x)] + b_i)``."""

    def __init__(self, n: int, dim: int, frequencies: int = FREQUENCIES, scale: float = FREQUENCY_SCALE):
        super().__init__()
        self.n, self.dim, self.frequencies = int(n), int(dim), int(frequencies)
        self.frequency = nn.Parameter(torch.empty(self.n, self.frequencies))
        phase = torch.zeros(2 * self.frequencies)
        phase[: self.frequencies] = math.pi / 2  # the first half are cosines
        self.register_buffer("phase", phase, persistent=False)
        self.weight = nn.Parameter(torch.empty(self.n, 2 * self.frequencies, self.dim))
        self.bias = nn.Parameter(torch.empty(self.n, self.dim))
        nn.init.normal_(self.frequency, 0.0, scale)
        with torch.no_grad():
            self.frequency.clamp_(-3 * scale, 3 * scale)  # within 3 sigma, as rtdl's truncated normal
        bound = 1 / math.sqrt(2 * self.frequencies)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    @property
    def out_features(self) -> int:
        return self.n * self.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # feature-major [n, N, .] from the start: one batched matmul over the features, no copy of the waves
        # [cos | sin] as one sine: cos(a) = sin(a + pi/2), the phase a fixed buffer
        angle = torch.addcmul(self.phase, self.frequency.repeat(1, 2).unsqueeze(1), x.t().unsqueeze(-1),
                              value=2 * math.pi)  # [n, N, 2k]
        waves = torch.sin(angle)
        out = torch.baddbmm(self.bias.unsqueeze(1), waves, self.weight)  # [n, N, d]
        return torch.relu(out).transpose(0, 1).reshape(x.shape[0], self.n * self.dim)


class EnsembleInput(nn.Module):
    """Packed ``[numerics | codes]`` -> ``[member 1 features | ... | member M features | wide scores]``.

    The features: the first ``periodic`` numerics through ``PeriodicNumeric`` (``numeric_embedding`` wide; 0: as
    they are), the other numerics as they are (e.g. an ID table's vectors), each categorical's embedding (``deep``,
    a ``TabularInput``, which tensor parallelism splits by vocabulary); member ``i``'s copy is multiplied by its
    adapter ``r_i`` (random signs at the start, TabM's initialization). The linear part's scores are carried."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], outputs: int, *, members: int = 1,
                 numeric_embedding: int = 0, periodic: int | None = None, frequency_scale: float = FREQUENCY_SCALE):
        super().__init__()
        self.members, self.outputs = int(members), int(outputs)
        self.deep = TabularInput(n_numeric, cardinalities)
        self.wide = LinearModel(n_numeric, cardinalities, outputs)
        self.periodic = n_numeric if periodic is None else int(periodic)
        self.numerics = PeriodicNumeric(self.periodic, numeric_embedding, scale=frequency_scale) \
            if numeric_embedding and self.periodic else None
        width = self.deep.out_features + (self.numerics.out_features - self.periodic if self.numerics else 0)
        self.width = width  # one member's features
        if self.members > 1:  # one network has no adapter
            self.adapter = nn.Parameter(torch.empty(self.members, width))
            with torch.no_grad():
                self.adapter.bernoulli_(0.5).mul_(2).sub_(1)  # +-1: the members differ from the first step

    @property
    def out_features(self) -> int:
        return self.members * self.width + self.outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.deep.n_numeric
        x_num, codes = x.split([n, x.shape[1] - n], dim=1)  # split, not slices (see tabular.Carry)
        wide = self.wide.scores(x_num, codes.long())
        features = self.deep(x)  # [numerics | embeddings]
        if self.numerics is not None:
            periodic, rest = features.split([self.periodic, features.shape[1] - self.periodic], dim=1)
            features = torch.cat([self.numerics(periodic), rest], dim=1)
        if self.members > 1:  # member i's copy times its adapter (one network: the adapter stays 1, skipped)
            features = (features.unsqueeze(1) * self.adapter).flatten(1)  # [N, members * width]
        return torch.cat([features, wide], dim=1)


class MemberCarry(nn.Module):
    """Applies ``inner`` to each member's features (the activations but the last ``width`` columns, viewed as
    ``[N, members, features]``) and passes the last ``width`` columns (the wide scores) through unchanged. The
    members share ``inner``'s weights. A carrying wrapper (``inner``, ``width``) like ``tabular.Carry``: tensor
    parallelism splits its ``nn.Linear`` (``flowtrain.parallel.tensor.plan``), whose shards take any leading shape."""

    def __init__(self, inner: nn.Module, width: int, members: int):
        super().__init__()
        self.inner, self.width, self.members = inner, int(width), int(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner, carried = x.split([x.shape[1] - self.width, self.width], dim=1)  # split: see tabular.Carry
        # the member width spelled out: a micro-batch of zero rows (ZeRO-3 on a grid) has no -1 to infer
        per_member = inner.reshape(x.shape[0], self.members, inner.shape[1] // self.members)
        return torch.cat([self.inner(per_member).flatten(1), carried], dim=1)


class EnsembleHead(nn.Module):
    """``[member activations | wide scores]`` -> each member's output plus the wide scores: ``[N, members]`` /
    ``[N, members, K]`` in training mode, their mean in eval mode (``[N]`` / ``[N, K]``). The heads start at zero,
    so the untrained model predicts exactly its linear part."""

    def __init__(self, width: int, outputs: int, members: int):
        super().__init__()
        self.outputs, self.members = int(outputs), int(members)
        self.weight = nn.Parameter(torch.zeros(self.members, width, self.outputs))
        self.bias = nn.Parameter(torch.zeros(self.members, self.outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_member, wide = x.split([x.shape[1] - self.outputs, self.outputs], dim=1)
        if self.members == 1:  # one network: a plain linear head
            deep = torch.addmm(self.bias, per_member, self.weight[0]).unsqueeze(1)  # [N, 1, K]
        else:
            per_member = per_member.reshape(x.shape[0], self.members, self.weight.shape[1])  # [N, M, width]
            deep = torch.einsum("bmw,mwo->bmo", per_member, self.weight) + self.bias  # [N, M, K]
        if not self.training:
            out = deep.mean(dim=1) + wide  # [N, K]: the untrained model's is the wide part's, exactly
            return out.squeeze(1) if self.outputs == 1 else out
        out = deep + wide.unsqueeze(1)
        return out.squeeze(2) if self.outputs == 1 else out  # [N, M] or [N, M, K]


class TabularEnsemble(TabularMLP):
    """The default recipe: wide and deep (a ``TabularMLP``: its linear part, ``init_wide``, ``model(x_num, x_cat)``
    or ``model(packed)``) whose deep part is a TabM-mini ensemble of ``members`` over periodic embeddings of the
    first ``periodic`` numerics (all by default; ``numeric_embedding`` wide, 0: none): input, ``hidden`` blocks
    (Linear, ReLU, Dropout, weights shared by the members), head."""

    def __init__(self, n_numeric: int, cardinalities: Sequence[int], *, hidden: Sequence[int] = (128, 64),
                 dropout: float = 0.1, outputs: int = 1, members: int = MAX_MEMBERS, numeric_embedding: int = 16,
                 periodic: int | None = None, frequency_scale: float = FREQUENCY_SCALE):
        inp = EnsembleInput(n_numeric, cardinalities, outputs, members=members, numeric_embedding=numeric_embedding,
                            periodic=periodic, frequency_scale=frequency_scale)
        layers: list[nn.Module] = [inp]
        width = inp.width
        for h in hidden:
            layers += [MemberCarry(nn.Linear(width, h), outputs, members), Carry(nn.ReLU(), outputs),
                       MemberCarry(nn.Dropout(dropout), outputs, members)]
            width = h
        layers.append(EnsembleHead(width, outputs, members))
        nn.Sequential.__init__(self, *layers)
        self.outputs, self.members = outputs, members
        self.numeric_embedding = int(numeric_embedding)

    @property
    def hidden(self) -> list[int]:
        return [m.inner.out_features for m in self if isinstance(m, MemberCarry) and isinstance(m.inner, nn.Linear)]

    def describe(self) -> str:
        """The architecture in words (the report's)."""
        inp: EnsembleInput = self[0]
        hidden = self.hidden
        numerics = (f"periodic embeddings of the {inp.periodic} numeric(s) ({inp.numerics.frequencies} trained "
                    f"frequencies, {inp.numerics.dim} wide each)" if inp.numerics is not None else
                    f"the {inp.deep.n_numeric} numeric(s) as they are")
        cats = len(inp.deep.embeddings)
        return ("wide and deep: a linear part beside "
                + (f"a TabM-style ensemble of {self.members} MLPs (hidden {', '.join(map(str, hidden))}; shared "
                   f"weights, each member its own input adapter and head, the prediction their mean)"
                   if self.members > 1 else f"an MLP (hidden {', '.join(map(str, hidden))})")
                + f" over {numerics}" + (f" and embeddings of {cats} categorical(s)" if cats else ""))

    def architecture(self, hidden: Sequence[int], dropout: float) -> dict:
        """What a bundle's model.json says to rebuild this model (its own hidden sizes, whatever ``hidden`` says)."""
        return {"kind": "mlp", "hidden": self.hidden, "dropout": dropout, "ensemble": self.members,
                "numeric_embedding": self.numeric_embedding}


class MembersLoss(nn.Module):
    """A loss over ensemble members: an output with a members dimension (``[N, M]`` for one output, ``[N, M, K]``
    for K) is the mean of each member's ``base`` loss against the same targets; any other output is ``base``'s
    (a model without members). The reduction is ``base``'s ("mean": the mean over rows and members)."""

    def __init__(self, base: nn.Module, outputs: int):
        super().__init__()
        self.base, self.outputs = base, int(outputs)
        self.reduction = getattr(base, "reduction", "mean")

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dim() != (2 if self.outputs == 1 else 3):
            return self.base(output, target)
        members = output.shape[1]
        flat = output.transpose(0, 1).reshape(members * output.shape[0], *output.shape[2:])
        loss = self.base(flat, target.repeat(members, *([1] * (target.dim() - 1))))  # a weighted target: [N, 2]
        return loss / members if self.reduction == "sum" else loss


def wide_and_deep(n_numeric: int, cardinalities: Sequence[int], *, hidden: Sequence[int], dropout: float,
                  outputs: int, ensemble: int = 1, numeric_embedding: int = 0, periodic: int | None = None,
                  frequency_scale: float = FREQUENCY_SCALE) -> TabularMLP:
    """The wide-and-deep model these options describe: the default recipe's ``TabularEnsemble`` (``ensemble`` > 1
    members or periodic embeddings ``numeric_embedding`` wide), else the plain ``TabularMLP`` (both off)."""
    if ensemble > 1 or numeric_embedding:
        return TabularEnsemble(n_numeric, cardinalities, hidden=tuple(hidden), dropout=dropout, outputs=outputs,
                               members=ensemble, numeric_embedding=numeric_embedding, periodic=periodic,
                               frequency_scale=frequency_scale)
    return TabularMLP(n_numeric, cardinalities, hidden=tuple(hidden), dropout=dropout, outputs=outputs)
