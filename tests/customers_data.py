"""The customers table of the docs' quick start (README, docs/python-api.md, docs/predict.md): 2,000 customers with
an id, a signup date, a plan, a region (some missing), a constant country, numbers (support calls sometimes missing)
and a yes/no churn label, the same for a seed."""
from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa


def customers(n: int = 2000, seed: int = 0) -> pa.Table:
    r = np.random.default_rng(seed)
    plan = r.choice(["basic", "plus", "pro"], size=n, p=[0.5, 0.3, 0.2])
    region = r.choice(["north", "south", "east", "west"], size=n).astype(object)
    region[r.random(n) < 0.05] = None
    tenure = r.integers(1, 72, size=n)
    spend = np.round(r.gamma(2.0, 25.0, size=n) + (plan == "pro") * 40, 2)
    calls = r.poisson(1.5, size=n).astype(float)
    calls[r.random(n) < 0.1] = np.nan
    start = dt.date(2022, 1, 1)
    signup = [(start + dt.timedelta(days=int(d))).isoformat() for d in r.integers(0, 900, size=n)]
    logit = -1.0 - 0.04 * tenure + 0.5 * np.nan_to_num(calls, nan=1.5) + 0.6 * (plan == "basic")
    churned = np.where(r.random(n) < 1 / (1 + np.exp(-logit)), "yes", "no")
    return pa.table({"customer_id": [f"C{100000 + i}" for i in range(n)], "signup": signup, "plan": plan,
                     "region": pa.array(list(region), pa.string()), "country": ["DE"] * n, "tenure_months": tenure,
                     "monthly_spend": spend, "support_calls": pa.array(calls, from_pandas=True), "churned": churned})
