"""Beam pipelines on a real Apache Flink session cluster (#12): a JobManager and 2 TaskManagers
started from the Maven jars, Beam's Flink job server, Python SDK workers from flowtrain's worker
pool. One cluster for the session, always stopped; tests fail (never skip) without it.

Each pipeline runs on Flink and on the FnApiRunner (the reference) and the outputs are compared:
datasets by manifest counts, statistics (with a tolerance: combine order differs), vocabularies
and rows as multisets per split; Kafka reads by the exact records; the streaming job by
raw events = feature rows + unlabelled + dead letters across a cancel and a restart, then the trainer's ledger.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowtrain.local.flink import DIR_ENV, LocalFlink
from tests.dataset_checks import assert_same_dataset, tabular_inputs
from tests.kafka_checks import committed as _committed
from tests.procs import descendants, is_loopback, listening_sockets
from tests.procs import stop_group as _stop

CLI = [sys.executable, "-m", "flowtrain.cli"]
pytestmark = [pytest.mark.flink, pytest.mark.timeout(300)]


def _jobs(cluster: LocalFlink) -> list[dict]:
    import urllib.request

    with urllib.request.urlopen(f"{cluster.status()['rest']}/jobs/overview", timeout=10) as resp:
        return json.loads(resp.read())["jobs"]


def _job_vertices(cluster: LocalFlink, jid: str) -> list[dict]:
    import urllib.request

    with urllib.request.urlopen(f"{cluster.status()['rest']}/jobs/{jid}", timeout=10) as resp:
        return json.loads(resp.read())["vertices"]


def _flink_user_counters(cluster: LocalFlink, jid: str, namespace: str) -> dict[str, int]:
    """The Beam counters of ``namespace`` as Flink's web UI shows them: the job's Accumulators tab
    (REST ``/jobs/<id>/accumulators``) holds Beam's ``__metricscontainers``, its MonitoringInfos as
    JSON (a user counter: urn ``beam:metric:user:sum_int64:v1``, payload a base64 varint)."""
    import base64
    import urllib.request

    with urllib.request.urlopen(f"{cluster.status()['rest']}/jobs/{jid}/accumulators", timeout=10) as resp:
        accumulators = json.loads(resp.read())["user-task-accumulators"]
    containers = [a for a in accumulators if a["name"] == "__metricscontainers"]
    assert containers, f"no Beam metrics among the job's accumulators: {[a['name'] for a in accumulators]}"
    out: dict[str, int] = {}
    for info in json.loads(containers[0]["value"])["metrics"]["attempted"]:
        if info["urn"] != "beam:metric:user:sum_int64:v1" or info["labels"].get("NAMESPACE") != namespace:
            continue
        value, shift = 0, 0
        for byte in base64.b64decode(info["payload"]):
            value |= (byte & 0x7F) << shift
            shift += 7
        out[info["labels"]["NAME"]] = out.get(info["labels"]["NAME"], 0) + value
    return out


def _new_finished_job(cluster: LocalFlink, before: set[str]) -> dict:
    new = [j for j in _jobs(cluster) if j["jid"] not in before]
    assert len(new) == 1, f"expected one new Flink job, got {new}"
    assert new[0]["state"] == "FINISHED", new[0]
    return new[0]


# --- comparing datasets -------------------------------------------------------------------------
def _dead_letters(path: str | Path) -> Counter:
    return Counter(Path(path).read_text().splitlines())


# --- batch ---------------------------------------------------------------------------------------
@pytest.mark.timeout(360)
def test_flights_etl_on_flink_writes_the_same_dataset_as_the_fnapi_runner(flink_cluster, tmp_path):
    from flowtrain.local.paths import cache_root
    from flowtrain.local.runners import pipeline_options
    from pipelines.flights.batch import run_flights_etl
    from pipelines.flights.preset import FLIGHTS

    tables = FLIGHTS.demo_inputs(cache_root())
    flights = pq.read_table(tables["flights"])
    pq.write_table(flights.take(pa.array(np.arange(0, flights.num_rows, 40))), tmp_path / "flights.parquet",
                   row_group_size=2048)  # several row groups: read in parallel by both TaskManagers
    tables = {**tables, "flights": str(tmp_path / "flights.parquet")}
    run_flights_etl(dataset_path=str(tmp_path / "fnapi"), dead_letters_path=str(tmp_path / "fnapi-dead.jsonl"),
                    options=pipeline_options("batch"), tables=tables)
    before = {j["jid"] for j in _jobs(flink_cluster)}
    run_flights_etl(dataset_path=str(tmp_path / "flink"), dead_letters_path=str(tmp_path / "flink-dead.jsonl"),
                    options=pipeline_options("batch", runner="flink"), tables=tables)
    job = _new_finished_job(flink_cluster, before)
    assert max(v["parallelism"] for v in _job_vertices(flink_cluster, job["jid"])) == 2  # both TaskManagers
    manifest = assert_same_dataset(tmp_path / "fnapi", tmp_path / "flink")
    assert manifest["counts"]["in"] == len(range(0, flights.num_rows, 40))
    assert _dead_letters(tmp_path / "flink-dead.jsonl") == _dead_letters(tmp_path / "fnapi-dead.jsonl")


def _batch_job_only_args(inputs: list[str], out: Path, *runner: str) -> list[str]:
    return CLI + ["batch", "--input", inputs[0], "--input", inputs[1], "--label", "y", "--task", "regression",
                  "--numeric", "x1,x2", "--categorical", "c", "--job-only", "--no-progress", "--out", str(out), *runner]


def _batch_job_only(inputs: list[str], out: Path, *runner: str) -> str:
    proc = subprocess.run(_batch_job_only_args(inputs, out, *runner), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _listening(cluster: LocalFlink) -> dict[str, set]:
    """What each process of the local cluster (and each SDK worker of its pool) listens on now."""
    state = cluster.read_state()
    names = {p["pid"]: name for name, p in state["processes"].items()}
    found = listening_sockets([*names, *descendants(state["processes"]["worker-pool"]["pid"])])
    return {names.get(pid, f"sdk worker {pid}"): set(addrs) for pid, addrs in found.items()}


@pytest.fixture(scope="module")
def tabular_on_flink(flink_cluster, tmp_path_factory) -> dict:
    """One run of the tabular ETL (`flowtrain batch --job-only`) on the FnApiRunner and one on the Flink cluster,
    with every socket the cluster listens on watched before and while the Flink job runs: what the ETL comparison
    and the loopback check (issue 28 item 3) both read. The job's output goes to files, not a pipe nobody reads
    while it runs; faulthandler lets a hang show where."""
    tmp = tmp_path_factory.mktemp("tabular-flink")
    inputs = tabular_inputs(tmp)
    _batch_job_only(inputs, tmp / "fnapi")
    idle = _listening(flink_cluster)
    before = {j["jid"] for j in _jobs(flink_cluster)}
    stdout, stderr = tmp / "flink-job.out", tmp / "flink-job.log"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        job = subprocess.Popen(_batch_job_only_args(inputs, tmp / "flink", "--runner", "flink"), stdout=out,
                               stderr=err, start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    seen = {name: set(addrs) for name, addrs in idle.items()}
    try:
        deadline = time.monotonic() + 300
        while job.poll() is None and time.monotonic() < deadline:
            for name, addrs in _listening(flink_cluster).items():
                seen.setdefault(name, set()).update(addrs)
            time.sleep(0.2)
        if job.poll() is None:
            _hang_report(job, flink_cluster)
        assert job.poll() == 0, f"the job failed or hung: {job.poll()}\n{stdout.read_text(errors='replace')[-2000:]}" \
                                f"\n{stderr.read_text(errors='replace')[-6000:]}"
    finally:
        _stop(job, timeout=30)
    return {"tmp": tmp, "printed": stdout.read_text(), "job": _new_finished_job(flink_cluster, before), "idle": idle,
            "seen": seen}


@pytest.mark.timeout(420)
def test_tabular_etl_from_csv_and_parquet_with_runner_flink_matches_the_fnapi_runner(flink_cluster, tabular_on_flink):
    tmp_path, printed, job = tabular_on_flink["tmp"], tabular_on_flink["printed"], tabular_on_flink["job"]
    assert "PortableRunner" in printed or "etl:" in printed
    manifest = assert_same_dataset(tmp_path / "fnapi" / "dataset", tmp_path / "flink" / "dataset")
    assert manifest["counts"]["in"] == 3000 and manifest["counts"]["dead_letters"] > 0
    # the ETL's Beam counters in Flink's web UI (the job's accumulators) equal the manifest's counts
    counters = _flink_user_counters(flink_cluster, job["jid"], "flowtrain.etl")
    assert counters["rows_in"] == manifest["counts"]["in"] == 3000, counters
    assert counters["dead_letters"] == manifest["counts"]["dead_letters"], counters
    assert counters["rows_out"] == manifest["counts"]["in"] - manifest["counts"]["dead_letters"], counters
    assert sum(v for k, v in counters.items() if k.startswith("rows_out: ")) == counters["rows_out"], counters
    assert _dead_letters(tmp_path / "flink" / "dead_letters.jsonl") == _dead_letters(
        tmp_path / "fnapi" / "dead_letters.jsonl")


def test_flink_command_start_is_idempotent_and_status_reports_the_cluster(flink_cluster):
    where = ["--data-dir", str(flink_cluster.data_dir)]
    started = subprocess.run(CLI + ["flink", "start", *where, "--rest-port", str(flink_cluster.rest_port),
                                    "--job-port", str(flink_cluster.job_port)], capture_output=True, text=True,
                             timeout=120)
    assert started.returncode == 0 and "already running" in started.stdout, started.stdout + started.stderr
    status = subprocess.run(CLI + ["flink", "status", "--json", *where], capture_output=True, text=True,
                            timeout=120)
    assert status.returncode == 0, status.stderr
    got = json.loads(status.stdout.strip().splitlines()[-1])
    assert got["running"] and got["taskmanagers"] == 2 and got["slots"] == 2
    assert set(got["processes"]) == {"worker-pool", "jobmanager", "taskmanager-1", "taskmanager-2", "job-server"}
    assert all(p["alive"] for p in got["processes"].values())
    assert got["rest"] == f"http://127.0.0.1:{flink_cluster.rest_port}"
    assert f"127.0.0.1:{flink_cluster.job_port}" in got["listening"]["job-server"], got["listening"]
    shown = subprocess.run(CLI + ["flink", "status", *where], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "listening   on 127.0.0.1 only" in shown.stdout, shown.stdout + shown.stderr


# --- issue 28 item 3: what listens where ----------------------------------------------------------
def test_item3_the_local_cluster_and_its_jobs_listen_on_loopback_only(flink_cluster, tabular_on_flink):
    """Every socket the local cluster listens on, idle and while a job runs (the tabular ETL of
    ``tabular_on_flink``: the TaskManagers then open Beam's Fn API services for the SDK workers: control, data,
    state, logging, provisioning, artifacts), is on 127.0.0.1: the JobManager (RPC, REST, blob server, metrics RPC),
    the TaskManagers (RPC, data port, metrics RPC), Beam's job server (job service, artifact staging, expansion), the
    worker pool and its SDK workers. Beam 2.62 binds the job server's and the TaskManagers' gRPC servers on every
    interface; flowtrain's bind patch does not."""
    state = flink_cluster.read_state()
    idle, seen = tabular_on_flink["idle"], tabular_on_flink["seen"]
    assert set(idle) == set(state["processes"]), idle  # every process listens somewhere (and is found)
    ports = {name: {port for _, port in addrs} for name, addrs in idle.items()}
    assert {flink_cluster.rest_port, int(state["jobmanager"].rsplit(":", 1)[1])} <= ports["jobmanager"], idle
    assert flink_cluster.job_port in ports["job-server"] and len(ports["job-server"]) == 3, idle  # + artifacts, exp.
    # RPC, data, metrics RPC; more while an earlier test's job environment is cached (--environment_cache_millis)
    assert len(ports["jobmanager"]) == 4 and all(len(ports[f"taskmanager-{i}"]) >= 3 for i in (1, 2)), idle
    opened = {name: seen[name] - idle.get(name, set()) for name in seen}
    assert all(len(opened[f"taskmanager-{i}"]) >= 4 for i in (1, 2)), opened  # the Fn API services were seen
    exposed = {name: sorted(a for a in addrs if not is_loopback(a[0])) for name, addrs in seen.items()}
    assert not {name: a for name, a in exposed.items() if a}, f"listening beyond 127.0.0.1: {exposed}"


def _hang_report(job: subprocess.Popen, cluster: LocalFlink) -> None:
    """A job still running at its deadline: SIGABRT makes its faulthandler write every thread's stack to its log,
    and the Flink jobs the REST API knows (none: it never reached the job server) go to the test's output."""
    try:
        print("flink jobs at the deadline:", [(j["name"], j["state"]) for j in _jobs(cluster)])
    except (OSError, ValueError, KeyError) as err:
        print(f"flink REST did not answer at the deadline: {err}")
    try:
        os.kill(job.pid, signal.SIGABRT)
        job.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def test_item3_without_the_bind_patch_flink_start_refuses_to_expose_the_job_server(tmp_path):
    """No JDK to build the bind patch (a cache provisioned without one, no `javac` or `mvn` on PATH) on a machine
    with a network interface: `flowtrain flink start` refuses in one line naming --expose-job-server, starts
    nothing."""
    import shutil
    import socket

    libs = tmp_path / "cache" / "flink" / "beam-2.62.0-flink-1.19" / "libs"
    libs.mkdir(parents=True)
    (libs / ".complete").write_text(json.dumps({"beam_runner": "2.62.0", "flink": "1.19", "no_staging_helper": False,
                                                "bind_patch": False, "jars": 0}))
    bin_dir = tmp_path / "bin"  # java only: no javac, no mvn
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(shutil.which("java"))
    env = {**os.environ, "FLOWTRAIN_CACHE": str(tmp_path / "cache"),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])}
    proc = subprocess.run(CLI + ["flink", "start", "--data-dir", str(tmp_path / "flink"), "--rest-port", "0",
                                 "--job-port", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert [n for _, n in socket.if_nameindex() if n != "lo"], "this test needs a machine with a network interface"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "would listen on every interface" in proc.stderr and "--expose-job-server" in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("flowtrain flink start")]) == 1
    assert not (tmp_path / "flink" / "cluster.json").exists()


def test_runner_flink_without_a_cluster_and_a_bare_flink_master_are_clear_errors(tmp_path, monkeypatch, capsys):
    from flowtrain.cli.main import main
    from flowtrain.local.runners import RunnerOptionError, pipeline_options

    monkeypatch.setenv(DIR_ENV, str(tmp_path / "no-cluster"))
    assert main(["batch", "--runner", "flink", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "no local Flink cluster is running" in err and "flowtrain flink start" in err
    with pytest.raises(RunnerOptionError, match="--environment_type=EXTERNAL"):
        pipeline_options("batch", runner="flink", flink_master="127.0.0.1:1")
    with pytest.raises(RunnerOptionError, match="HOST:PORT"):
        pipeline_options("batch", ["--environment_type=EXTERNAL"], flink_master="no-port")
    with pytest.raises(RunnerOptionError, match="keep one"):
        pipeline_options("batch", ["--runner=FnApiRunner"], runner="flink")


# --- Kafka ---------------------------------------------------------------------------------------
@pytest.mark.kafka
def test_read_from_kafka_stop_end_on_flink_reads_exactly_what_was_produced(bootstrap, new_topic, flink_cluster,
                                                                          tmp_path):
    import apache_beam as beam
    from kafka import KafkaProducer

    from connectors.kafka import ReadFromKafka
    from flowtrain.local.runners import pipeline_options

    topic = new_topic(3)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    produced = Counter()
    futures = []
    for i in range(1500):
        part = i % 3
        futures.append((part, i, producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=part)))
    producer.flush()
    for part, i, fut in futures:
        meta = fut.get(timeout=30)
        produced[(part, meta.offset, f"k{i}", f"v{i}")] += 1
    producer.close()
    before = {j["jid"] for j in _jobs(flink_cluster)}
    with beam.Pipeline(options=pipeline_options("batch", runner="flink")) as p:
        _ = (p | ReadFromKafka(bootstrap, topic, stop="end")
             | beam.Map(lambda r: json.dumps([r.partition, r.offset, r.key.decode(), r.value.decode()]))
             | beam.io.WriteToText(str(tmp_path / "records"), shard_name_template=""))
    _new_finished_job(flink_cluster, before)
    read = Counter(tuple(json.loads(line)) for line in (tmp_path / "records").read_text().splitlines())
    assert read == produced  # every record once, none invented, all 3 partitions


# --- streaming -----------------------------------------------------------------------------------
def _read_topic(bootstrap: str, topic: str) -> list:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=4000)
    c.assign([TopicPartition(topic, p) for p in c.partitions_for_topic(topic)])
    c.seek_to_beginning()
    out = list(c)
    c.close()
    return out


def _cancel_active_jobs(cluster: LocalFlink) -> None:
    from flowtrain.local.flink.rest import cancel_flink_jobs

    for job in _jobs(cluster):
        if job["state"] not in ("FINISHED", "CANCELED", "FAILED"):
            cancel_flink_jobs(cluster.status()["rest"], job["name"])


@pytest.mark.kafka
@pytest.mark.timeout(420)
def test_stream_pipeline_on_flink_cancelled_mid_stream_and_restarted_loses_nothing(bootstrap, flink_cluster,
                                                                                   shared_data, tmp_path, say):
    from connectors.arrow import decode_batch

    t0 = time.monotonic()

    def phase(what: str) -> None:
        say(f"flink stream test: {what} at {time.monotonic() - t0:.0f} s")

    dataset = shared_data.flights(every=80)
    phase("batch dataset for the statistics written")
    tag = uuid.uuid4().hex[:6]
    raw, feats, dead, group = f"raw-{tag}", f"feat-{tag}", f"dead-{tag}", f"g-{tag}"
    common = ["--bootstrap", bootstrap, "--raw-topic", raw, "--features-topic", feats, "--dead-letter-topic", dead,
              "--updates-topic", f"upd-{tag}", "--group-id", group, "--dataset", dataset]

    def replay(n: int, skip: int = 0, rate: float = 0.0) -> subprocess.Popen:
        return subprocess.Popen(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--partitions", "3",
                                       "--limit", str(n), "--skip", str(skip), "--malformed", "0.05",
                                       "--rate", str(rate)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def pipeline(name: str) -> subprocess.Popen:
        out = tmp_path / name
        out.mkdir()
        return subprocess.Popen(CLI + ["stream", "pipeline", *common, "--out", str(out), "--batch-size", "200",
                                       "--runner", "flink"],
                                stdout=open(out / "pipeline.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    def wait_committed(proc, name: str, at_least: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        done = 0
        while time.monotonic() < deadline:
            done, _ = _committed(bootstrap, raw, group)
            if done >= at_least:
                return done
            assert proc.poll() is None, (tmp_path / name / "pipeline.log").read_text()[-3000:]
            time.sleep(1)
        raise AssertionError(f"{name}: {done} of {at_least} raw events committed in {timeout} s; "
                             f"{(tmp_path / name / 'pipeline.log').read_text()[-2000:]}")

    first = replay(1200)
    assert first.wait(timeout=120) == 0, first.stdout.read().decode()[-2000:]
    before = {j["jid"] for j in _jobs(flink_cluster)}
    run1 = pipeline("run1")
    more = None
    try:
        wait_committed(run1, "run1", 1200, timeout=180)
        phase("first job caught up with 1200 events")
        more = replay(300, skip=1200, rate=30)  # events keep arriving (for ~10 s) ...
        wait_committed(run1, "run1", 1201, timeout=60)
        assert more.poll() is None, "the replay ended before the cancel: not mid-stream"
        _stop(run1)  # ... when the job is cancelled (SIGINT: the command cancels its Flink job)
    finally:
        _stop(run1, signal.SIGKILL)
        if run1.returncode != 0:
            _cancel_active_jobs(flink_cluster)
        if more is not None:
            more.wait(timeout=120)
    assert more.returncode == 0
    jobs = [j for j in _jobs(flink_cluster) if j["jid"] not in before]
    assert [j["state"] for j in jobs] == ["CANCELED"], jobs
    phase("first job cancelled mid-stream")
    last = replay(900, skip=1500)  # and while the job is down
    assert last.wait(timeout=120) == 0
    committed, end = _committed(bootstrap, raw, group)
    assert end == 2400 and committed < end

    run2 = pipeline("run2")  # from the group's committed offsets
    try:
        wait_committed(run2, "run2", 2400, timeout=180)
        phase("restarted job caught up with 2400 events")
    finally:
        _stop(run2)
        _cancel_active_jobs(flink_cluster)  # only if a stop above failed to: keep the slots free
    assert [j["state"] for j in _jobs(flink_cluster) if j["jid"] not in before] == ["CANCELED", "CANCELED"]

    sources = Counter()
    for m in _read_topic(bootstrap, feats):
        b = decode_batch(m.value)
        sources.update(zip(b["src_partition"].to_pylist(), b["src_offset"].to_pylist()))
    letters = Counter()
    for m in _read_topic(bootstrap, dead):
        _, part, off = dict(m.headers)["source"].decode().rsplit("/", 2)
        letters[(int(part), int(off))] += 1
    raw_values = {(m.partition, m.offset): m.value for m in _read_topic(bootstrap, raw)}
    raw_events = set(raw_values)
    assert len(raw_events) == 2400
    unlabelled = raw_events - set(sources) - set(letters)  # flights without an arrival delay: scored, not trained
    assert unlabelled and all(json.loads(raw_values[k])["arr_delay"] is None for k in unlabelled)  # nothing lost
    assert not set(sources) & set(letters)  # an event is a feature row or a dead letter, never both
    assert len(letters) >= 0.04 * 2400  # --malformed 0.05, plus real rejects

    # The trainer trains every feature row exactly once, duplicates from the restart dropped.
    run = tmp_path / "train"
    trainer = subprocess.run(CLI + ["stream", "train", *common, "--out", str(run), "--ledger", "--idle-exit", "3",
                                    "--checkpoint-every", "5"], capture_output=True, text=True, timeout=240)
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-2000:]
    phase("trainer done")
    ledger = Counter()
    for line in (run / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        ledger[(r["partition"], r["offset"])] += 1
    assert set(ledger) == set(sources) and set(ledger.values()) == {1}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_flink_master_runs_a_pipeline_through_beams_flink_runner_and_flowtrains_job_server_jar(flink_cluster,
                                                                                               tmp_path):
    """--flink-master: Beam's FlinkRunner starts a job server from flowtrain's jar and submits to
    the cluster at that REST address (here the local one, as if it were remote: jars staged)."""
    import apache_beam as beam

    from flowtrain.local.runners import pipeline_options

    state = flink_cluster.read_state()
    before = {j["jid"] for j in _jobs(flink_cluster)}
    options = pipeline_options("batch", ["--environment_type=EXTERNAL", f"--environment_config={state['worker_pool']}"],
                               runner="flink", flink_master=state["rest"].removeprefix("http://"))
    with beam.Pipeline(options=options) as p:
        _ = (p | beam.Create(range(300)) | beam.Map(lambda x: (x % 3, x)) | beam.CombinePerKey(sum)
             | beam.Map(json.dumps) | beam.io.WriteToText(str(tmp_path / "sums"), shard_name_template=""))
    job = _new_finished_job(flink_cluster, before)
    assert job["name"].startswith("flowtrain-")
    got = sorted(json.loads(line) for line in (tmp_path / "sums").read_text().splitlines())
    assert got == [[k, sum(x for x in range(300) if x % 3 == k)] for k in range(3)]


# --- flowtrain predict ----------------------------------------------------------------------------
@pytest.mark.timeout(480)
def test_predict_on_flink_equals_the_local_run(flink_cluster, tmp_path):
    """The same bundle and files: `flowtrain predict --runner flink` writes the predictions, dead letters and
    metrics of the FnApiRunner's run."""
    import flowtrain

    rng = np.random.default_rng(4)
    lines = ["id,x1,x2,c,y"]
    for i in range(1500):
        x1, x2, c = rng.normal(), rng.normal(), "abcd"[rng.integers(4)]
        lines.append(f"{i},{'bad' if i % 97 == 5 else f'{x1:.4f}'},{x2:.4f},{c if i % 7 else 'new'},"
                     f"{int(x1 + x2 + (c == 'a') > 0)}")
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    flowtrain.batch(input=[str(tmp_path / "t.csv")], label="y", numeric=["x1", "x2"], categorical=["c"],
                    task="classification", steps=20, out=str(tmp_path / "run"), no_progress=True)
    outs = {}
    for name, extra in (("local", []), ("flink", ["--runner", "flink"])):
        out = tmp_path / f"{name}.parquet"
        proc = subprocess.run([*CLI, "predict", "--model", str(tmp_path / "run"), "--input", str(tmp_path / "t.csv"),
                               "--out", str(out), "--id-column", "id", *extra], capture_output=True, text=True,
                              timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[name] = out
    local, flink = pq.read_table(outs["local"]).sort_by("id"), pq.read_table(outs["flink"]).sort_by("id")
    assert flink.num_rows == local.num_rows == 1500 - 16
    assert flink.column("id").to_pylist() == local.column("id").to_pylist()
    np.testing.assert_allclose(flink.column("pred_probability_1").to_numpy(),
                               local.column("pred_probability_1").to_numpy(),
                               atol=1e-6, rtol=0)
    assert _dead_letters(f"{outs['flink']}.dead_letters.jsonl") == _dead_letters(f"{outs['local']}.dead_letters.jsonl")
    a, b = (json.loads(Path(f"{outs[n]}.metrics.json").read_text()) for n in ("local", "flink"))
    assert a["counts"] == b["counts"] == {"in": 1500, "predictions": 1484, "dead_letters": 16}
    assert abs(a["metrics"]["auc"] - b["metrics"]["auc"]) <= 1e-9


@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_generic_stream_pipeline_on_flink_reconciles_on_a_table_of_its_own(bootstrap, flink_cluster, tmp_path, say):
    """The generic stream (not the flights) on Flink: a sensor table made here, replayed with every
    malformed kind and unlabelled events; raw = training rows + unlabelled + dead letters, exactly."""
    from connectors.arrow import decode_batch
    from tests.sensor_data import make_sensor_run

    dataset, _, csv = make_sensor_run(tmp_path, rows=1200, epochs=1)
    tag = uuid.uuid4().hex[:6]
    raw, feats, dead, group = f"graw-{tag}", f"gfeat-{tag}", f"gdead-{tag}", f"gg-{tag}"
    rp = subprocess.run(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--input", csv, "--dataset",
                               dataset, "--partitions", "2", "--malformed", "0.05", "--unlabelled", "0.1",
                               "--max-event-bytes", "50000"], capture_output=True, text=True, timeout=180)
    assert rp.returncode == 0, rp.stderr[-2000:]
    out = tmp_path / "flink-run"
    out.mkdir()
    proc = subprocess.Popen(CLI + ["stream", "pipeline", "--bootstrap", bootstrap, "--raw-topic", raw,
                                   "--features-topic", feats, "--dead-letter-topic", dead, "--group-id", group,
                                   "--dataset", dataset, "--out", str(out), "--batch-size", "200",
                                   "--max-event-bytes", "50000", "--runner", "flink"],
                            stdout=open(out / "pipeline.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done, end = _committed(bootstrap, raw, group)
            if end == 1200 and done == end:
                break
            assert proc.poll() is None, (out / "pipeline.log").read_text()[-3000:]
            time.sleep(1)
        else:
            raise AssertionError(f"{done} of 1200 committed; {(out / 'pipeline.log').read_text()[-2000:]}")
    finally:
        _stop(proc)
        _cancel_active_jobs(flink_cluster)
    rows = Counter()
    for m in _read_topic(bootstrap, feats):
        b = decode_batch(m.value)
        rows.update(zip(b["src_partition"].to_pylist(), b["src_offset"].to_pylist()))
    letters = {}
    for m in _read_topic(bootstrap, dead):
        headers = dict(m.headers)
        _, part, off = headers["source"].decode().rsplit("/", 2)
        letters[(int(part), int(off))] = headers["reason"].decode()
    events = {(m.partition, m.offset): m.value for m in _read_topic(bootstrap, raw)}
    unlabelled = set(events) - set(rows) - set(letters)
    assert set(rows.values()) == {1} and not set(rows) & set(letters) and len(events) == 1200
    assert unlabelled and all(b'"state"' not in events[k] for k in unlabelled)
    reasons = {r.split(":")[0] for r in letters.values()}
    assert {"broken JSON", "missing field(s)", "wrong type", "NaN", "too deeply nested JSON",
            "event too large"} <= reasons, reasons
    say(f"flink generic stream: {len(rows)} training rows + {len(unlabelled)} unlabelled + {len(letters)} dead letters")
