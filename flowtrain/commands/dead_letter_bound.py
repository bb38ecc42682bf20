"""How many dead letters a command accepts before it says the input could not be used (``--max-dead-letter-fraction``
of ``flowtrain batch``, ``predict`` and ``replay``): ``check_dead_letters`` raises ``DeadLettersError`` (exit status
3) when every row is a dead letter where rows were to be used, or when more than the fraction are; the message
names the counts, the most common reasons and the file that holds them."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from connectors.deadletter import reason_kind
from connectors.fields import fraction, option
from flowtrain.errors import DeadLettersError

#: How many lines of a dead-letter file are read for the message's most common reasons.
_REASON_LINES = 10_000


@dataclass
class DeadLetterBound:
    """``--max-dead-letter-fraction``: how many of a command's input rows may be dead letters before it exits with
    status 3 (``batch``: the rows its ETL reads; ``predict``: the rows; ``replay``: the events it would send)."""

    max_dead_letter_fraction: float | None = option(
        None, "stop with exit status 3 when more than this fraction of the rows are dead letters (their reasons in the "
              "dead-letter file); default: no bound, but rows that are all dead letters are an error where something "
              "had to be used", parse=fraction(inclusive_high=True), metavar="F")


def common_reasons(path: str | Path | None, limit: int = 3) -> str:
    """``numeric feature 'x' is missing or not a finite number (50)``: the most common kinds among the first lines
    of a dead-letter file (JSON lines with a ``reason``); empty when there is none to read."""
    counts: Counter = Counter()
    try:
        with open(path) as fh:
            for i, line in enumerate(fh):
                if i >= _REASON_LINES:
                    break
                try:
                    counts[reason_kind(json.loads(line).get("reason", ""))] += 1
                except (ValueError, AttributeError):
                    continue
    except (OSError, TypeError):
        return ""
    return "; ".join(f"{reason} ({n:,})" for reason, n in counts.most_common(limit))


def check_dead_letters(rows: int, dead: int, max_fraction: float | None, *, what: str, where: str,
                       reasons: str = "", nothing_used: bool = False, done: str = "used") -> None:
    """``DeadLettersError`` when ``nothing_used`` (every row a dead letter, or none at all, where rows were to be
    used; ``done``: what was to be done with them) or when ``dead / rows`` is over ``max_fraction``; ``where``: the
    dead letters' file, ``reasons``: their most common reasons (``common_reasons``)."""
    why = f" ({reasons})" if reasons else ""
    if nothing_used:
        said = f"all {rows:,} {what} are dead letters{why}" if rows else f"the input holds no {what}"
        raise DeadLettersError(f"nothing could be {done}: {said}; see {where}")
    if max_fraction is not None and rows and dead / rows > max_fraction:
        raise DeadLettersError(f"{dead:,} of {rows:,} {what} ({dead / rows:.1%}) are dead letters, more than "
                               f"--max-dead-letter-fraction {max_fraction:g}{why}; see {where}")
