"""Issue 28 item 15: kafka-python's reconnect warnings (one per attempt, from every client) are
summarised by ``connectors.kafka.ReconnectSummary``: one line when an outage starts, one when it ends.
The records are sent through kafka-python's own loggers, with the texts kafka-python 3 logs."""
from __future__ import annotations

import logging

import pytest

from connectors.kafka import ReconnectSummary

FAILURES = [
    ("kafka.net.transport", logging.ERROR, "<KafkaTCPTransport [127.0.0.1:9092<-50684]>: socket disconnected"),
    ("kafka.net.connection", logging.ERROR, "<KafkaConnection node_id=1 broker_version=(4, 3) (disconnected)>: "
                                            "Connection lost: KafkaConnectionError: 111 ECONNREFUSED"),
    ("kafka.cluster", logging.WARNING, "No node available for metadata refresh - backoff/retry"),
    ("kafka.net.manager", logging.ERROR, "Connection failed: KafkaConnectionError: 111 ECONNREFUSED"),
    ("kafka.cluster", logging.ERROR, "Metadata refresh: failed KafkaConnectionError: 111 ECONNREFUSED"),
    ("kafka.net.manager", logging.WARNING, "Bootstrap connection to bootstrap-0 failed: KafkaConnectionError: 111 "
                                           "ECONNREFUSED (backoff 7.58 secs)"),
    ("kafka.net.manager", logging.WARNING, "Bootstrap bootstrap-0 not ready; waiting 7.58 secs"),
    ("kafka.consumer.fetcher", logging.ERROR, "Fetch to node 1 failed: KafkaConnectionError: 111 ECONNREFUSED"),
]
CONNECTED = ("kafka.net.connection", logging.INFO, "<KafkaConnection node_id=1 broker_version=(4, 3) "
                                                   "(connected)>: Connected")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def summary():
    clock = [100.0]
    found = ReconnectSummary(clock=lambda: clock[0])
    found.clock = clock
    handler = _Lines()
    top = logging.getLogger("kafka")
    level = top.level
    top.setLevel(logging.WARNING)  # as a command runs: kafka-python's warnings shown (a suite may have raised it)
    top.addHandler(handler)
    # a summary a command installed earlier in this process (flowtrain.cli in-process) steps aside meanwhile
    others = {name: [f for f in logging.getLogger(name).filters if isinstance(f, ReconnectSummary)]
              for name in ReconnectSummary.LOGGERS}
    for name, filters in others.items():
        for f in filters:
            logging.getLogger(name).removeFilter(f)
    # ... and the levels it set (an installed summary lowers the "connected" loggers to INFO)
    own = {name: logging.getLogger(name).level for name in ReconnectSummary.LOGGERS}
    for name in own:
        logging.getLogger(name).setLevel(logging.NOTSET)
    found.before = logging.getLogger("kafka.net.connection").level
    found.install()
    try:
        yield found, handler
    finally:
        found.uninstall()
        top.removeHandler(handler)
        top.setLevel(level)
        for name, was in own.items():
            logging.getLogger(name).setLevel(was)
        for name, filters in others.items():
            for f in filters:
                logging.getLogger(name).addFilter(f)


def _log(name, level, text):
    logging.getLogger(name).log(level, "%s", text)


def test_item15_reconnect_warnings_are_one_line_when_an_outage_starts_and_one_when_it_ends(summary):
    found, handler = summary
    _log(*CONNECTED)  # a connection with no outage: kafka-python's INFO line stays hidden as before
    assert handler.lines == []
    for _ in range(40):  # 40 rounds of attempts by several clients: 320 records
        for failure in FAILURES:
            _log(*failure)
    assert len(handler.lines) == 1, handler.lines
    assert handler.lines[0].startswith("Kafka brokers unreachable: ") and "socket disconnected" in handler.lines[0]
    assert found.in_outage and found.summarised == 40 * len(FAILURES) - 1
    found.clock[0] += 42
    _log(*CONNECTED)
    assert len(handler.lines) == 2
    assert handler.lines[1] == f"Kafka brokers answer again after 42 s ({40 * len(FAILURES) - 1} reconnect messages " \
                               f"summarised)"
    assert handler.records[1].levelno == logging.WARNING  # shown wherever the outage's first line was
    assert not found.in_outage
    _log(*CONNECTED)  # further connections: quiet again
    _log(*FAILURES[1])  # a second outage: its own first line
    assert len(handler.lines) == 3 and "ECONNREFUSED" in handler.lines[2]
    assert found.outages == 2


def test_item15_other_kafka_records_pass_unchanged(summary):
    _found, handler = summary
    _log("kafka.cluster", logging.WARNING, "Topic flights-raw is not available during auto-create initialization")
    _log("kafka.net.connection", logging.DEBUG, "a debug line")  # below the level it had: still dropped
    _log("kafka.net.connection", logging.INFO, "Broker version identified as 4.3")
    assert handler.lines == ["Topic flights-raw is not available during auto-create initialization"]


def test_item15_uninstall_restores_the_loggers(summary):
    found, _handler = summary
    assert logging.getLogger("kafka.net.connection").getEffectiveLevel() <= logging.INFO  # its "Connected" lines
    found.uninstall()
    assert found not in logging.getLogger("kafka.cluster").filters
    assert logging.getLogger("kafka.net.connection").level == found.before


def test_item15_no_outage_is_announced_before_a_broker_ever_answered(summary):
    """A command started with no broker says so in its own one line (fail fast, or its wait): the failed
    attempts before any broker answered are not an outage of their own, whatever kafka-python logs."""
    found, handler = summary
    for _ in range(5):
        for failure in FAILURES:
            _log(*failure)
    assert handler.lines == [] and not found.in_outage
    _log(*CONNECTED)  # the broker comes up: from now on a lost connection is an outage
    _log(*FAILURES[1])
    assert len(handler.lines) == 1 and handler.lines[0].startswith("Kafka brokers unreachable: ")
