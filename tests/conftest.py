"""Shared fixtures: a real Kafka broker for the whole session, started from the Apache jars.

Infrastructure tests fail (never skip) when the broker or the streaming runner cannot be had:
a skipped infrastructure test would let CI go green while testing nothing.
"""
from __future__ import annotations

import os
import signal
import uuid

import pytest

from flowtrain.local.kafka import LocalKafka
from flowtrain.local.tools import free_port
from tests.shared_data import SharedData

# The process tests send SIGHUP to what they start and expect it to stop. A suite started under
# `nohup` (SIGHUP ignored, and inherited as ignored by every child) would test nothing there: flowtrain
# leaves an ignored SIGHUP ignored, as nohup asks. The tests' children get the default disposition.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
# Likewise SIGINT: a shell without job control starts a background command (`make test &` in a script) with SIGINT
# ignored, and Python then leaves it ignored: the SIGINT tests' processes would never see one (seen in a rehearsal of
# .ci/run started that way: 4 SIGINT tests failed, all passing when run in the foreground). Pytest's own Ctrl-C back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: The signals flowtrain's commands take as a stop request (flowtrain.local.processes.StopSignals).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _stop_signal_handlers_restored():
    """A test, or flowtrain code it calls in this process (``flowtrain.stream(...)``, the CLI's ``main``), that leaves
    a handler of its own for SIGINT, SIGTERM or SIGHUP takes Ctrl-C away from pytest for the rest of the session: the
    handlers are put back and the test fails, naming what it left (a library function restores what it installs)."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    left = {sig: handler for sig in STOP_SIGNALS if (handler := signal.getsignal(sig)) != before[sig]}
    for sig in left:
        if before[sig] is not None:
            signal.signal(sig, before[sig])
    # Beam's own: the first in-process start of Beam's cached job server (a test running a pipeline on Prism
    # directly, not through flowtrain) installs StopOnExitJobServer's SIGINT handler, which stops the server and
    # calls the handler it found. Put back above, and not flowtrain's to give back.
    left = {sig: h for sig, h in left.items() if not _beams_job_server_handler(h, before[sig])}
    assert not left, ("left installed in pytest's process: " + ", ".join(
        f"{signal.Signals(sig).name} -> {handler!r}" for sig, handler in left.items()))


def _beams_job_server_handler(handler, before) -> bool:
    owner = getattr(handler, "__self__", None)
    return type(owner).__name__ == "StopOnExitJobServer" and type(owner).__module__.startswith("apache_beam.") \
        and getattr(owner, "_original_sigint_handler", None) == before


#: Session services each test of a group shares on one pytest-xdist worker (one Flink cluster, one registry, one
#: Azurite for the whole run, not one per worker).
SERVICE_GROUPS = {"flink_cluster": "flink", "schema_registry": "registry", "azurite": "azurite"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (`make test`): the tests of one module run on one worker (its
    module-scoped runs are made once), and the tests of a session service on the worker that starts it. Before
    xdist reads the groups (``tryfirst``)."""
    # the controller sees --dist loadgroup; a worker sees dist "no" and loadgroup True (xdist/remote.py)
    if config.getoption("dist", "no") != "loadgroup" and not getattr(config.option, "loadgroup", False):
        return
    group = {}  # module -> its group: the first service one of its tests uses, else the module itself
    for item in items:
        module = item.nodeid.split("::")[0]
        service = next((g for f, g in SERVICE_GROUPS.items() if f in getattr(item, "fixturenames", ())), None)
        if service and group.get(module, module) == module:
            group[module] = service  # the first service a test of the module uses
        group.setdefault(module, module)
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group[item.nodeid.split("::")[0]]))


@pytest.fixture(scope="session")
def say(request):
    """Write a line to the test log itself (not captured): what infrastructure really ran."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled():
            print(line, flush=True)

    return write


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory) -> SharedData:
    """The session's small datasets and runs (tests/shared_data.py), each made once (and once for all of
    pytest-xdist's workers): read them; a test that changes one works on a copy (checked at the end)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders share this parent
    data = SharedData(root / "shared-data")
    yield data
    changed = data.changed()
    assert not changed, f"tests changed the session's shared datasets or runs (change a copy): {changed}"


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory, say) -> LocalKafka:
    broker = LocalKafka(port=free_port(), data_dir=tmp_path_factory.mktemp("kafka"))
    status = broker.start(timeout_s=120, quiet=True)
    say(f"\nkafka: broker {broker.version} started from jars on {broker.bootstrap} in "
        f"{status.get('start_seconds', 0):.1f} s (pid {status['pid']}, log {broker.log_path})")
    try:
        yield broker
    finally:
        # Close clients of streaming DoFns that a cancelled runner never tore down before the
        # broker goes away, so they do not poll a dead broker until the process exits.
        import logging
        import time

        from connectors.kafka import close_all_clients

        close_all_clients()
        time.sleep(1.5)  # an in-flight bundle of a cancelled streaming job may open one more
        close_all_clients()
        broker.stop(timeout_s=20)
        logging.getLogger("kafka").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory, say) -> str:
    """A real Schema Registry (Apicurio, in memory) for the session: its Confluent-compatible API's URL."""
    from flowtrain.local.registry import LocalRegistry

    registry = LocalRegistry(port=free_port(), data_dir=tmp_path_factory.mktemp("registry"))
    status = registry.start(timeout_s=180, quiet=True)
    say(f"\nregistry: Apicurio Registry {registry.version} at {registry.url} in "
        f"{status.get('start_seconds', 0):.1f} s (pid {status['pid']}, log {registry.log_path})")
    try:
        yield registry.url
    finally:
        registry.stop(timeout_s=20, quiet=True)


@pytest.fixture(scope="session")
def bootstrap(kafka_broker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture
def new_topic(bootstrap):
    """Create a fresh topic with the given partition count; returns its name."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    created = []

    def make(partitions: int = 3, prefix: str = "t", config: dict | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1,
                                      topic_configs=config or {})])
        created.append(name)
        return name

    yield make
    admin.close()


@pytest.fixture(scope="session")
def flink_cluster(tmp_path_factory, say):
    """A real local Flink session cluster (jars from Maven) for the session; `--runner flink` finds it."""
    from flowtrain.local.flink import DIR_ENV, LocalFlink
    from flowtrain.local.tools import free_port

    cluster = LocalFlink(taskmanagers=2, slots=1, rest_port=free_port(), job_port=free_port(),
                         data_dir=tmp_path_factory.mktemp("flink"))
    previous = os.environ.get(DIR_ENV)
    os.environ[DIR_ENV] = str(cluster.data_dir)  # --runner flink (here and in CLI children) finds it
    try:
        status = cluster.start(timeout_s=240, quiet=True)
        say(f"\nflink: session cluster {status['versions']} with {status['taskmanagers']} TaskManagers, "
            f"{status['slots']} slots, started from jars in {status.get('start_seconds', 0):.1f} s; REST "
            f"{status['rest']}, job server {status['job_endpoint']}, logs {status['logs']}")
        yield cluster
    finally:
        cluster.stop(timeout_s=30, quiet=True)
        if previous is None:
            os.environ.pop(DIR_ENV, None)
        else:
            os.environ[DIR_ENV] = previous


@pytest.fixture(scope="session")
def azurite(tmp_path_factory, say):
    """A real object store for the session: Azurite's blob service (npm, provisioned once per machine) on
    127.0.0.1, its development account in $AZURE_STORAGE_CONNECTION_STRING (adlfs's ``az://``, here and in CLI
    children). Yields the ``LocalAzurite``."""
    from flowtrain.local.azurite import LocalAzurite
    from flowtrain.local.tools import free_port

    server = LocalAzurite(port=free_port(), data_dir=tmp_path_factory.mktemp("azurite"))
    previous = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    try:
        status = server.start(timeout_s=120, quiet=True)
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
        say(f"\nazurite: Azurite {server.version} blob service at {server.endpoint} in "
            f"{status.get('start_seconds', 0):.1f} s (pid {status['pid']}, log {server.log_path})")
        yield server
    finally:
        server.stop(timeout_s=5)  # its blobs are the session's, in a temporary directory
        if previous is None:
            os.environ.pop("AZURE_STORAGE_CONNECTION_STRING", None)
        else:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = previous
