"""A command's options as nested ``--config`` sections, and back to the flat names.

Each option set names its section once (``SECTION: ClassVar[str] = "train"``, read by ``connectors.fields``);
its options are then written either flat, by name, as ever (``score_batch_size: 64``: every flag's name, every
``config.json`` key), or inside their section (``score: {batch_size: 64}``): an option whose name starts with
its section's name and ``_`` drops that prefix there (``score_batch_size`` is ``score.batch_size``; the full name
is taken there too). Flat keys and sections mix in one file.

- :func:`unnest`: a loaded ``--config`` mapping as ``{option name: (the key as written, value)}``; a key in the
  wrong section, an unknown section, or an option given twice (flat and nested) is one ``OptionError`` naming the
  key, the file and the right place.
- :func:`to_sections`: a config's options nested, as ``--print-config`` prints them (the top-level options, then
  each section in the order its first option comes in ``--help``): a valid ``--config`` of the same command.
- :func:`flat_config`: a nested or mixed mapping as the flat ``{name: value}`` that ``config.json`` holds.

Stdlib only, like ``connectors.fields``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from connectors.fields import Option, OptionError, nearest, options_of, plain


def _key(text: Any) -> str:
    return str(text).strip().lstrip("-").replace("-", "_")


def layout(options: Iterable[Option]) -> dict[str, dict[str, Option]]:
    """``{section: {key: option}}`` in the order of the options' first appearance (both an option's key and its
    full name find it inside its section). A key two options of a section share, or a top-level option named like
    a section, is a ``TypeError``: a declaration to fix, not a user's input."""
    options = list(options)
    out: dict[str, dict[str, Option]] = {}
    for opt in options:
        if opt.section:
            keys = out.setdefault(opt.section, {})
            for key in dict.fromkeys((opt.key, opt.name)):
                if key in keys and keys[key] is not opt:
                    raise TypeError(f"section {opt.section}: {keys[key].name} and {opt.name} are both "
                                    f"{opt.section}.{key}; rename one or move it to another section")
                keys[key] = opt
    clash = sorted(o.name for o in options if not o.section and o.name in out)
    if clash:
        raise TypeError(f"the top-level option {clash[0]} is named like the section {clash[0]}; declare it in "
                        f"that section (SECTION = {clash[0]!r}) or rename it")
    return out


def unnest(values: Mapping[Any, Any], options: Iterable[Option], where: str,
           ) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """A ``--config`` mapping (flat keys and sections, mixed) as ``({name: (key as written, value)}, unknown)``:
    ``unknown`` the top-level keys that are neither an option nor a section (the caller names them with its own
    did-you-mean). A key in the wrong section, an unknown section, a section that is not a mapping, or one option
    given twice is an ``OptionError`` starting with ``where`` (the file) and naming the right place."""
    options = list(options)
    by_name = {o.name: o for o in options}
    sections = layout(options)
    out: dict[str, tuple[str, Any]] = {}
    unknown: list[str] = []
    problems: list[str] = []

    def put(opt: Option, written: str, value: Any) -> None:
        if opt.name in out:
            problems.append(f"{opt.name} is given twice, as {out[opt.name][0]!r} and as {written!r}; keep one "
                            f"({opt.place})")
        else:
            out[opt.name] = (written, value)

    for raw, value in values.items():
        key = _key(raw)
        if key in sections and (isinstance(value, Mapping) or value is None):
            for raw_sub, sub_value in (value or {}).items():
                sub = _key(raw_sub)
                opt = sections[key].get(sub)
                if opt is None:
                    problems.append(_misplaced(key, sub, options, sections))
                else:
                    put(opt, f"{key}.{raw_sub}", sub_value)
        elif key in by_name:
            put(by_name[key], str(raw), value)
        elif key in sections:
            example = next(iter(sections[key].values()))
            problems.append(f"{str(raw)!r} is a section: give it a mapping of its options "
                            f"({key}: {{{example.key}: ...}})")
        elif isinstance(value, Mapping) and (close := nearest(key, sections)):
            problems.append(f"unknown section {str(raw)!r} (did you mean {close!r}?)")
        elif isinstance(value, Mapping) and sections:
            problems.append(f"unknown section {str(raw)!r} (the sections: {', '.join(sections)})")
        else:
            unknown.append(str(raw))
    if problems:
        raise OptionError(f"{where}: {'; '.join(problems)}")
    return out, unknown


def _misplaced(section: str, key: str, options: list[Option], sections: dict[str, dict[str, Option]]) -> str:
    """One line for ``section.key`` that is not in ``section``: the option(s) of that name elsewhere, else the
    nearest key of the section, else the nearest option anywhere."""
    where = f"{section}.{key}"
    homes = [o.place for o in options if key in (o.name, o.key)]
    if not homes:
        close = nearest(key, sections[section])
        homes = [f"{section}.{sections[section][close].key}"] if close else []
    if not homes:
        close = nearest(key, [o.name for o in options])
        homes = [o.place for o in options if o.name == close]
    hint = f" (did you mean {' or '.join(homes)}?)" if homes else ""
    return f"{where!r} is not an option of section {section}{hint}"


def to_sections(config: Any) -> dict[str, Any]:
    """Every option of ``config`` nested: the top-level options, then each section (``{key: value}``) in the order
    of its first option; what ``--print-config`` prints, a valid ``--config`` of the same command."""
    options = options_of(type(config))
    layout(options)  # a clash is a declaration's error, named
    out: dict[str, Any] = {o.name: plain(getattr(config, o.name)) for o in options if not o.section}
    for opt in options:
        if opt.section:
            out.setdefault(opt.section, {})[opt.key] = plain(getattr(config, opt.name))
    return out


def flat_config(values: Mapping[Any, Any], cls: type) -> dict[str, Any]:
    """A nested or mixed ``--config`` mapping of ``cls``'s options as ``{name: value}`` (values as given); an
    unknown key is an ``OptionError`` naming it and the nearest option."""
    options = options_of(cls)
    out, unknown = unnest(values, options, cls.__name__)
    if unknown:
        hints = [k + (f" (did you mean {c}?)" if (c := nearest(k, [o.name for o in options])) else "")
                 for k in unknown]
        raise OptionError(f"{cls.__name__}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    return {name: value for name, (_, value) in out.items()}
