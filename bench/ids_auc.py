"""New users on a stream: ID tables against a fixed vocabulary and the hashing trick (issue 32 item 4).

A synthetic click stream (``pipelines.ids.clicks``: Zipf users and items, latent tastes, new users
arriving, drifting tastes). The first ``--batch-fraction`` of the events is the batch run (two epochs),
the rest the stream: each mini-batch is scored first, then trained on (prequential, as the online
trainer does). Three models, the same MLP over ``[log price, user vector, item vector]``:

* ``ID tables``: ``flowtrain.train.ids.IdEmbedding`` per column (rows created for new IDs);
* ``fixed vocabulary``: ``nn.Embedding`` over the batch part's values, a new value is out of vocabulary;
* ``hashing trick``: ``nn.Embedding`` of as many rows as the ID table holds at the end (the same
  memory), the key mod that many rows.

Measured: AUC on the stream's events, and on the events of users first seen after the batch part
within their first ``--first-n`` events; the true probability's AUC is the ceiling.

    flowtrain bench ids-auc --events 60000 --first-n 20
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from connectors.id_keys import key_of
from flowtrain.train.ids import IdEmbedding
from pipelines.ids.clicks import generate_clicks

DIM = 8


class _Vocab(nn.Module):
    def __init__(self, rows: int, mode: str, vocab: dict | None = None):
        super().__init__()
        self.emb, self.mode, self.vocab, self.rows = nn.Embedding(rows, DIM), mode, vocab, rows
        nn.init.normal_(self.emb.weight, std=0.01)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        if self.mode == "hash":
            idx = torch.as_tensor(keys.numpy().view(np.uint64) % np.uint64(self.rows), dtype=torch.int64)
        else:
            idx = torch.as_tensor([self.vocab.get(int(k), 0) for k in keys.tolist()], dtype=torch.int64)
        return self.emb(idx)

    def step(self, global_n: int, lr: float) -> None:
        """Trained by the dense optimizer."""


class Net(nn.Module):
    def __init__(self, user: nn.Module, item: nn.Module):
        super().__init__()
        self.user, self.item = user, item
        self.mlp = nn.Sequential(nn.Linear(1 + 2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, users, items):
        return self.mlp(torch.cat([x, self.user(users), self.item(items)], dim=1)).squeeze(1)


def _train(model: Net, opt, x, u, i, y, lr: float) -> None:
    model.train()
    loss = nn.functional.binary_cross_entropy_with_logits(model(x, u, i), y, reduction="sum")
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= len(y)
    opt.step()
    model.user.step(len(y), lr)
    model.item.step(len(y), lr)


def run(events: int = 60_000, batch_fraction: float = 0.5, first_n: int = 20, batch: int = 256, lr: float = 0.01,
        seed: int = 0) -> dict:
    torch.manual_seed(seed)
    table, truth = generate_clicks(events, seed=seed)
    users = np.asarray([key_of(u) for u in table.column("user").to_pylist()], dtype=np.int64)
    items = np.asarray([key_of(i) for i in table.column("item").to_pylist()], dtype=np.int64)
    price = np.log(table.column("price").to_numpy())
    x = torch.as_tensor(((price - price.mean()) / price.std())[:, None], dtype=torch.float32)
    y = torch.as_tensor(table.column("clicked").to_numpy().copy(), dtype=torch.float32)
    split = int(events * batch_fraction)

    def vocab(keys):
        return {int(k): n + 1 for n, k in enumerate(np.unique(keys[:split]))}

    ids = Net(IdEmbedding(DIM, init_std=0.01, seed=seed), IdEmbedding(DIM, init_std=0.01, seed=seed))
    fixed = Net(_Vocab(len(vocab(users)) + 1, "vocab", vocab(users)), _Vocab(len(vocab(items)) + 1, "vocab",
                                                                                  vocab(items)))
    models = {"ID tables": ids, "fixed vocabulary": fixed}
    u_t, i_t = torch.as_tensor(users), torch.as_tensor(items)
    scores: dict[str, np.ndarray] = {}
    # the ID tables' run first: the hashing trick gets as many rows as the ID tables end with
    for name in ("ID tables", "fixed vocabulary", "hashing trick"):
        if name == "hashing trick":
            rows_u, rows_i = len(ids.user.table), len(ids.item.table)
            models[name] = Net(_Vocab(rows_u, "hash"), _Vocab(rows_i, "hash"))
        model = models[name]
        torch.manual_seed(seed)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(2):  # the batch part
            for lo in range(0, split, batch):
                s = slice(lo, min(lo + batch, split))
                _train(model, opt, x[s], u_t[s], i_t[s], y[s], lr)
        out = np.empty(events - split, dtype=np.float64)
        for lo in range(split, events, batch):  # the stream: score, then train
            s = slice(lo, min(lo + batch, events))
            model.eval()
            with torch.no_grad():
                out[lo - split: s.stop - split] = model(x[s], u_t[s], i_t[s]).numpy()
            _train(model, opt, x[s], u_t[s], i_t[s], y[s], lr)
        scores[name] = out
    labels = y.numpy()[split:]
    seen_before = set(users[:split].tolist())
    nth: dict[int, int] = {}
    new_first = np.zeros(events - split, dtype=bool)
    for e, u in enumerate(users[split:].tolist()):
        if u not in seen_before:
            nth[u] = nth.get(u, 0) + 1
            new_first[e] = nth[u] <= first_n
    res = {"events": events, "batch_events": split, "first_n": first_n, "new_users": len(nth),
           "new_user_events": int(new_first.sum()),
           "rows": {"user": len(ids.user.table), "item": len(ids.item.table)},
           "auc": {}, "auc_new_users": {}}
    for name, s in [*scores.items(), ("true probability (ceiling)", truth[split:])]:
        res["auc"][name] = float(roc_auc_score(labels, s))
        res["auc_new_users"][name] = float(roc_auc_score(labels[new_first], s[new_first]))
    return res


def _table(res: dict) -> str:
    lines = [f"{res['events']:,} click events (flowtrain replay --generate clicks' generator), the first "
             f"{res['batch_events']:,} the batch run (2 epochs), the rest scored then trained on in mini-batches "
             f"of 256; {res['new_users']:,} users first seen after the batch ({res['new_user_events']:,} events within "
             f"their first {res['first_n']}); ID tables ended with {res['rows']['user']:,} user and "
             f"{res['rows']['item']:,} item rows (the hashing trick's sizes)", "",
             f"| model | stream AUC | AUC on new users' first {res['first_n']} events |", "|---|---:|---:|"]
    for name in res["auc"]:
        lines.append(f"| {name} | {res['auc'][name]:.4f} | {res['auc_new_users'][name]:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=60_000)
    ap.add_argument("--batch-fraction", type=float, default=0.5)
    ap.add_argument("--first-n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(_table(run(args.events, args.batch_fraction, args.first_n, seed=args.seed)))


if __name__ == "__main__":
    main()
