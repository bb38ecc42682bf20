"""Pipeline schedules as plain data: per stage, a list of actions, printable and checkable.

An action is a computation, ``F3`` (forward of micro-batch 3) or ``B3`` (its backward), or,
after ``add_communication``, a transfer: ``sF3``/``rF3`` (send/receive micro-batch 3's
activations to/from the next/previous stage) and ``sB3``/``rB3`` (its gradients, backwards).
Sends are asynchronous (``isend``), receives block, which is how the executor runs them and
how ``validate`` simulates them, in one process and without any worker.

    >>> print(format_schedule(gpipe(2, 2)))
    stage 0: F0 F1 B0 B1
    stage 1: F0 F1 B0 B1
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Action", "Schedule", "gpipe", "one_f_one_b", "add_communication", "format_schedule",
           "parse_schedule", "validate", "ScheduleError", "SCHEDULES", "bubble_fraction", "microbatch_sizes",
           "peak_in_flight"]

_PATTERN = re.compile(r"^(s|r)?(F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int
    comm: str = ""  # "" (compute), "s" (send) or "r" (receive)

    def __str__(self) -> str:
        return f"{self.comm}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        m = _PATTERN.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (expected F3, B3, sF3, rF3, sB3 or rB3)")
        return cls(m.group(2), int(m.group(3)), m.group(1) or "")

    @property
    def is_compute(self) -> bool:
        return not self.comm


Schedule = list[list[Action]]


class ScheduleError(ValueError):
    """A schedule is incomplete or deadlocks; the message shows where."""


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): simple, holds M micro-batches' activations."""
    return [[Action("F", m) for m in range(microbatches)] + [Action("B", m) for m in range(microbatches)]
            for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage s warms up with S-1-s forwards, then alternates one forward and one backward,
    then drains the backwards; it holds at most S-s micro-batches' activations."""
    schedule = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        actions = [Action("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < microbatches:
            actions += [Action("F", f), Action("B", b)]
            f += 1
            b += 1
        actions += [Action("B", m) for m in range(b, microbatches)]
        schedule.append(actions)
    return schedule


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def add_communication(schedule: Schedule) -> Schedule:
    """The transfer pass: receive before a computation needs its input, send right after it."""
    last = len(schedule) - 1
    out = []
    for s, actions in enumerate(schedule):
        program = []
        for a in actions:
            if not a.is_compute:
                raise ScheduleError(f"stage {s}: {a} is already a transfer; add_communication takes compute actions")
            if a.kind == "F":
                if s > 0:
                    program.append(Action("F", a.microbatch, "r"))
                program.append(a)
                if s < last:
                    program.append(Action("F", a.microbatch, "s"))
            else:
                if s < last:
                    program.append(Action("B", a.microbatch, "r"))
                program.append(a)
                if s > 0:
                    program.append(Action("B", a.microbatch, "s"))
        out.append(program)
    return out


def format_schedule(schedule: Schedule, *, mark: tuple[int, int] | None = None) -> str:
    """One line per stage; ``mark=(stage, index)`` brackets one action (a failing step)."""
    lines = []
    for s, actions in enumerate(schedule):
        cells = [f">>{a}<<" if mark == (s, i) else str(a) for i, a in enumerate(actions)]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)



def parse_schedule(text: str) -> Schedule:
    schedule = []
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        if not head.strip().startswith("stage"):
            raise ValueError(f"not a schedule line: {line!r}")
        schedule.append([Action.parse(t) for t in body.split()])
    return schedule


def validate(schedule: Schedule, microbatches: int) -> None:
    """Prove in one process that ``schedule`` is complete and cannot deadlock.

    Complete: every stage runs F m then B m exactly once for every micro-batch m. Free of
    deadlock: simulating all stages with asynchronous sends and blocking receives, every
    stage reaches its end; a forward needs its input (received, or stage 0), a backward its
    own forward and its output gradient (received, or the last stage's loss).
    """
    stages = len(schedule)
    has_comm = any(not a.is_compute for actions in schedule for a in actions)
    for s, actions in enumerate(schedule):
        compute = [a for a in actions if a.is_compute]
        for kind in ("F", "B"):
            seen = sorted(a.microbatch for a in compute if a.kind == kind)
            if seen != list(range(microbatches)):
                missing = sorted(set(range(microbatches)) - set(seen))
                extra = sorted({m for m in seen if seen.count(m) > 1 or m >= microbatches})
                raise ScheduleError(f"stage {s} is incomplete: {kind} of micro-batch(es) "
                                    f"{missing or extra} {'missing' if missing else 'repeated or out of range'}\n"
                                    + format_schedule(schedule))
    program = schedule if has_comm else add_communication(schedule)
    pc = [0] * stages
    mailbox: set[tuple[int, str, int]] = set()  # messages sent, not yet received: (to stage, kind, mb)
    done_f: list[set[int]] = [set() for _ in range(stages)]
    done_b: list[set[int]] = [set() for _ in range(stages)]
    have_input: list[set[int]] = [set(range(microbatches)) if s == 0 else set() for s in range(stages)]
    have_grad: list[set[int]] = [set(range(microbatches)) if s == stages - 1 else set() for s in range(stages)]
    while True:
        progressed = False
        for s in range(stages):
            while pc[s] < len(program[s]):
                a = program[s][pc[s]]
                if a.comm == "s":
                    peer = s + 1 if a.kind == "F" else s - 1
                    if not 0 <= peer < stages:
                        raise ScheduleError(f"stage {s}: {a} sends to stage {peer}, which does not exist\n"
                                            + format_schedule(program, mark=(s, pc[s])))
                    if a.microbatch not in (done_f if a.kind == "F" else done_b)[s]:
                        break  # nothing to send yet
                    mailbox.add((peer, a.kind, a.microbatch))
                elif a.comm == "r":
                    if (s, a.kind, a.microbatch) not in mailbox:
                        break
                    mailbox.discard((s, a.kind, a.microbatch))
                    (have_input if a.kind == "F" else have_grad)[s].add(a.microbatch)
                elif a.kind == "F":
                    if a.microbatch not in have_input[s]:
                        break
                    done_f[s].add(a.microbatch)
                else:
                    if a.microbatch not in done_f[s] or a.microbatch not in have_grad[s]:
                        break
                    done_b[s].add(a.microbatch)
                pc[s] += 1
                progressed = True
        if all(pc[s] == len(program[s]) for s in range(stages)):
            return
        if not progressed:
            stuck = [(s, pc[s]) for s in range(stages) if pc[s] < len(program[s])]
            waits = "; ".join(f"stage {s} waits at {program[s][i]}" for s, i in stuck)
            raise ScheduleError(f"deadlock: {waits}\n" + format_schedule(program, mark=stuck[0]))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The theoretical idle fraction of a GPipe / 1F1B step: (S-1)/(M+S-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def microbatch_sizes(n: int, microbatches: int) -> list[int]:
    """Rows per micro-batch of an n-row batch: contiguous, sizes differ by at most one."""
    base, extra = divmod(n, microbatches)
    return [base + (1 if m < extra else 0) for m in range(microbatches)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once (F done, B not yet)."""
    held = peak = 0
    for a in actions:
        if a.is_compute:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
    return peak
