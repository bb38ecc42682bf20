"""A synthetic click stream to prove ID tables on (``flowtrain replay --generate clicks``).

Users and items with latent tastes (``dim`` numbers each); an event is a user seeing an item at a
price; the click probability is ``sigmoid(user . item / sqrt(dim) + item bias - 0.4 * price_z - 0.5)``,
kept aside (``p_click``: the truth, for scoring a model; never an event field). New users keep
arriving (each event is a brand-new user's first with probability ``new_user_rate``); the
recently arrived users are the most active (a Zipf(``zipf``) rank over users by arrival, newest
first), items are picked by a Zipf popularity, and tastes drift (each event moves its user's
taste by ``drift`` standard normal steps). Seeded: the same arguments give the same stream.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

COLUMNS = ("time", "user", "item", "price", "clicked")


def generate_clicks(events: int, *, users: int = 2_000, items: int = 500, new_user_rate: float = 0.01,
                    dim: int = 8, drift: float = 0.01, zipf: float = 1.3, seed: int = 0,
                    start_time: int = 1_700_000_000) -> tuple[pa.Table, np.ndarray]:
    """``(events table, true click probabilities)``; the table's columns are ``COLUMNS``."""
    if events < 0 or users < 1 or items < 1 or not 0 <= new_user_rate <= 1 or zipf <= 1:
        raise ValueError("generate_clicks: events >= 0, users >= 1, items >= 1, 0 <= new_user_rate <= 1, zipf > 1")
    rng = np.random.default_rng(seed)
    cap = users + int(events * new_user_rate * 2) + 16
    taste = rng.normal(size=(cap, dim)).astype(np.float32)
    item_vec = rng.normal(size=(items, dim)).astype(np.float32)
    item_bias = rng.normal(scale=0.5, size=items).astype(np.float32)
    item_order = rng.permutation(items)  # popularity rank -> item
    n_users = users
    user_col = np.empty(events, dtype=np.int64)
    item_col = np.empty(events, dtype=np.int64)
    price = rng.lognormal(mean=3.0, sigma=0.5, size=events).astype(np.float32)
    price_z = (np.log(price) - 3.0) / 0.5
    p = np.empty(events, dtype=np.float64)
    new = rng.random(events) < new_user_rate
    ranks = rng.zipf(zipf, size=events)
    item_ranks = np.minimum(rng.zipf(zipf, size=events), items) - 1
    steps = rng.normal(size=(events, dim)).astype(np.float32) * drift
    for e in range(events):
        if new[e] and n_users < cap:
            u = n_users
            n_users += 1
        else:
            u = n_users - min(int(ranks[e]), n_users)  # rank 1: the newest user
        i = int(item_order[item_ranks[e]])
        taste[u] += steps[e]
        logit = float(taste[u] @ item_vec[i]) / np.sqrt(dim) + float(item_bias[i]) - 0.4 * float(price_z[e]) - 0.5
        p[e] = 1.0 / (1.0 + np.exp(-logit))
        user_col[e], item_col[e] = u, i
    clicked = (rng.random(events) < p).astype(np.int64)
    table = pa.table({"time": pa.array(start_time + np.arange(events, dtype=np.int64)),
                      "user": pa.array([f"u{u}" for u in user_col.tolist()]),
                      "item": pa.array([f"i{i}" for i in item_col.tolist()]),
                      "price": pa.array(np.round(price, 2)), "clicked": pa.array(clicked)})
    return table, p
