"""``flowtrain tune``'s search space: what each trial's ``flowtrain batch`` run varies, and the flags it becomes.

A space is a list of ``Dimension``: a float or integer range (uniform or log-uniform) or a list of choices, named
after a ``flowtrain batch`` option (``lr``, ``dropout``, ``weight_decay``, ``ensemble``, ``numeric_embedding``,
``batch_size``, ...) or ``width`` / ``depth``, which together make ``--hidden`` (``depth`` layers of ``width``).
Written ``name=LOW:HIGH[:log][:int]`` or ``name=A|B|C``, comma-separated (``--search``), or as a YAML mapping
(``--search FILE.yaml``: ``lr: 1e-4:1e-1:log``, ``ensemble: [1, 4, 8]``, or ``{low, high, log, int}``).
``default_space(kind)`` is the space a study searches without ``--search``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from connectors.fields import OptionError, check_value, nearest, options_of
from flowtrain.commands.batch.options import BatchJob

#: The names a space may use besides the batch options: they make --hidden together.
SHAPE = ("width", "depth")
#: Batch options a trial must not set: the study owns them.
OWNED = ("out", "dataset", "resume", "overwrite", "input", "job_only", "print_plan", "seed")


@dataclass(frozen=True)
class Dimension:
    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    integer: bool = False
    choices: tuple | None = None

    def sample(self, trial) -> Any:
        """This dimension's value for an Optuna ``trial``."""
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)

    def text(self) -> str:
        if self.choices is not None:
            return "|".join(map(str, self.choices))
        return f"{self.low:g}:{self.high:g}" + (":log" if self.log else "") + (":int" if self.integer else "")


def default_space(kind: str) -> list[Dimension]:
    """The search space of a study without ``--search``: the learning rate, the network's shape (width, depth),
    dropout, weight decay, the numeric embeddings' width and frequency scale and the ensemble's size; the same for
    every kind of label
    (``kind``: binary, multiclass, regression), whose validation metric the study optimizes."""
    del kind  # the same dimensions for every task; the objective's metric and direction are the task's
    return parse_space("lr=3e-4:1e-2:log,width=64:512:int:log,depth=1:3:int,dropout=0:0.4,"
                       "weight_decay=1e-6:1e-2:log,numeric_embedding=0|8|16|32,frequency_scale=0.1:3:log,"
                       "ensemble=1|2|4|8", batch_options())


def batch_options() -> dict:
    """The ``flowtrain batch`` options a dimension may name: ``{name: Option}``."""
    return {o.name: o for o in options_of(BatchJob) if o.name not in OWNED}


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def _dimension(name: str, spec: Any, where: str) -> Dimension:
    if isinstance(spec, (list, tuple)):
        return Dimension(name, choices=tuple(spec))
    if isinstance(spec, dict):
        try:
            return Dimension(name, float(spec["low"]), float(spec["high"]), bool(spec.get("log", False)),
                             bool(spec.get("int", False)))
        except (KeyError, TypeError, ValueError):
            raise OptionError(f"{where}: {name}: expected {{low, high, log, int}}, a list of choices or "
                              f"LOW:HIGH[:log][:int]") from None
    text = str(spec).strip()
    if "|" in text:
        return Dimension(name, choices=tuple(_value(v) for v in text.split("|") if v.strip()))
    parts = [p.strip() for p in text.split(":")]
    flags = set(parts[2:])
    try:
        low, high = float(parts[0]), float(parts[1])
    except (IndexError, ValueError):
        raise OptionError(f"{where}: {name}={text}: expected LOW:HIGH[:log][:int] (e.g. lr=1e-4:1e-1:log) or "
                          f"choices A|B|C") from None
    if flags - {"log", "int"} or not low < high or ("log" in flags and low <= 0):
        raise OptionError(f"{where}: {name}={text}: LOW < HIGH (both > 0 with log), then :log and/or :int")
    return Dimension(name, low, high, "log" in flags, "int" in flags)


def parse_space(search: str | dict, options: dict | None = None) -> list[Dimension]:
    """``--search``'s text (``name=SPEC,...``), a YAML file's path, or a mapping -> the dimensions; an unknown
    name or a bad range is an ``OptionError`` naming it."""
    options = options if options is not None else batch_options()
    where = "--search"
    if isinstance(search, str) and search.strip().endswith((".yaml", ".yml")):
        path = Path(search.strip())
        where = f"--search {path}"
        try:
            search = yaml.safe_load(path.read_text())
        except OSError as err:
            raise OptionError(f"{where}: cannot read it ({err.strerror})") from None
        if not isinstance(search, dict):
            raise OptionError(f"{where}: expected a mapping of name: LOW:HIGH[:log][:int] or [choices]")
    if isinstance(search, str):
        items = []
        for part in (p.strip() for p in search.split(",") if p.strip()):
            name, sep, spec = part.partition("=")
            if not sep:
                raise OptionError(f"{where}: {part!r}: expected name=LOW:HIGH[:log][:int] or name=A|B|C")
            items.append((name.strip(), spec))
    else:
        items = list(search.items())
    space = []
    for name, spec in items:
        name = str(name).replace("-", "_")
        if name not in options and name not in SHAPE:
            close = nearest(name, [*options, *SHAPE])
            raise OptionError(f"{where}: {name!r} is not a flowtrain batch option to search"
                              + (f" (did you mean {close}?)" if close else "") + "; width and depth make --hidden")
        dim = _dimension(name, spec, where)
        if name in options:  # every value the space may give must be one the option takes
            for value in dim.choices or (dim.low, dim.high):
                try:
                    check_value(options[name], int(value) if dim.integer else value)
                except OptionError as err:
                    raise OptionError(f"{where}: {name}: {err}") from None
        space.append(dim)
    names = [d.name for d in space]
    if len(set(names)) != len(names):
        raise OptionError(f"{where}: a name is given twice ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    if ("hidden" in names) and (set(SHAPE) & set(names)):
        raise OptionError(f"{where}: search hidden or width/depth, not both")
    return space


def trial_flags(params: dict, options: dict | None = None) -> list[str]:
    """A trial's sampled ``params`` as ``flowtrain batch`` flags (``width``/``depth`` as ``--hidden``)."""
    options = options if options is not None else batch_options()
    flags: list[str] = []
    rest = dict(params)
    if "width" in rest or "depth" in rest:
        width, depth = int(rest.pop("width", 128)), int(rest.pop("depth", 2))
        flags += ["--hidden", ",".join([str(width)] * depth)]
    for name, value in rest.items():
        opt = options[name]
        if opt.parse is None:  # a true/false option
            if value in (True, "true", "True", 1):
                flags.append(opt.flag)
            continue
        flags += [opt.flag, f"{value:.6g}" if isinstance(value, float) else str(value)]
    return flags
