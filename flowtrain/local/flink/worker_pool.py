"""A Beam worker pool for ``--environment_type=EXTERNAL``: starts Python SDK workers on request.

Beam's Flink runner asks a worker pool at ``--environment_config=HOST:PORT`` for an SDK worker
whenever a TaskManager needs one (once per job and TaskManager). Beam ships such a pool
(``apache_beam.runners.worker.worker_pool_main``), but it listens on every interface, starts
workers with whatever ``python`` is first on ``PATH``, hands them no pipeline options and pipes
their output into a pipe nobody reads. This one, like the SDK container's boot program, fetches
the job's pipeline options from the runner's provisioning service, starts
``apache_beam.runners.worker.sdk_worker_main`` with **this** interpreter (so the workers import
the same Beam, flowtrain, ``pipelines`` and ``connectors`` as the pool), logs each worker to a
file, listens on 127.0.0.1 only, and stops its workers when it stops. (Beam's pool also keys
workers by id, which two TaskManagers share: a stop for one TaskManager's worker killed the
other's mid-job.)

Run it on every TaskManager host (``python -m flowtrain.local.flink.worker_pool --port 50000``);
``flowtrain flink start`` runs one for the local cluster. The code is not staged: the pool's
Python must be able to import the pipeline's modules (an installed flowtrain, or ``PYTHONPATH``
pointing at the checkout; the pool adds its own checkout to ``PYTHONPATH``).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from concurrent import futures
from pathlib import Path

from flowtrain.local.processes import StopSignals, Supervisor

_log = logging.getLogger("flowtrain.worker_pool")


def project_root() -> str:
    """The directory holding the ``flowtrain``, ``pipelines`` and ``connectors`` packages."""
    return str(Path(__file__).resolve().parents[3])  # flowtrain/local/flink/worker_pool.py


def worker_env(base: dict | None = None) -> dict:
    """Environment for SDK workers: this interpreter's bin first on PATH, the checkout on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    root = project_root()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def serve(port: int, *, host: str = "127.0.0.1", log_dir: str | None = None):
    """Start the pool's gRPC server; returns (server, pool, bound port). ``port`` 0 picks a free one."""
    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2, beam_fn_api_pb2_grpc

    class _Pool(beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolServicer):
        """Worker ids are not unique across TaskManagers (each counts from "1-1"), and a stop
        request carries nothing else, so a stop never kills by id: a worker exits by itself when
        its runner closes the control stream (which the runner does before asking the pool to
        stop it). Exited workers are reaped; the rest stop with the pool."""

        def __init__(self):
            # The SDK workers stop with the pool (stop_all). No parent-death signal: its preexec_fn would run
            # Python in a child forked from gRPC's threads (that lost a worker of every job); a worker whose
            # pool was killed ends when its runner closes the control stream.
            self.workers = Supervisor(grace_s=10.0, death_signal=0)
            self.started = 0
            self.lock = threading.Lock()
            self.log_dir = Path(log_dir) if log_dir else None

        def _reap(self) -> None:
            for child in self.workers.exited():
                del self.workers.children[child.name]

        def StartWorker(self, request, context):  # noqa: N802 - gRPC method name
            try:
                with self.lock:
                    self._reap()
                    self.started += 1
                    child = _start_worker(request, self.log_dir, self.workers, f"sdk-{self.started}")
                _log.info("started SDK worker %s (pid %s)", request.worker_id, child.pid)
                return beam_fn_api_pb2.StartWorkerResponse()
            except Exception:  # noqa: BLE001 - the runner shows this error to the user
                return beam_fn_api_pb2.StartWorkerResponse(error=traceback.format_exc())

        def StopWorker(self, request, context):  # noqa: N802
            with self.lock:
                self._reap()
            _log.info("runner released SDK worker %s", request.worker_id)
            return beam_fn_api_pb2.StopWorkerResponse()

        def stop_all(self):
            with self.lock:
                self.workers.stop(signal.SIGTERM)

    pool = _Pool()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(pool, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"worker pool: cannot listen on {host}:{port}")
    server.start()
    return server, pool, bound


def _provision_info(request):
    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc

    with grpc.insecure_channel(request.provision_endpoint.url) as channel:
        stub = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel)
        return stub.GetProvisionInfo(beam_provision_api_pb2.GetProvisionInfoRequest(),
                                     metadata=[("worker_id", request.worker_id)], timeout=60).info


def _start_worker(request, log_dir: Path | None, workers: Supervisor, name: str):
    """What the SDK container's boot program does, without a container: options, endpoints, start."""
    from google.protobuf import json_format, text_format

    info = _provision_info(request)
    env = worker_env()
    env.update({
        "WORKER_ID": request.worker_id,
        "PIPELINE_OPTIONS": json_format.MessageToJson(info.pipeline_options),
        "CONTROL_API_SERVICE_DESCRIPTOR": text_format.MessageToString(
            info.control_endpoint if info.control_endpoint.url else request.control_endpoint),
        "LOGGING_API_SERVICE_DESCRIPTOR": text_format.MessageToString(
            info.logging_endpoint if info.logging_endpoint.url else request.logging_endpoint),
        "RUNNER_CAPABILITIES": " ".join(info.runner_capabilities),
    })
    if info.status_endpoint.url:
        env["STATUS_API_SERVICE_DESCRIPTOR"] = text_format.MessageToString(info.status_endpoint)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        env["SEMI_PERSISTENT_DIRECTORY"] = str(log_dir / f"sdk-{request.worker_id}")
        out = open(log_dir / f"sdk-{request.worker_id}.log", "ab")
    else:
        out = subprocess.DEVNULL
    try:
        return workers.start(name, [sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"],
                             env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowtrain.local.flink.worker_pool", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=50000, help="port to listen on (default 50000)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1; use the host's address when "
                         "TaskManagers on other machines should reach this pool)")
    ap.add_argument("--log-dir", default=None, help="one log file per SDK worker here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", force=True)
    server, pool, port = serve(args.port, host=args.host, log_dir=args.log_dir)
    _log.info("worker pool listening on %s:%s, python %s, PYTHONPATH %s", args.host, port, sys.executable,
              worker_env()["PYTHONPATH"])
    with StopSignals() as stop:  # SIGTERM, SIGHUP, SIGINT
        stop.wait()
    pool.stop_all()
    server.stop(5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
