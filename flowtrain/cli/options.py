"""Command-line options, one way for every command: defaults, --config YAML, checks, Beam options.

- **Options once.** A command whose options are a config dataclass (``BatchJob``, ``PredictJob``,
  ``ExportJob``: fields made with ``connectors.fields.option``) gets its flags from ``add_fields``:
  one flag per field (``--field-name``), its type and range from the field's parser, its choices,
  help and default from the field. ``--config`` keys are the same names, ``config.json`` holds the
  same keys (``connectors.fields.to_config``). Every default is the field's, in one place.
- **Sections.** ``--config`` also takes the options nested in their option set's section (``train: {lr: 0.01}``,
  ``score: {batch_size: 64}`` for ``score_batch_size``; ``connectors.sections``), flat keys and sections mixed;
  ``--print-config`` prints the nested form, ``config.json`` stays flat: both are valid ``--config`` files.
- **The command line wins over --config, but only for what it says.** An option counts as given
  when it appears on the command line; a ``store_true`` flag that is absent does not turn a YAML
  ``resume: true`` off.
- **YAML keys are option names** (``-`` or ``_``), at the top level or in their section; an unknown key, a key
  in the wrong section, an option given twice, or a value of the wrong type or out of range, is an error naming
  the key and the file. Values go through the option's own
  ``type``, so YAML and the command line are checked alike.
- **Ranges** are option types (``at_least(1)``, ``above(0)``, ``fraction()``): argparse names the
  option in its message, ``--config`` names the key.
- **Options flowtrain does not know** must be Beam pipeline options (checked against Beam's own
  option classes) or come after ``--`` (passed to Beam unchecked, e.g. a custom runner's).
- ``--kafka-config KEY=VALUE``: the key must be a kafka-python option every client takes; the value
  is typed (bool, int, float or text) by the option's default, after ``${env:NAME}`` is replaced by
  the environment variable. ``--kafka-config-file client.properties`` (or
  ``$FLOWTRAIN_KAFKA_CONFIG_FILE``): a Java client properties file (``connectors.kafka.config``);
  ``--kafka-config`` pairs win over its keys.
"""
from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from connectors.fields import (  # noqa: F401
    GENERAL,
    Option,
    OptionError,
    above,
    at_least,
    format_value,
    fraction,
    nearest,
    options_of,
    sizes,
)
from connectors.sections import to_sections, unnest

#: Parser defaults attached by the commands; not options.
INTERNAL = frozenset({"func", "accepts_beam_args", "options_parser", "options", "command", "help", "print_config",
                      "run_positional", "option_class"})


# --- a config dataclass's fields as flags --------------------------------------------------------------
def _help(opt) -> str:
    text = opt.help.replace("%", "%%")
    rng = getattr(opt.parse, "__name__", "")
    if rng and any(c in rng for c in "<>=[(") and rng not in text:
        text += f"; {rng}"
    if opt.parse is None:
        return text
    default = "none" if opt.default in (None, ()) else format_value(opt.default).replace("%", "%%")
    return f"{text} (default: {default})" if "default" not in opt.help.lower() else text


def add_fields(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per option field of config dataclass ``cls`` (``connectors.fields``), in sections by the
    fields' groups, plus ``--config`` and ``--print-config`` (``cls`` stays the parser's default ``option_class``:
    ``load_config`` reads its sections)."""
    parser.set_defaults(option_class=cls)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="YAML (or JSON: a run's config.json) file with any of these options, keys as the "
                             "flags without '--' ('-' or '_'), or in their sections as --print-config shows "
                             "them; the command line wins over it")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective options (defaults, --config and the command line) as YAML, in "
                             "their sections, and stop")
    groups: dict[str, Any] = {GENERAL: parser}
    for opt in options_of(cls):
        target = groups.get(opt.group) or groups.setdefault(opt.group, parser.add_argument_group(opt.group))
        kwargs: dict[str, Any] = {"dest": opt.name, "help": _help(opt)}
        if opt.metavar:
            kwargs["metavar"] = opt.metavar
        # a field whose flag is not --field-name (--aggregate for aggregations) takes --field-name too
        flags = [opt.flag, *([f"--{opt.name.replace('_', '-')}"] if opt.flag != f"--{opt.name.replace('_', '-')}"
                             else [])]
        if opt.parse is None:
            target.add_argument(*flags, action="store_true", default=False, **kwargs)
        elif opt.repeat:
            target.add_argument(*flags, action="append", default=None, **kwargs)
        else:
            target.add_argument(*flags, type=opt.parse, choices=opt.choices, default=opt.default, **kwargs)


def print_config(config: Any) -> None:
    """``--print-config``: the effective options as YAML, nested in their sections (a valid ``--config``)."""
    import yaml

    print(yaml.safe_dump(to_sections(config), sort_keys=False, default_flow_style=None), end="")


# --- which options were given, YAML, merging ----------------------------------------------------------
def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[ours..., "--", beam...]`` -> (ours, beam): everything after ``--`` goes to Beam unchecked."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return list(argv), []


def _optional_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in INTERNAL]


def given(top: argparse.ArgumentParser, sub: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options of ``sub`` that ``argv`` gives explicitly (parsed again with every default suppressed)."""
    actions = _optional_actions(sub)
    saved = {a: a.default for a in actions}
    try:
        for a in actions:
            a.default = argparse.SUPPRESS
        ns, _ = top.parse_known_args(argv)
    finally:
        for a, d in saved.items():
            a.default = d
    return {a.dest for a in actions if hasattr(ns, a.dest)}


def option_name(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def load_config(path: str | Path, sub: argparse.ArgumentParser) -> dict[str, Any]:
    """A --config YAML file (flat keys and sections, mixed) as {dest: typed value}, checked against ``sub``'s
    options (in the sections of ``sub``'s ``option_class``: ``add_fields``)."""
    import yaml

    path = Path(path)
    where = f"--config {path}"
    if not path.is_file():
        raise OptionError(f"{where}: no such file" if not path.exists() else f"{where} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise OptionError(f"{where} is not valid YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise OptionError(f"{where} must hold a mapping of option: value (e.g. 'epochs: 5'), "
                          f"not a {type(loaded).__name__}")
    actions = {a.dest: a for a in _optional_actions(sub) if a.dest != "config"}
    cls = sub.get_default("option_class")
    declared = {o.name: o for o in options_of(cls)} if cls else {}
    options = [declared.get(dest) or Option(dest, option_name(a), a.default, a.help or "", a.type, a.choices,
                                            GENERAL, a.metavar, False) for dest, a in actions.items()]
    found, unknown = unnest(loaded, options, where)
    out: dict[str, Any] = {}
    for dest, (key, value) in found.items():
        typed = _coerce(actions[dest], value, f"{where}: {key}")
        if typed is not None:
            out[dest] = typed
    if unknown:
        hints = []
        for key in unknown:
            close = nearest(key, sorted(actions))
            hints.append(f"{key!r}" + (f" (did you mean {close!r}?)" if close else ""))
        keys = "" if all("did you mean" in h for h in hints) else \
            "; the keys are this command's options without '--'"
        raise OptionError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}{keys}")
    return out


def _coerce(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value through the option's own rules (flag, list, type, choices)."""
    flag = option_name(action)
    if value is None:
        return None
    if action.nargs == 0:  # store_true and friends
        if not isinstance(value, bool):
            raise OptionError(f"{where}: {value!r} is not true or false (the flag {flag})")
        return value if action.const is True else (not value if action.const is False else value)
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001 - argparse's own class
        items = value if isinstance(value, list) else [value]
        if isinstance(value, dict):
            items = [f"{k}={format_value(v)}" for k, v in value.items()]
        return [_coerce_one(action, item, where, flag) for item in items]
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return _coerce_one(action, value, where, flag)


def _coerce_one(action: argparse.Action, value: Any, where: str, flag: str) -> Any:
    if isinstance(value, bool):
        raise OptionError(f"{where}: {value!r} is not a valid value for {flag} (a true/false flag value "
                          f"where {flag} takes {_takes(action)})")
    if isinstance(value, (dict, list)):
        raise OptionError(f"{where}: expected one value for {flag}, got a {type(value).__name__}")
    text = format_value(value)
    try:
        typed = action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
        raise OptionError(f"{where}: {err} ({flag} takes {_takes(action)})") from None
    if action.choices is not None and typed not in action.choices:
        raise OptionError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return typed


def _takes(action: argparse.Action) -> str:
    if action.choices:
        return "one of " + ", ".join(map(str, action.choices))
    name = getattr(action.type, "__name__", None)
    return {"int": "a whole number", "float": "a number", "sizes": "comma-separated sizes such as 256,128",
            None: "text"}.get(name, name or "text")


def resolve(top: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Merge YAML and the command line into ``args`` (command line wins where it spoke); return
    the options that were set (YAML or command line), as ``{dest: value}``.

    Afterwards ``args`` holds every option's value: given, from YAML, or (read through
    ``Options``) the dataclass default.
    """
    sub = args.options_parser
    merged: dict[str, Any] = {}
    if getattr(args, "config", None):
        merged.update(load_config(args.config, sub))
    for dest in given(top, sub, argv):
        value = getattr(args, dest)
        if dest != "config" and value is not None:
            merged[dest] = value
    for dest, value in merged.items():
        setattr(args, dest, value)
    return merged


def closest_flag(name: str, flags: Iterable[str]) -> str | None:
    """The flag closest to a mistyped ``name`` (``--lable`` -> ``--label``), compared without the dashes
    (``--foo`` is not close to ``--out``); None when none is close."""
    by_name = {f.lstrip("-"): f for f in flags if f.startswith("--")}
    close = difflib.get_close_matches(name.lstrip("-"), list(by_name), n=1) or [nearest(name, by_name)]
    return by_name[close[0]] if close[0] else None


# --- options for Beam ---------------------------------------------------------------------------------
def check_beam_args(tokens: list[str], ours: Iterable[str] = (), command: str = "flowtrain batch") -> None:
    """Every token must parse as a Beam pipeline option; else an error naming the unknown ones
    (with the closest flowtrain or Beam option; ``command`` names the command in the hint)."""
    if not tokens:
        return
    from apache_beam.options.pipeline_options import PipelineOptions

    seen: dict[str, list[str]] = {}

    def capture(parser) -> None:  # Beam's own parser, with every option class's arguments
        _, seen["unknown"] = parser.parse_known_args(tokens)
        seen["known"] = [s for action in parser._actions for s in action.option_strings]

    import logging

    beam_log = logging.getLogger("apache_beam.options.pipeline_options")
    level = beam_log.level
    beam_log.setLevel(logging.ERROR)  # its "Discarding unparseable args" warning: the error below says it
    try:
        PipelineOptions(tokens).get_all_options(add_extra_args_fn=capture)
    finally:
        beam_log.setLevel(level)
    unknown = seen.get("unknown") or []
    if not unknown:
        return
    names = []
    candidates = list(ours) + seen.get("known", [])
    # a value right after an unknown option belongs to it: name the option only
    unknown = [t for i, t in enumerate(unknown)
               if t.startswith("-") or i == 0 or not unknown[i - 1].startswith("-") or "=" in unknown[i - 1]]
    for token in unknown:
        name = token.split("=", 1)[0]
        close = closest_flag(name, candidates) if name.startswith("-") else None
        names.append(name + (f" (did you mean {close}?)" if close else ""))
    kind = "option" if all(n.startswith("-") for n in names) else "argument"
    unknown_ = f"unknown {kind}{'s' if len(names) > 1 else ''} {', '.join(names)}"
    if all("did you mean" in n for n in names):  # a typo: the suggestion is the whole message
        raise OptionError(unknown_)
    raise OptionError(f"{unknown_}: neither a flowtrain option nor a Beam pipeline option (options of a runner "
                      f"Beam does not know go after `--`: `{command} ... -- --my_runner_option=1`)")
