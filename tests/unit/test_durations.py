"""The suite's schedule (tests/durations.py): a recorded JUnit XML becomes per-test seconds, and xdist's groups are
weighed by them, the longest first."""
from __future__ import annotations

import json

from tests import durations


def test_junit_cases_become_test_ids_with_xdist_groups_dropped(tmp_path):
    xml = tmp_path / "test.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.unit.test_durations" name="test_a@tests/unit/test_durations.py" time="1.5"/>'
        '<testcase classname="tests.integration.test_bench_smoke" name="test_bench[kafka]@bench_smoke_2" '
        'time="300.25"/>'
        '<testcase classname="tests.unit.test_gone" name="test_b" time="9"/>'  # no such module here: left out
        '</testsuite></testsuites>')
    assert durations.from_junit(xml) == {"tests/unit/test_durations.py::test_a": 1.5,
                                         "tests/integration/test_bench_smoke.py::test_bench[kafka]": 300.25}


def test_groups_weigh_their_tests_and_guess_the_unrecorded(tmp_path):
    seconds = {"tests/a.py::t1": 10.0, "tests/a.py::t2": 30.0, "tests/b.py::t": 400.0}
    items = [("tests/a.py::t1", "a"), ("tests/a.py::t2", "a"), ("tests/a.py::t3", "a"),  # t3: a's mean, 20 s
             ("tests/b.py::t", "flink"), ("tests/c.py::t1", "c"), ("tests/c.py::t2", "c")]  # c: not recorded
    assert durations.group_seconds(items, seconds) == {"a": 60.0, "flink": 400.0, "c": 2 * durations.UNKNOWN_TEST_S}


def test_the_record_is_read_back_and_a_missing_one_orders_nothing(tmp_path):
    record = tmp_path / "durations.json"
    assert durations.recorded(record) == {}
    record.write_text(json.dumps({"tests": {"tests/a.py::t": 2.5}}))
    assert durations.recorded(record) == {"tests/a.py::t": 2.5}


def test_the_checked_in_record_names_tests_of_this_checkout():
    """A stale record (modules renamed since) still orders, but should be refreshed: most of its tests exist."""
    seconds = durations.recorded()
    assert seconds, "tests/durations.json is missing: python -m tests.durations test-results/test.xml"
    modules = {t.split("::")[0] for t in seconds}
    assert all((durations.ROOT / m).is_file() for m in modules), sorted(
        m for m in modules if not (durations.ROOT / m).is_file())


def test_a_long_test_id_is_recorded_by_its_head_and_a_hash():
    poison = "tests/unit/test_x.py::test_poison[" + "a" * 5_000_000 + "]"
    other = poison[:-2] + "b]"
    assert len(durations.key(poison)) <= durations.LONGEST_ID and durations.key(poison) != durations.key(other)
    assert durations.key("tests/unit/test_x.py::test_y") == "tests/unit/test_x.py::test_y"
    assert durations.group_seconds([(poison, "x")], {durations.key(poison): 3.0}) == {"x": 3.0}
