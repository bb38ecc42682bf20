"""Generated card transactions with fraud that only features over time see (``flowtrain replay --generate
transactions``; the benchmark's and the tests' data).

- Cards pay at heavy-tailed rates (lognormal, a few cards hundreds of times busier than most) and typical amounts
  of their own (lognormal); each card has a few usual merchants and now and then a random one.
- Merchants are a versioned table: each has a category and a risk tier (0-3) that changes at a few times
  (``merchants``: ``merchant, valid_from, risk_tier``), so the tier that matters is the one *at the payment's
  time* (an as-of join).
- Fraud comes in bursts, defined by windowed quantities: a compromised card makes 3-8 payments within ~10
  minutes, at merchants whose tier is 2 or 3 at that moment, of 3-8 times the card's typical amount; those are
  ``fraud = 1``. A single payment says little (amounts vary by card and merchants by time); the card's count in
  the last 10 minutes, its amount against the card's 30-day mean and the merchant's tier as of the payment do.
- Out-of-order delivery (``delay_s > 0``): each payment arrives up to ``delay_s`` seconds after it happened
  (uniform); the table is in arrival order, the ``time`` column the event time.

Times are whole epoch seconds (ties happen, as in real feeds). Seeded: the same arguments give the same tables.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

COLUMNS = ("txn", "time", "card", "merchant", "category", "amount", "fraud")
CATEGORIES = ("grocery", "fuel", "restaurant", "travel", "electronics", "online", "pharmacy", "fashion")
DAY = 86_400


def generate_transactions(events: int, *, cards: int | None = None, merchants: int | None = None, days: int = 60,
                          fraud_bursts: int | None = None, delay_s: float = 0.0, seed: int = 0,
                          start_time: int = 1_704_067_200) -> tuple[pa.Table, pa.Table]:
    """``(transactions, merchants)``: ``events`` payments (columns ``COLUMNS``, fraud bursts included) and the
    merchants' versioned risk tiers."""
    if events < 0 or days < 1 or delay_s < 0:
        raise ValueError("generate_transactions: events >= 0, days >= 1, delay_s >= 0")
    rng = np.random.default_rng(seed)
    cards = cards or max(10, events // 50)
    merchants = merchants or max(20, events // 500)
    span = days * DAY
    # merchants: a category, a tier per version
    category = rng.integers(0, len(CATEGORIES), merchants)
    versions = 1 + rng.poisson(2.0, merchants)
    m_of = np.repeat(np.arange(merchants), versions)
    first = np.concatenate([[0], np.cumsum(versions)[:-1]])
    valid_from = start_time - DAY + rng.integers(0, span + DAY, len(m_of))
    valid_from[first] = start_time - 30 * DAY  # every merchant's first version precedes the data
    order = np.lexsort((valid_from, m_of))
    m_of, valid_from = m_of[order], valid_from[order]
    tier = np.minimum(rng.geometric(0.55, len(m_of)) - 1, 3)
    # cards: heavy-tailed rates, typical amounts, usual merchants
    rate = rng.lognormal(0.0, 1.3, cards)
    typical = rng.lognormal(3.2, 0.8, cards)
    usual = rng.integers(0, merchants, (cards, 4))
    n_fraud_bursts = fraud_bursts if fraud_bursts is not None else max(1, events // 400)
    burst_sizes = rng.integers(3, 9, n_fraud_bursts)
    normal = max(0, events - int(burst_sizes.sum()))
    card = rng.choice(cards, normal, p=rate / rate.sum())
    when = start_time + rng.integers(0, span, normal)
    usual_pick = rng.random(normal) < 0.85
    merchant = np.where(usual_pick, usual[card, rng.integers(0, 4, normal)], rng.integers(0, merchants, normal))
    amount = typical[card] * rng.lognormal(0.0, 0.45, normal)
    fraud = np.zeros(normal, dtype=np.int64)
    # fraud bursts: 3-8 payments within ~10 minutes at merchants risky at that moment, 3-8x the typical amount
    b_card = rng.choice(cards, n_fraud_bursts, p=rate / rate.sum())
    b_start = start_time + rng.integers(min(7 * DAY, span // 4), span - 3600, n_fraud_bursts)  # after a history
    b_rows = np.repeat(np.arange(n_fraud_bursts), burst_sizes)
    b_when = b_start[b_rows] + np.sort(rng.integers(0, 600, len(b_rows)))
    b_merchant = rng.integers(0, merchants, len(b_rows))
    for _ in range(200):  # redrawn until each burst payment is at a merchant risky at its time
        redo = _tier_of(m_of, valid_from, tier, b_merchant, b_when) < 2
        if not redo.any():
            break
        b_merchant[redo] = rng.integers(0, merchants, int(redo.sum()))
    b_amount = typical[b_card[b_rows]] * rng.uniform(3.0, 8.0, len(b_rows))
    card = np.concatenate([card, b_card[b_rows]])
    when = np.concatenate([when, b_when])
    merchant = np.concatenate([merchant, b_merchant])
    amount = np.round(np.concatenate([amount, b_amount]), 2)
    fraud = np.concatenate([fraud, np.ones(len(b_rows), dtype=np.int64)])
    arrive = when + (rng.uniform(0, delay_s, len(when)) if delay_s else 0)
    order = np.lexsort((rng.random(len(when)), arrive))
    txns = pa.table({
        "txn": pa.array(np.arange(len(order), dtype=np.int64)),
        "time": pa.array(when[order].astype(np.int64)),
        "card": pa.array([f"c{c}" for c in card[order].tolist()]),
        "merchant": pa.array([f"m{m}" for m in merchant[order].tolist()]),
        "category": pa.array([CATEGORIES[c] for c in category[merchant[order]].tolist()]),
        "amount": pa.array(amount[order]),
        "fraud": pa.array(fraud[order]),
    })
    table = pa.table({"merchant": pa.array([f"m{m}" for m in m_of.tolist()]),
                      "valid_from": pa.array(valid_from.astype(np.int64)), "risk_tier": pa.array(tier)})
    return txns, table


def _tier_of(m_of, valid_from, tier, merchant: np.ndarray, when: np.ndarray) -> np.ndarray:
    """Each (merchant, time)'s tier: its version with the greatest valid_from at or before the time."""
    stride = np.int64(valid_from.max() - valid_from.min() + when.max() - when.min() + 2)
    base = min(int(valid_from.min()), int(when.min()))
    comp = m_of.astype(np.int64) * stride + (valid_from - base)
    at = np.searchsorted(comp, merchant.astype(np.int64) * stride + (when - base), "right") - 1
    return tier[at]
