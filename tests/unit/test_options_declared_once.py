"""Issue 48: an option name is declared once in the whole tree (``connectors.fields.option`` in one class); a command
takes it by composing that class (a shared section), and a command that needs another default or help says so with
``connectors.fields.tailor``, which is not a second declaration.

``NOT_YET_ONE`` lists the names still declared in several classes, to fold into shared sections; it may only shrink:
a new name declared twice fails, and so does a listed name that is declared once now (take it off the list).
"""
from __future__ import annotations

import dataclasses
import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

from connectors.fields import COMPOSED, OptionError, at_least, build, narrow, option, options_of, tailor, to_config

ROOT = Path(__file__).resolve().parents[2]

#: Names still declared in more than one class (issue 48, item 1: fold them into shared sections).
NOT_YET_ONE = {
    # one name, two meanings: `predict`/`drift --model` is a trained model, a run or bundle directory (their one
    # declaration: commands.shared_options.RunOrBundle), `batch --model` your own model's factory MODULE:FACTORY
    # (train.options.ModelOptions): other values, checks and help; one option would be a lie in both. Renaming one flag
    # is an interface change, not a fold.
    "model",
    # two meanings too: `stream --batch-size` is the feature pipeline's micro-batch (events, closed by size or
    # --max-delay: pipelines.stream.options), `batch --batch-size` rows per optimizer step, chosen from the table when
    # unset (train.options.TrainOptions); and one declaration would have to sit in connectors (flowtrain.train may not
    # import pipelines), which holds no option of a command
    "batch_size",
}


def option_classes() -> list[type]:
    """Every dataclass of the packages that declares options (the modules whose source calls an ``option()``)."""
    found: list[type] = []
    for pkg in ("connectors", "pipelines", "flowtrain"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if not re.search(r"= (option|\w+_option)\(", path.read_text()):
                continue
            module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
            found += [c for c in vars(module).values()
                      if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    return found


def declarations() -> dict[str, list[str]]:
    """``{option name: [the classes that declare it]}``: a field made by ``option()`` in the class's own body (a
    ``tailor``-ed copy points back to its declaration and is not one)."""
    out: dict[str, list[str]] = defaultdict(list)
    for cls in option_classes():
        own = vars(cls).get("__annotations__", {})
        for f in vars(cls)["__dataclass_fields__"].values():
            meta = f.metadata.get("flowtrain")
            if f.name in own and meta is not None and "origin" not in meta:
                out[f.name].append(f"{cls.__module__}.{cls.__qualname__}")
    return out


def test_an_option_name_is_declared_once_in_the_whole_tree():
    twice = {name: classes for name, classes in declarations().items() if len(classes) > 1}
    new = {name: classes for name, classes in twice.items() if name not in NOT_YET_ONE}
    assert not new, ("options declared in more than one class (declare each once, in a shared section the commands "
                     f"compose; connectors.fields.tailor gives a command another default or help): {new}")
    folded = sorted(NOT_YET_ONE - set(twice))
    assert not folded, f"declared once now: take {folded} off NOT_YET_ONE"
    assert len(twice) <= len(NOT_YET_ONE)


def test_the_check_sees_a_second_declaration_and_not_a_tailored_one():
    @dataclass_
    class Shared:
        SECTION = COMPOSED
        level: int = option(1, "a level")

    @dataclass_
    class Batch(Shared):
        SECTION = "train"

    @dataclass_
    @tailor(level={"default": 3, "help": "a stream's level"})
    class Stream(Shared):
        SECTION = "trainer"

    @dataclass_
    class Again:
        level: int = option(2, "declared again")

    own = {c: [f.name for f in vars(c)["__dataclass_fields__"].values() if f.name in vars(c).get("__annotations__", {})
               and "origin" not in f.metadata["flowtrain"]] for c in (Shared, Batch, Stream, Again)}
    assert own == {Shared: ["level"], Batch: [], Stream: [], Again: ["level"]}
    (b,), (s,) = options_of(Batch), options_of(Stream)
    assert (b.default, b.help, b.section, b.place) == (1, "a level", "train", "train.level")
    assert (s.default, s.help, s.section, s.place) == (3, "a stream's level", "trainer", "trainer.level")
    assert Stream().level == 3 and Batch().level == 1
    assert to_config(build(Stream, {"level": "5"})) == {"level": 5}


def test_tailor_refuses_what_is_no_inherited_option_or_more_than_default_and_help():
    @dataclass_
    class Shared:
        level: int = option(1, "a level")

    with pytest.raises(TypeError, match="names no option"):
        tailor(depth={"default": 2})(type("Other", (Shared,), {}))
    with pytest.raises(TypeError, match="only default, help, group and metavar"):
        tailor(level={"parse": int})(type("Other", (Shared,), {}))


def test_narrow_checks_a_shared_option_more_strictly_in_one_command_and_is_no_second_declaration():
    @dataclass_
    class Shared:
        count: int | None = option(None, "how many", parse=at_least(0))
        mode: str = option("auto", "where", choices=("auto", "cpu", "cuda"))

    @dataclass_
    @tailor(mode={"default": "cpu", "help": "where it runs"})
    @narrow(count={"parse": at_least(1)}, mode={"choices": ("cpu", "cuda")})
    class Strict(Shared):
        pass

    @dataclass_
    class Stricter(Strict):
        pass

    assert all("origin" in f.metadata["flowtrain"] for f in vars(Strict)["__dataclass_fields__"].values())
    count, mode = options_of(Stricter)
    assert (count.parse.__name__, mode.choices, mode.default, mode.help) == (
        "a whole number >= 1", ("cpu", "cuda"), "cpu", "where it runs")
    with pytest.raises(OptionError, match=r"count \(--count\): must be a whole number >= 1, got 0"):
        build(Stricter, {"count": 0})
    with pytest.raises(OptionError, match="is not one of cpu, cuda"):
        build(Strict, {"mode": "auto"})
    assert build(Shared, {"count": 0, "mode": "auto"}).count == 0 and build(Strict, {"count": "3"}).count == 3
    with pytest.raises(TypeError, match="not a subset"):
        narrow(mode={"choices": ("tpu",)})(type("Other", (Shared,), {}))
    with pytest.raises(TypeError, match="only parse and choices narrow"):
        narrow(count={"default": 2})(type("Other", (Shared,), {}))


dataclass_ = dataclasses.dataclass


def engine_configs() -> list[type]:
    """The engines' configs: what a command hands its engine (beside the engine's own options)."""
    from flowtrain.train.plan import TrainConfig
    from flowtrain.train.stream.config import StreamTrainConfig
    from pipelines.serving.config import ScoreConfig
    from pipelines.serving.drift import DriftConfig
    from pipelines.stream.pipeline import StreamConfig

    return [TrainConfig, StreamTrainConfig, StreamConfig, ScoreConfig, DriftConfig]


def test_no_engine_config_field_copies_a_command_option():
    """Issue 48: an engine config takes the options it reads by composing their section (a field made by ``option()``);
    anything else it holds (what the command resolved: ``connectors.kafka.target``'s KafkaTarget and Topics, the
    run directory, the dataset's spec) has a name no option has, so no value is copied into a second field of the same
    name and no default is declared twice."""
    declared = declarations()
    copies = {f"{cfg.__name__}.{f.name}": declared[f.name] for cfg in engine_configs()
              for f in dataclasses.fields(cfg) if f.metadata.get("flowtrain") is None and f.name in declared}
    assert not copies, copies


def test_the_engine_config_check_sees_a_copied_option():
    @dataclasses.dataclass
    class Copying:
        bootstrap: str = "127.0.0.1:9092"  # the command's --bootstrap, copied

    declared = declarations()
    assert [f.name for f in dataclasses.fields(Copying) if f.metadata.get("flowtrain") is None and f.name in declared] \
        == ["bootstrap"]
