"""The seconds each test took in a recorded `make test` (``tests/durations.json``), and the order in which
pytest-xdist hands out its groups: the longest first (longest-processing-time scheduling), so that the suite does not
end with one worker running a 7-minute group while the others wait.

xdist's ``--dist loadgroup`` sends whole groups (a module, or every module of one session service: Flink, the
registry, Azurite) to a worker in the order it meets them, once ``--no-loadscope-reorder`` stops it sorting them by
their number of tests (which put the unit modules of 50 one-second tests first and the 400-second bench smoke last).
The recorded seconds only order the groups: nothing is timed or asserted.

Refresh the record from a run's JUnit XML (``make test`` writes ``test-results/test.xml``)::

    .venv/bin/python -m tests.durations test-results/test.xml
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "durations.json"
#: A test of a module the record does not know yet (a new one): ordered as if it took this long.
UNKNOWN_TEST_S = 5.0


#: A test id longer than this (a parameter holding a 5 MB poison event) is recorded by its head and a hash.
LONGEST_ID = 160


def key(test: str) -> str:
    """How ``test`` is recorded: itself, or when long its first characters and a hash of the whole."""
    if len(test) <= LONGEST_ID:
        return test
    return f"{test[:LONGEST_ID - 20]}...{hashlib.sha1(test.encode()).hexdigest()[:12]}"


def recorded(path: Path = RECORD) -> dict[str, float]:
    """test id (``tests/integration/test_x.py::test_y[param]``, as ``key`` records it) -> its seconds in the recorded
    run (setup, call and teardown: a module's shared run counts in the test that made it); {} without a record."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text())["tests"].items()}
    except FileNotFoundError:
        return {}


def group_seconds(items: list[tuple[str, str]], seconds: dict[str, float]) -> dict[str, float]:
    """``items``: (test id, its xdist group) -> each group's recorded seconds, a test the record lacks counted as
    its module's mean test there (``UNKNOWN_TEST_S`` in a module the record lacks)."""
    per_module: dict[str, list[float]] = defaultdict(list)
    for test, s in seconds.items():
        per_module[test.split("::")[0]].append(s)
    weight: dict[str, float] = defaultdict(float)
    for test, group in items:
        known = per_module.get(test.split("::")[0])
        weight[group] += seconds.get(key(test), sum(known) / len(known) if known else UNKNOWN_TEST_S)
    return dict(weight)


def _test_id(classname: str, name: str) -> str | None:
    """A JUnit case (classname ``tests.integration.test_x`` or ``tests.integration.test_x.TestY``, name
    ``test_z[param]``, under loadgroup with xdist's ``@group`` after it) -> its pytest id; None when no module of
    this checkout matches."""
    name = re.sub(r"@[^\[\]]*$", "", name)
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (ROOT / path).is_file():
            return "::".join([path.as_posix(), *parts[end:], name])
    return None


def from_junit(xml: Path) -> dict[str, float]:
    """test id -> its seconds in a JUnit XML."""
    seconds: dict[str, float] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = _test_id(case.get("classname", ""), case.get("name", ""))
        if test:
            seconds[key(test)] = float(case.get("time", 0))
    return seconds


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.durations JUNIT_XML (make test's test-results/test.xml)", file=sys.stderr)
        return 2
    xml = Path(argv[0])
    if not xml.is_file():
        print(f"tests.durations: {xml} is no file: run make test first (it writes test-results/test.xml)",
              file=sys.stderr)
        return 2
    seconds = from_junit(xml)
    RECORD.write_text(json.dumps({"source": "make test's JUnit XML: each test's seconds (setup, call, teardown)",
                                  "tests": {k: round(v, 1) for k, v in sorted(seconds.items())}},
                                 indent=0) + "\n")
    print(f"{RECORD.relative_to(ROOT)}: {len(seconds)} tests, {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
