"""Options defined once: each option of a command is a field of that command's config dataclass.

A field made with :func:`option` carries its default, its range (a checking parser such as
``at_least(1)``), its choices and its help. From those fields come

- the command line (``flowtrain.cli.options.add_fields`` in the layer above: one flag per field, ``--help`` with the
  default and the range),
- the YAML ``--config`` keys (the field names, ``-`` or ``_``), checked by the same parsers,
- the run's ``config.json`` (:func:`to_config`: every field, a valid ``--config``),
- the Python API's checks (:func:`check`: the same ranges and choices, one error naming the field).

An option set names its ``--config`` section once, in its class body: ``SECTION: ClassVar[str] = "train"``.
The options a class declares itself are in its section (:attr:`Option.section`; the class's own ``SECTION``, not
a base's: a command's class adding its own options declares none, and they stay at the top level).
``connectors.sections`` nests and un-nests a command's options by them (``train: {lr: 0.01}`` is ``lr: 0.01``).

Each option name is declared once in the whole tree (``tests/unit/test_options_declared_once.py``). Options several
commands take are shared sections, small dataclasses a command lists among its bases; one whose options belong to
the section of whoever composes it says ``SECTION = COMPOSED`` (with the composer's ``GROUP`` in ``--help``), and a
command shows a shared option with its own help or default through :func:`tailor`, not a second declaration.

Stdlib only: defining a config imports nothing heavy, so ``--help`` stays fast. In the bottom layer, so that
every layer declares its options next to its code (``pipelines.stream.options``, ``flowtrain.train.options``).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from connectors.errors import FlowtrainError
from connectors.paths import StoreError, check_path

#: ``option(..., group=...)`` names the --help section; fields without one go to the command's own.
GENERAL = "options"


class OptionError(FlowtrainError):
    """A bad option, YAML key or input path; the message names it and says what to do."""


# --- checking parsers (text or a value -> typed value; the same for the CLI, YAML and the API) --------
def _number(text: Any, kind: type) -> float | int:
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}")
    try:
        value = kind(str(text).strip())
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def whole(text: Any) -> int:
    """Any whole number."""
    return _number(text, int)


whole.__name__ = "a whole number"


def number(text: Any) -> float:
    """Any finite number."""
    return _number(text, float)


number.__name__ = "a number"


def at_least(lo: float, kind: type = int) -> Callable[[Any], Any]:
    """A number >= ``lo`` (``kind`` int or float)."""
    noun = "a whole number" if kind is int else "a number"

    def parse(text: Any):
        value = _number(text, kind)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be {noun} >= {lo:g}, got {text}")
        return value

    parse.__name__ = f"{noun} >= {lo:g}"
    return parse


def above(lo: float) -> Callable[[Any], float]:
    """A number > ``lo``."""
    def parse(text: Any) -> float:
        value = _number(text, float)
        if value <= lo:
            raise argparse.ArgumentTypeError(f"must be a number > {lo:g}, got {text}")
        return value

    parse.__name__ = f"a number > {lo:g}"
    return parse


def fraction(*, inclusive_high: bool = False) -> Callable[[Any], float]:
    """A number in [0, 1) (or [0, 1])."""
    def parse(text: Any) -> float:
        value = _number(text, float)
        if value < 0 or value > 1 or (value == 1 and not inclusive_high):
            raise argparse.ArgumentTypeError(f"must be in [0, 1{']' if inclusive_high else ')'}, got {text}")
        return value

    parse.__name__ = f"a number in [0, 1{']' if inclusive_high else ')'}"
    return parse


def sizes(text: Any) -> tuple[int, ...]:
    """Comma-separated whole numbers >= 1, e.g. hidden sizes ``256,128``."""
    if isinstance(text, (tuple, list)):
        text = ",".join(str(t) for t in text)
    parts = [p.strip() for p in str(text).strip("[]()").split(",") if p.strip()]
    out = []
    for p in parts:
        try:
            out.append(int(p))
        except ValueError:
            out = []
            break
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers >= 1 such as 256,128, "
                                         f"got {text!r}")
    return tuple(out)


def names(text: Any) -> tuple[str, ...]:
    """Comma-separated names (column names, files): ``a,b`` or a list."""
    items = text if isinstance(text, (tuple, list)) else [text]
    return tuple(v.strip() for item in items for v in str(item).split(",") if v.strip())


names.__name__ = "comma-separated names"


def format_value(value: Any) -> str:
    """An option's value as a flag takes it (and ``--help`` shows its default): ``none``, ``a,b``, ``true``."""
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def text(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        raise argparse.ArgumentTypeError(f"expected one value, got {value!r}")
    return str(value)


text.__name__ = "text"


def store_path(option: str, *, remote: bool = True, many: bool = False) -> Callable[[Any], Any]:
    """A path option (``many``: comma-separated paths): local, or a URL (``gs://``, ``s3://``, ``az://``...)
    whose filesystem is installed (``connectors.paths.check_path``: else one line naming the scheme and the
    extra to install); ``remote=False``: a local path only."""
    def parse(value: Any) -> Any:
        values = names(value) if many else (text(value),)
        try:
            checked = tuple(check_path(v, option, remote=remote) for v in values)
        except StoreError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{option} ")) from None
        return checked if many else checked[0]

    parse.__name__ = "paths" if many else "a path"
    return parse


# --- the fields -------------------------------------------------------------------------------------------
def option(default: Any, help: str, *, parse: Callable[[Any], Any] | None = None,  # noqa: A002 - argparse's word
           choices: Iterable[Any] | None = None, group: str = GENERAL, metavar: str | None = None,
           repeat: bool = False, flag: str | None = None) -> Any:
    """A config dataclass field that is a command option.

    ``parse``: a checking parser (``at_least(1)``, ``fraction()``, ``sizes``...; default from the
    field's type); ``choices``: the allowed values; ``repeat``: the flag may be given several times
    (values are also comma-split); ``flag``: the option's name when it is not ``--field-name``.
    """
    meta = {"help": help, "parse": parse, "choices": tuple(choices) if choices is not None else None,
            "group": group, "metavar": metavar, "repeat": repeat, "flag": flag}
    return dataclasses.field(default=default, metadata={"flowtrain": meta})


class Option(NamedTuple):
    """One option as the CLI, YAML and the API see it."""

    name: str  # the field name, the YAML / config.json key
    flag: str  # --field-name
    default: Any
    help: str
    parse: Callable[[Any], Any] | None  # None: a true/false flag
    choices: tuple | None
    group: str
    metavar: str | None
    repeat: bool
    section: str | None = None  # its --config section (its class's SECTION); None: the top level

    @property
    def key(self) -> str:
        """Its key inside its section: the name without the section's name and ``_`` in front (``score_batch_size``
        in ``score``: ``batch_size``); the name itself at the top level or without that prefix."""
        short = self.name.removeprefix(f"{self.section}_") if self.section else self.name
        return short or self.name

    @property
    def place(self) -> str:
        """Where it goes in a nested ``--config``: ``section.key``, or its name at the top level."""
        return f"{self.section}.{self.key}" if self.section else self.name


#: ``SECTION = COMPOSED``: a shared section (one declaration of options that several option sets take, such as the
#: network's sizes that the batch run and the online trainer both read) whose options go to the ``--config`` section of
#: the option set that composes it (``train`` in ``TrainOptions``, ``trainer`` in ``StreamTrainOptions``).
COMPOSED = "<the section of the option set that composes it>"


def section_of(cls: type) -> str | None:
    """The ``--config`` section of the options ``cls`` declares itself: its own ``SECTION`` (not a base's)."""
    return vars(cls).get("SECTION")


def _origin(field: dataclasses.Field) -> dict:
    """The declaration of an option field: its ``option()`` metadata (a :func:`tailor`-ed copy points back to it)."""
    meta = field.metadata["flowtrain"]
    return meta.get("origin", meta)


def _declared_by(cls: type, field: dataclasses.Field) -> type:
    """The class in ``cls``'s bases (or ``cls``) that declares ``field``: the most basic one holding it (a dataclass
    passes its bases' fields on as they are, :func:`tailor` changes only a default or a help; a field declared
    again is a new one)."""
    origin = _origin(field)
    for c in reversed(cls.__mro__):
        own = vars(c).get("__dataclass_fields__", {}).get(field.name)
        if own is not None and "flowtrain" in own.metadata and _origin(own) is origin:
            return c
    return cls


def _composer(cls: type, declarer: type) -> type | None:
    """For a shared section (``SECTION = COMPOSED``): the nearest option set in ``cls``'s bases that composes
    ``declarer`` and names a section of its own (None: none does; its options are then at the top level)."""
    mro = cls.__mro__
    for c in reversed(mro[:mro.index(declarer)]):
        if issubclass(c, declarer) and section_of(c) not in (None, COMPOSED):
            return c
    return None


def _place(cls: type, declarer: type, group: str) -> tuple[str | None, str]:
    """(``--config`` section, ``--help`` group) of an option of ``cls`` that ``declarer`` declares: ``declarer``'s own
    ``SECTION`` and the option's group; for a shared section (``SECTION = COMPOSED``) the section of the option set
    composing it (:func:`_composer`), and that set's ``GROUP`` when it names one (the online trainer's options stay
    together in ``--help``)."""
    section = section_of(declarer)
    if section != COMPOSED:
        return section, group
    composer = _composer(cls, declarer)
    if composer is None:
        return None, group
    return section_of(composer), vars(composer).get("GROUP", group)


def _own_or_inherited(cls: type, name: str, decorator: str) -> dataclasses.Field:
    """The option field ``name`` as ``cls`` has it so far: a copy an earlier :func:`tailor` or :func:`narrow` on ``cls``
    made, else its nearest base's; a ``TypeError`` when no base has such an option."""
    pending = vars(cls).get(name)
    if isinstance(pending, dataclasses.Field) and "flowtrain" in pending.metadata:
        return pending
    base = next((c for c in cls.__mro__[1:] if name in vars(c).get("__dataclass_fields__", {})), None)
    if base is None or "flowtrain" not in base.__dataclass_fields__[name].metadata:
        raise TypeError(f"{cls.__name__}: {decorator}({name}=...) names no option of its bases")
    if "__annotations__" not in vars(cls):
        cls.__annotations__ = {}
    cls.__annotations__[name] = next(vars(c)["__annotations__"][name] for c in base.__mro__
                                     if name in vars(c).get("__annotations__", {}))
    return base.__dataclass_fields__[name]


def _copy(cls: type, name: str, field: dataclasses.Field, meta: dict, default: Any) -> None:
    """``cls``'s own copy of option ``field`` with metadata ``meta``: still its declaration (``origin``), not a new one."""
    copy = {**field.metadata["flowtrain"], **meta, "origin": _origin(field)}
    setattr(cls, name, dataclasses.field(default=default, metadata={"flowtrain": copy}))


def tailor(**changes: dict[str, Any]) -> Callable[[type], type]:
    """A class decorator, under ``@dataclass``: options that ``cls`` takes from a shared section, with another
    default, help, ``--help`` group or metavar in this option set only::

        @dataclass
        @tailor(timeout={"default": 180.0, "help": "seconds to wait for every TaskManager to register"})
        class FlinkStartJob(Timeout): ...

    The option stays declared once (its name, flag, type, parser, choices and ``--config`` section are its
    declaration's; ``options_of`` and the declared-once test see one): what the option means and how it is checked
    stay one. Say next to it why this command needs its own default: a default users already have is the interface."""
    def apply(cls: type) -> type:
        for name, change in changes.items():
            unknown = sorted(set(change) - {"default", "help", "group", "metavar"})
            if unknown:
                raise TypeError(f"tailor({name}=...): only default, help, group and metavar change, not "
                                f"{', '.join(unknown)}")
            field = _own_or_inherited(cls, name, "tailor")
            _copy(cls, name, field, {k: v for k, v in change.items() if k != "default"},
                  change.get("default", field.default))
        return cls

    return apply


def narrow(**checks: dict[str, Any]) -> Callable[[type], type]:
    """A class decorator, under ``@dataclass`` (beside :func:`tailor`): options that ``cls`` takes from a shared
    section, checked more strictly in this option set only, where the command cannot use all that the declaration
    accepts::

        @dataclass
        @narrow(out={"parse": store_path("--out", remote=False)})  # the stream's run directory: a local one
        class StreamCommon(Out): ...

    ``parse``: a checking parser the value goes through before the declaration's (a value must pass both: only ever
    fewer values); ``choices``: a subset of the declaration's (``cpu, cuda`` of ``auto, cpu, cuda``). The flag, its
    ``--help`` range and choices, ``--config`` and the API check (``check``, ``build``) use the narrower rule, with
    its message. The option stays declared once: its name, meaning, type and section are its declaration's."""
    def apply(cls: type) -> type:
        for name, check in checks.items():
            unknown = sorted(set(check) - {"parse", "choices"})
            if unknown:
                raise TypeError(f"narrow({name}=...): only parse and choices narrow, not {', '.join(unknown)}")
            field = _own_or_inherited(cls, name, "narrow")
            meta = field.metadata["flowtrain"]
            change: dict[str, Any] = {}
            if "choices" in check:
                choices = tuple(check["choices"])
                if meta["choices"] is None or not set(choices) <= set(meta["choices"]):
                    raise TypeError(f"{cls.__name__}: narrow({name}=...): choices {choices} are not a subset of "
                                    f"the declaration's {meta['choices']}")
                change["choices"] = choices
            if "parse" in check:
                earlier = meta.get("narrow")
                change["narrow"] = check["parse"] if earlier is None else _both(check["parse"], earlier)
            _copy(cls, name, field, change, field.default)
        return cls

    return apply


def _both(first: Callable[[Any], Any], then: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A parser: ``first``, then ``then`` on its result (a value passes both); named as ``first``."""
    def parse(value: Any) -> Any:
        return then(first(value))

    parse.__name__ = first.__name__
    return parse


def _parser_for(tp: Any) -> Callable[[Any], Any] | None:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        tp = args[0]
    if tp is bool:
        return None
    if tp is int:
        return whole
    if tp is float:
        return number
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0] if typing.get_args(tp) else str
        return sizes if inner is int else names
    return text


def options_of(cls: type) -> list[Option]:
    """The options of config dataclass ``cls``, in field order (fields made with :func:`option`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("flowtrain")
        if meta is None:
            continue
        parse = meta["parse"] or _parser_for(hints[f.name])
        if meta.get("narrow") is not None:  # a command's stricter check first (``narrow``)
            parse = _both(meta["narrow"], parse)
        section, group = _place(cls, _declared_by(cls, f), meta["group"])
        out.append(Option(f.name, meta["flag"] or "--" + f.name.replace("_", "-"), f.default, meta["help"],
                          parse, meta["choices"], group, meta["metavar"], meta["repeat"], section))
    return out


def check_value(opt: Option, value: Any) -> Any:
    """``value`` through the option's parser and choices; an ``OptionError`` naming the option."""
    if value is None:
        return None
    if opt.parse is None:
        if not isinstance(value, bool):
            raise OptionError(f"{opt.name}: {value!r} is not true or false ({opt.flag})")
        return value
    try:
        typed = opt.parse(value)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
        raise OptionError(f"{opt.name} ({opt.flag}): {err}") from None
    if opt.choices is not None and typed not in opt.choices:
        raise OptionError(f"{opt.name} ({opt.flag}): {value!r} is not one of {', '.join(map(str, opt.choices))}")
    return typed


def check(config: Any) -> Any:
    """A copy of ``config`` with every option checked and typed as the command line would (ranges, choices,
    comma-separated lists); a bad value is an ``OptionError`` naming the field."""
    return dataclasses.replace(config, **{o.name: check_value(o, getattr(config, o.name))
                                          for o in options_of(type(config))})


def validate(config: Any, cls: type | None = None) -> None:
    """Every option of ``config`` (of ``cls``'s options, a base's: a config's own set) checked in place as
    :func:`check` checks them, for a config's ``__post_init__``; a bad value is an ``OptionError`` naming it."""
    for opt in options_of(cls or type(config)):
        check_value(opt, getattr(config, opt.name))


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The option a mistyped or borrowed ``name`` most likely means, or None: a close spelling (difflib:
    ``epoch`` -> ``epochs``), an option whose words it holds (``max_epochs`` -> ``epochs``,
    ``per_device_train_batch_size`` -> ``batch_size``), its words' initials (``learning_rate`` -> ``lr``),
    or the one option holding its words (``warmup`` -> ``warmup_steps``). ``-`` and ``_`` alike."""
    key = str(name).strip().lstrip("-").replace("-", "_").lower()
    by_key = {str(k).lstrip("-").replace("-", "_").lower(): k for k in known}
    if key in by_key:
        return by_key[key]
    close = difflib.get_close_matches(key, list(by_key), n=1)
    if close:
        return by_key[close[0]]
    words = [w for w in key.split("_") if w]
    inside = [k for k in by_key if set(k.split("_")) <= set(words)]
    if inside:
        return by_key[max(inside, key=lambda k: (len(k.split("_")), len(k)))]
    initials = "".join(w[0] for w in words)
    if len(words) > 1 and initials in by_key:
        return by_key[initials]
    holding = [k for k in by_key if set(words) <= set(k.split("_"))]
    return by_key[holding[0]] if len(holding) == 1 else None


def build(cls: type, values: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """``cls`` from keyword values (``-`` or ``_`` in the keys), checked; an unknown key is an ``OptionError``
    naming it and the close option."""
    merged = {str(k).replace("-", "_"): v for k, v in {**(values or {}), **kwargs}.items()}
    known = {o.name for o in options_of(cls)}
    unknown = sorted(set(merged) - known)
    if unknown:
        hints = [k + (f" (did you mean {c}?)" if (c := nearest(k, sorted(known))) else "") for k in unknown]
        raise OptionError(f"{cls.__name__}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    return check(cls(**merged))


def plain(value: Any) -> Any:
    """A value as JSON / YAML writes it (tuples as lists)."""
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def to_config(config: Any) -> dict[str, Any]:
    """Every option of ``config`` as ``{name: value}``, flat: what ``config.json`` holds; a valid ``--config`` of
    the same command (``--print-config`` prints them in their sections: ``connectors.sections.to_sections``)."""
    return {o.name: plain(getattr(config, o.name)) for o in options_of(type(config))}
