"""Flink across hosts: the JobManager (with Beam's job server) on host 0, one TaskManager with its own worker pool
on each of hosts 1 and 2, every process on its host's LAN address (``flowtrain flink start --bind``, TaskManagers
with ``--taskmanager-of``).

The tabular batch ETL, submitted from host 0 with ``flowtrain batch --runner flink``, writes the same dataset as
the local FnApiRunner run, with tasks and SDK workers on both TaskManager hosts; ``flowtrain predict --runner
flink`` writes the local run's predictions, dead letters and metrics. Then a bigger ETL runs and host
2's TaskManager is killed -9 mid-job: Flink's default for a job without checkpointing is no restart, so the job
FAILS, ``flowtrain batch`` exits non-zero naming the lost TaskManager, and no dataset is published.
The data directories and the dataset are in a tmp directory every host sees (the shared filesystem).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from connectors.dataset import MANIFEST
from tests.dataset_checks import assert_same_dataset, tabular_inputs

CLI = [sys.executable, "-m", "flowtrain.cli"]
REST_PORT, JOB_PORT, RPC_PORT, POOL_PORT = 8081, 8099, 6123, 50000
pytestmark = [pytest.mark.flink, pytest.mark.timeout(1200)]


# --- the ETL and comparing datasets (as tests/integration/test_flink.py) --------------------------
def _batch_argv(inputs: list[str], out: Path, *runner: str) -> list[str]:
    return CLI + ["batch", "--input", inputs[0], "--input", inputs[1], "--label", "y", "--task", "regression",
                  "--numeric", "x1,x2", "--categorical", "c", "--job-only", "--no-progress", "--out", str(out),
                  *runner]


# --- the hosts ----------------------------------------------------------------------------------
def _rest(lan, path: str):
    """GET the JobManager's REST API from host 0 (the LAN is not reachable from the test's own namespace)."""
    code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    proc = lan.run(0, [sys.executable, "-c", code, f"http://{lan.addresses[0]}:{REST_PORT}{path}"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _pid(data_dir: Path, name: str) -> int:
    return json.loads((data_dir / "cluster.json").read_text())["processes"][name]["pid"]


def _listening(lan, k: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of host ``k``'s listening TCP sockets; IPv4-mapped addresses as IPv4."""
    rows = []
    for addr, port, what in lan.listening(k):
        match = re.search(r"pid=(\d+)", what)
        rows.append((addr.removeprefix("::ffff:"), port, int(match.group(1)) if match else -1))
    return rows


def _sdk_workers_started(data_dir: Path) -> int:
    try:
        return (data_dir / "log" / "worker-pool.log").read_text(errors="replace").count("started SDK worker")
    except OSError:
        return 0


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"{what}: the process ended first (exit {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def _assert_predict_on_hosts_equals_local(lan, tmp_path: Path, env: dict) -> tuple[float, float]:
    """`flowtrain predict --runner flink` from host 0 writes the predictions, dead letters and metrics of the local
    run (as tests/integration/test_flink.py's single-host test); returns (local, Flink) seconds."""
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
    outs = {name: tmp_path / f"{name}.parquet" for name in ("local", "flink")}
    argv = [*CLI, "predict", "--model", str(tmp_path / "run"), "--input", str(tmp_path / "t.csv"), "--id-column", "id"]
    t0 = time.monotonic()
    proc = subprocess.run([*argv, "--out", str(outs["local"])], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t1 = time.monotonic()
    proc = lan.run(0, [*argv, "--out", str(outs["flink"]), "--runner", "flink"], timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = (t1 - t0, time.monotonic() - t1)
    local, flink = pq.read_table(outs["local"]).sort_by("id"), pq.read_table(outs["flink"]).sort_by("id")
    assert flink.num_rows == local.num_rows == 1500 - 16
    assert flink.column("id").to_pylist() == local.column("id").to_pylist()
    np.testing.assert_allclose(flink.column("pred_probability_1").to_numpy(),
                               local.column("pred_probability_1").to_numpy(),
                               atol=1e-6, rtol=0)
    assert Counter(Path(f"{outs['flink']}.dead_letters.jsonl").read_text().splitlines()) == Counter(
        Path(f"{outs['local']}.dead_letters.jsonl").read_text().splitlines())
    a, b = (json.loads(Path(f"{outs[n]}.metrics.json").read_text()) for n in ("local", "flink"))
    assert a["counts"] == b["counts"] == {"in": 1500, "predictions": 1484, "dead_letters": 16}
    assert abs(a["metrics"]["auc"] - b["metrics"]["auc"]) <= 1e-9
    return seconds


def test_flink_start_across_hosts_rejects_unusable_addresses_in_one_line(tmp_path):
    for argv, says in ((["--bind", "0.0.0.0"], "every interface"), (["--bind", "host-a"], "not an IP address"),
                       (["--bind", "10.0.0.3", "--taskmanager-of", "10.0.0.2"], "is not HOST:RPC_PORT"),
                       (["--bind", "10.0.0.2", "--taskmanagers", "0"], "needs --parallelism")):
        proc = subprocess.run(CLI + ["flink", "start", *argv, "--data-dir", str(tmp_path / "flink")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and says in proc.stderr, (argv, proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "flink" / "cluster.json").exists()


def test_batch_etl_and_predict_across_hosts_equal_the_local_runs_and_a_killed_taskmanager_fails_the_job(make_hosts, tmp_path):
    lan = make_hosts(3)
    jm, tms = lan.addresses[0], [1, 2]
    dirs = {k: tmp_path / f"flink-host{k}" for k in range(3)}
    started: list[int] = []
    try:
        # 1. JobManager + job server on host 0, no local TaskManager; one TaskManager on each of hosts 1 and 2
        t0 = time.monotonic()
        proc = lan.run(0, CLI + ["flink", "start", "--bind", jm, "--taskmanagers", "0", "--parallelism", "2",
                                 "--rest-port", str(REST_PORT), "--job-port", str(JOB_PORT), "--rpc-port",
                                 str(RPC_PORT), "--data-dir", str(dirs[0]), "--timeout", "300"], timeout=420)
        started.append(0)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert f"--taskmanager-of {jm}:{RPC_PORT}" in proc.stdout, proc.stdout
        joins = {}
        for k in tms:
            joins[k] = lan.popen(k, CLI + ["flink", "start", "--bind", lan.addresses[k], "--taskmanager-of",
                                           f"{jm}:{RPC_PORT}", "--taskmanagers", "1", "--pool-port", str(POOL_PORT),
                                           "--data-dir", str(dirs[k]), "--timeout", "300"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started.append(k)
        for k, join in joins.items():
            out, err = join.communicate(timeout=420)
            assert join.returncode == 0, f"host {k}: {out[-2000:]}{err[-3000:]}"
            assert f"registered with the JobManager at {jm}:{RPC_PORT}" in out, out
            status = lan.run(k, CLI + ["flink", "status", "--json", "--data-dir", str(dirs[k])], timeout=120)
            got = json.loads(status.stdout.strip().splitlines()[-1])
            assert status.returncode == 0 and got["running"] and got["role"] == "taskmanagers", status.stdout
            assert got["jobmanager"] == f"{jm}:{RPC_PORT}" and set(got["processes"]) == {"worker-pool",
                                                                                          "taskmanager-1"}, got
        start_s = time.monotonic() - t0
        overview = _rest(lan, "/overview")
        assert overview["taskmanagers"] == 2 and overview["slots-total"] == 2, overview
        registered = {tm["id"] for tm in _rest(lan, "/taskmanagers")["taskmanagers"]}
        assert registered == {f"tm-{lan.addresses[k]}-1" for k in tms}, registered

        # every Flink process and Beam's job server (job service, artifact staging, expansion: flowtrain's bind
        # patch of Beam's ServerFactory) listen on their host's LAN address only; the worker pools on loopback only;
        # nothing of the cluster on a wildcard address (issue 28 item 3)
        jm_pid, js_pid = _pid(dirs[0], "jobmanager"), _pid(dirs[0], "job-server")
        listening0 = _listening(lan, 0)
        assert {(jm, port) for port in (REST_PORT, RPC_PORT)} <= {(a, p) for a, p, pid in listening0 if pid == jm_pid}
        assert (jm, JOB_PORT) in {(a, p) for a, p, pid in listening0 if pid == js_pid}, listening0
        assert len([p for a, p, pid in listening0 if pid == js_pid]) == 3, listening0
        assert all(a == jm for a, p, pid in listening0 if pid in (jm_pid, js_pid)), listening0
        ours = {p["pid"] for k in range(3) for p in json.loads((dirs[k] / "cluster.json").read_text())["processes"].values()}
        assert not [row for k in range(3) for row in _listening(lan, k)
                    if row[2] in ours and row[0] in ("*", "0.0.0.0", "::")], [_listening(lan, k) for k in range(3)]
        for k in tms:
            sockets = _listening(lan, k)
            tm = [(a, p) for a, p, pid in sockets if pid == _pid(dirs[k], "taskmanager-1")]
            assert tm and all(a == lan.addresses[k] for a, _ in tm), (k, sockets)
            pool = [(a, p) for a, p, pid in sockets if pid == _pid(dirs[k], "worker-pool")]
            assert pool == [("127.0.0.1", POOL_PORT)], (k, sockets)
            to_jm = [(la, pa, pp) for la, _, pa, pp, _ in lan.connected(k)
                     if la.removeprefix("::ffff:") == lan.addresses[k] and (pa.removeprefix("::ffff:"), pp) == (jm, RPC_PORT)]
            assert to_jm, f"host {k}'s TaskManager has no connection to the JobManager's RPC port: {lan.connected(k)}"

        # 2. the same ETL locally (FnApiRunner) and on the three hosts, submitted from host 0
        inputs = tabular_inputs(tmp_path / "inputs")
        t1 = time.monotonic()
        local = subprocess.run(_batch_argv(inputs, tmp_path / "fnapi"), capture_output=True, text=True, timeout=600)
        local_s = time.monotonic() - t1
        assert local.returncode == 0, local.stdout[-2000:] + local.stderr[-3000:]
        env = {**os.environ, "FLOWTRAIN_FLINK_DIR": str(dirs[0])}
        t2 = time.monotonic()
        remote = lan.run(0, _batch_argv(inputs, tmp_path / "flink", "--runner", "flink"), timeout=600, env=env)
        flink_s = time.monotonic() - t2
        assert remote.returncode == 0, remote.stdout[-2000:] + remote.stderr[-3000:]
        manifest = assert_same_dataset(tmp_path / "fnapi" / "dataset", tmp_path / "flink" / "dataset")
        assert manifest["counts"]["in"] == 3000 and manifest["counts"]["dead_letters"] > 0
        assert Counter((tmp_path / "flink" / "dead_letters.jsonl").read_text().splitlines()) == Counter(
            (tmp_path / "fnapi" / "dead_letters.jsonl").read_text().splitlines())
        jobs = _rest(lan, "/jobs/overview")["jobs"]
        assert len(jobs) == 1 and jobs[0]["state"] == "FINISHED", jobs
        vertices = _rest(lan, f"/jobs/{jobs[0]['jid']}")["vertices"]
        assert max(v["parallelism"] for v in vertices) == 2, vertices
        for k in tms:  # both TaskManager hosts ran the job's Python code, each with its own worker pool
            assert _sdk_workers_started(dirs[k]) >= 1, f"no SDK worker started on host {k}"

        # 3. flowtrain predict: the same bundle and file on the three hosts as locally
        predict_s = _assert_predict_on_hosts_equals_local(lan, tmp_path, env)

        # 4. a bigger ETL; host 2's TaskManager killed -9 once its tasks run there
        big = tabular_inputs(tmp_path / "big", n=150_000)
        before = _sdk_workers_started(dirs[2])
        t3 = time.monotonic()
        job = lan.popen(0, _batch_argv(big, tmp_path / "killed", "--runner", "flink"), env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait("an SDK worker of the second job on host 2", lambda: _sdk_workers_started(dirs[2]) > before, 300, job)
        os.kill(_pid(dirs[2], "taskmanager-1"), signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = job.communicate(timeout=600)
        failed_s = time.monotonic() - killed_at
        assert job.returncode != 0, f"the job survived the lost TaskManager:\n{out[-2000:]}\n{err[-3000:]}"
        lost = f"tm-{lan.addresses[2]}-1"
        message = out + err
        assert "FAILED" in message and lost in message, message[-4000:]
        jobs = {j["jid"]: j for j in _rest(lan, "/jobs/overview")["jobs"]}
        failed = [j for j in jobs.values() if j["state"] != "FINISHED"]
        assert len(failed) == 1 and failed[0]["state"] == "FAILED", jobs
        root = _rest(lan, f"/jobs/{failed[0]['jid']}/exceptions")
        assert lost in json.dumps(root), root
        assert not (tmp_path / "killed" / "dataset" / MANIFEST).exists(), "a failed job published a dataset"
        print(f"\nflink across hosts: cluster of 3 hosts up in {start_s:.1f} s; tabular ETL (3000 rows) "
              f"{flink_s:.1f} s on Flink (2 TaskManager hosts) vs {local_s:.1f} s local FnApiRunner; predict (1500 rows) "
              f"{predict_s[1]:.1f} s on Flink vs {predict_s[0]:.1f} s local; "
              f"TaskManager killed {killed_at - t3:.1f} s into a 150k-row job, job failed {failed_s:.1f} s later; "
              f"flowtrain batch said: {[line for line in message.splitlines() if lost in line][:2]}")
    finally:
        for k in reversed(started):  # the hosts' teardown kills whatever this leaves
            try:
                lan.run(k, CLI + ["flink", "stop", "--data-dir", str(dirs[k])], timeout=120)
            except subprocess.TimeoutExpired:
                pass
