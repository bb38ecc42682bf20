"""Beam pipeline options for the three ways flowtrain runs a pipeline.

* ``local batch``: Beam's FnApiRunner, chosen explicitly. Beam's default (the
  SwitchingDirectRunner) first tries to download Prism from GitHub, which hangs offline.
* ``local streaming``: Prism, built once per machine from the Go module proxy with
  ``go build`` and passed with ``--prism_location``. It really executes unbounded
  splittable DoFns, fires windows on a real clock and can be cancelled. Run by
  :class:`LocalPrismRunner`, everything listens on 127.0.0.1 only: Prism's job server (and the
  Fn API services it multiplexes on the same port; Prism has no option for the address, so the
  build changes its one listen call from ``:PORT`` to ``127.0.0.1:PORT``) and the in-process SDK
  worker pool (Beam's LOOPBACK environment binds it to every interface).
* ``remote``: the user's own options (``--runner=FlinkRunner ...``, ``DataflowRunner``),
  passed through untouched.

Any mode can instead run on Apache Flink (``runner="flink"``, the command line's
``--runner flink``): on the local session cluster of ``flowtrain flink start`` (Beam's
``PortableRunner`` against its job server, SDK workers from its worker pool), or with
``flink_master="HOST:PORT"`` on another Flink 1.19 cluster (Beam's ``FlinkRunner`` starting the
job server from flowtrain's Maven-resolved jars; the SDK workers' environment is yours to give).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.prism_runner import PrismRunner

from flowtrain.local.paths import cache_root

Mode = Literal["batch", "streaming", "remote"]


class RunnerError(RuntimeError):
    """The local runner could not be provisioned; the message says what to install."""


class RunnerOptionError(RunnerError, ValueError):
    """A runner option cannot be used as given (no local Flink cluster, a malformed --flink-master)."""


def beam_version() -> str:
    from apache_beam.version import __version__

    return __version__


#: The one file of Prism's source flowtrain's build changes, and the change: its job server (with
#: the Fn API services multiplexed on the same listener) on 127.0.0.1 instead of every interface.
_PRISM_SERVER = "go/pkg/beam/runners/prism/internal/jobservices/server.go"
_PRISM_LOOPBACK = (
    ('net.Listen("tcp", fmt.Sprintf(":%d", port))', 'net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))'),
    ('return fmt.Sprintf("localhost:%v", port)', 'return fmt.Sprintf("127.0.0.1:%v", port)'),
)


def prism_path(version: str | None = None) -> Path:
    version = version or beam_version()
    return cache_root() / "prism" / f"v{version}-loopback" / "prism"


def ensure_prism(version: str | None = None, *, quiet: bool = False) -> Path:
    """Build Prism for this Beam version once per machine, listening on 127.0.0.1 only.

    The Beam Go SDK module comes from the Go module proxy (``go mod download``); a copy of its
    ``go`` tree is built with Prism's listen address changed (``_PRISM_LOOPBACK``)."""
    binary = prism_path(version)
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        raise RunnerError("`go` was not found on PATH; flowtrain builds Beam's Prism runner (the local "
                          "streaming runner) with it. Install Go 1.22+ (https://go.dev/doc/install or "
                          "Debian `apt-get install golang`).")
    version = version or beam_version()
    module = f"github.com/apache/beam/sdks/v2@v{version}"
    env = dict(os.environ, CGO_ENABLED="0")
    if not quiet:
        print(f"prism: first streaming run on this machine: building Beam's Prism runner ({module}, listening on "
              f"127.0.0.1) into {binary.parent} (once; 1-2 minutes)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([go, "mod", "download", "-json", module], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RunnerError(f"fetching {module} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    import json

    source = Path(json.loads(proc.stdout)["Dir"])
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prism-build-", dir=binary.parent) as build:
        for name in ("go", "go.mod", "go.sum"):
            copy = shutil.copytree if (source / name).is_dir() else shutil.copyfile
            copy(source / name, Path(build) / name)
        for path in Path(build).rglob("*"):  # the module cache is read-only
            path.chmod(path.stat().st_mode | 0o200)
        server = Path(build) / _PRISM_SERVER
        text = server.read_text()
        for old, new in _PRISM_LOOPBACK:
            if text.count(old) != 1:
                raise RunnerError(f"Prism {version}'s {_PRISM_SERVER} no longer holds `{old}`: flowtrain cannot "
                                  f"bind its job server to 127.0.0.1 for this Beam version; update _PRISM_LOOPBACK "
                                  f"in {__file__}")
            text = text.replace(old, new)
        server.write_text(text)
        partial = binary.with_name("prism.partial")
        for _attempt in (1, 2):  # a module download cut short by the proxy fails one build; the next resumes it
            proc = subprocess.run([go, "build", "-o", str(partial), "./go/cmd/prism"], cwd=build, env=env,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode == 0 and partial.exists():
                break
        else:
            # go prints a line per module it downloads: keep the lines that say what went wrong
            errors = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("go: downloading"))
            raise RunnerError(f"building Prism failed twice (go build ./go/cmd/prism in {build}):\n{errors[-3000:]}")
        partial.replace(binary)
    if not quiet:
        print(f"prism: built in {time.monotonic() - t0:.0f} s", flush=True)
    return binary


class LocalPrismRunner(PrismRunner):
    """Beam's PrismRunner with the LOOPBACK environment's worker pool on 127.0.0.1.

    Beam starts that pool (the SDK harness in this process, started by the runner over gRPC) on
    ``[::]:PORT``: a ``StartWorker`` request from any host would run the sender's code here. This
    runner starts the same pool, the same way, bound to 127.0.0.1 (``--runner`` takes this class's
    path: ``flowtrain.local.runners.LocalPrismRunner``)."""

    @staticmethod
    def start_and_replace_loopback_environments(pipeline, options):
        import copy
        import functools

        import grpc
        from apache_beam.options.pipeline_options import DebugOptions, PortableOptions
        from apache_beam.portability import python_urns
        from apache_beam.portability.api import beam_fn_api_pb2_grpc
        from apache_beam.runners.worker import sdk_worker_main, worker_pool_main
        from apache_beam.transforms import environments
        from apache_beam.utils import thread_pool_executor

        portable_options = copy.deepcopy(options.view_as(PortableOptions))
        experiments = options.view_as(DebugOptions).experiments or []
        cleanup = []
        for env in pipeline.components.environments.values():
            if env.urn != python_urns.EMBEDDED_PYTHON_LOOPBACK:
                continue
            server = grpc.server(thread_pool_executor.shared_unbounded_instance(),
                                 options=[("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)])
            port = server.add_insecure_port("127.0.0.1:0")
            pool = worker_pool_main.BeamFnExternalWorkerPoolServicer(
                state_cache_size=sdk_worker_main._get_state_cache_size_bytes(options=options),
                data_buffer_time_limit_ms=sdk_worker_main._get_data_buffer_time_limit_ms(experiments))
            beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(pool, server)
            server.start()
            portable_options.environment_type = "EXTERNAL"
            portable_options.environment_config = f"127.0.0.1:{port}"
            external = environments.ExternalEnvironment.from_options(portable_options).to_runner_api(None)
            env.urn, env.payload = external.urn, external.payload
            cleanup.append(functools.partial(server.stop, 1))
        return cleanup


class FlinkClusterOptions(PipelineOptions):
    """Java-side Beam options flowtrain sets for its local Flink cluster.

    The Python SDK drops options it does not know before it submits a job; declaring this one
    here carries it to the job server.
    """

    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument("--pipeline_resources_detector_factory_class", default=None,
                            help="Java class choosing the jars a Flink job stages (flowtrain's local "
                                 "cluster stages none: its TaskManagers have them)")


_FLINK_MASTER = re.compile(r"^(https?://)?[A-Za-z0-9_.\-\[\]:]+:\d+/?$")


def _names(args: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def flink_args(flink_master: str | None, beam_args: Sequence[str] = ()) -> list[str]:
    """Beam options for a Flink run: the local cluster, or the cluster at ``flink_master``."""
    from flowtrain.local.flink import FLINK_VERSION, FlinkError, LocalFlink, job_server_jar

    if flink_master is None:
        try:
            return LocalFlink().beam_args() + _job_name(beam_args)
        except FlinkError as err:
            raise RunnerOptionError(str(err)) from err
    if not _FLINK_MASTER.match(flink_master):
        raise RunnerOptionError(f"--flink-master {flink_master!r}: expected HOST:PORT, the JobManager's REST address "
                          f"(e.g. flink-jm.example.org:8081)")
    if not _names(beam_args, "--environment_type"):
        raise RunnerOptionError(
            f"--flink-master {flink_master}: say how that cluster's TaskManagers start Python SDK workers "
            f"(flowtrain uses no Docker): --environment_type=EXTERNAL --environment_config=HOST:PORT with "
            f"`python -m flowtrain.local.flink.worker_pool --host 0.0.0.0 --port PORT` running on every "
            f"TaskManager host (a Python with flowtrain installed), or --environment_type=PROCESS "
            f"--environment_config='{{\"command\": \"/path/to/beam/boot\"}}' (the Beam Python SDK boot binary)")
    try:
        jar = job_server_jar()
    except FlinkError as err:
        raise RunnerError(str(err)) from err
    return ["--runner=FlinkRunner", f"--flink_master={flink_master}", f"--flink_version={FLINK_VERSION}",
            f"--flink_job_server_jar={jar}", *_job_name(beam_args)]


def _job_name(beam_args: Sequence[str]) -> list[str]:
    """A unique Flink job name unless the user gave one: how ``cancel_pipeline`` finds the job."""
    return [] if _names(beam_args, "--job_name") else [f"--job_name=flowtrain-{uuid.uuid4().hex[:12]}"]


def cancel_pipeline(result, options: PipelineOptions, *, timeout_s: float = 60.0) -> None:
    """Cancel a running pipeline. On Flink also the Flink job itself: Beam's Flink job server
    only stops waiting for it, and the job would run on (reading, writing, committing offsets)."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions

    try:
        result.cancel()
    finally:
        job_name = options.view_as(GoogleCloudOptions).job_name
        rest = _flink_rest(options)
        if job_name and rest:
            from flowtrain.local.flink.rest import cancel_flink_jobs

            cancel_flink_jobs(rest, job_name, timeout_s=timeout_s)


def beam_counters(result, namespace: str) -> dict[str, int]:
    """The counters of ``namespace`` a (running or finished) pipeline reports, summed over steps:
    committed where the runner keeps them, else attempted (Prism's attempted counts of a running
    streaming job lag its committed ones, and were seen at 0). Empty when the runner reports none."""
    from apache_beam.metrics.metric import MetricsFilter

    found = result.metrics().query(MetricsFilter().with_namespace(namespace))
    out: dict[str, int] = {}
    for counter in found["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        out[counter.key.metric.name] = out.get(counter.key.metric.name, 0) + int(value or 0)
    return out


def watch_pipeline(result, options: PipelineOptions, should_stop, *, what: str, every=None,
                   every_s: float = 5.0) -> tuple[str, int]:
    """Poll a streaming pipeline until it ends by itself or ``should_stop()`` (e.g. a signal handler's
    flag); then cancel it (on Flink also the Flink job). ``every()`` runs every
    ``every_s`` seconds while it runs and once more before the cancel (e.g. saving the runner's
    metrics: a Ctrl-C sent to the terminal's whole process group may end a local runner before
    the cancel, so what is saved while it runs is what survives). Returns ``(state, exit code)``:
    the runner's final state and 1 if it FAILED, or ``("CANCELLED", 0)``, or ``("RUNNING", 1)`` when the
    Flink job could not be cancelled (it runs on: never reported stopped). ``what`` names the job in
    the lines printed."""
    import sys

    def run_every() -> None:
        if every is None:
            return
        try:
            every()
        except Exception as err:  # noqa: BLE001 - a runner going away mid-call: the job's state decides
            if not should_stop():
                print(f"{what}: {type(err).__name__}: {err}"[:300], flush=True)

    next_at = time.monotonic() + every_s
    while not should_stop():
        try:
            state = str(result.state)
        except Exception:  # noqa: BLE001 - a stop signal sent to the whole group also ends the runner mid-call
            waited = time.monotonic() + 5.0  # the signal's handler runs once the failed call has returned
            while not should_stop() and time.monotonic() < waited:
                time.sleep(0.05)
            if should_stop():
                break
            raise
        if any(s in state for s in ("FAILED", "DONE", "CANCELLED")):
            run_every()
            return state, 1 if "FAILED" in state else 0
        if time.monotonic() >= next_at:
            run_every()
            next_at = time.monotonic() + every_s
        time.sleep(0.5)
    run_every()
    from flowtrain.local.flink.jars import FlinkError

    try:
        cancel_pipeline(result, options)  # on Flink also the Flink job (Beam's cancel leaves it running)
    except FlinkError as err:  # the Flink job runs on: never report it stopped
        print(f"{what}: the Flink job was not cancelled: {err}", file=sys.stderr, flush=True)
        return "RUNNING", 1
    except Exception as err:  # noqa: BLE001 - a terminal's Ctrl-C also reaches (and ends) the runner
        print(f"{what}: the runner was already gone ({type(err).__name__})", flush=True)
    return "CANCELLED", 0


def _flink_rest(options: PipelineOptions) -> str | None:
    """The REST address of the Flink cluster ``options`` run on, if they run on Flink."""
    from apache_beam.options.pipeline_options import FlinkRunnerOptions, PortableOptions, StandardOptions

    runner = str(options.view_as(StandardOptions).runner or "")
    if runner.endswith("FlinkRunner"):
        master = options.view_as(FlinkRunnerOptions).flink_master
        return None if master.startswith("[") else master
    endpoint = options.view_as(PortableOptions).job_endpoint
    if endpoint:
        from flowtrain.local.flink import LocalFlink

        state = LocalFlink().read_state() or {}
        if state.get("job_endpoint") == endpoint:
            return state["rest"]
    return None


def runner_args(runner: str | None, flink_master: str | None, beam_args: Sequence[str] = ()) -> list[str]:
    """Beam options for flowtrain's ``--runner`` / ``--flink-master``, to put before ``beam_args``.

    ``runner="flink"`` runs on Flink: the local cluster (``flowtrain flink start``; its directory
    from ``$FLOWTRAIN_FLINK_DIR`` or the cache), or the cluster whose REST address is
    ``flink_master``. Any other ``runner`` is Beam's ``--runner`` (``FnApiRunner``,
    ``PrismRunner``, ``DataflowRunner``, ...); None leaves the choice to the mode.
    """
    if flink_master is not None and runner not in (None, "flink"):
        raise RunnerOptionError(f"--flink-master goes with --runner flink, not --runner {runner}")
    if runner == "flink" or flink_master is not None:
        if _names(beam_args, "--runner"):
            raise RunnerOptionError("--runner flink and a Beam --runner=... option were both given; keep one")
        return flink_args(flink_master, beam_args)
    return [f"--runner={runner}"] if runner else []


def pick_runner(runner: str | None, flink_master: str | None, beam_args: Sequence[str] = ()) -> list[str]:
    """``beam_args`` with the Beam options of flowtrain's ``--runner`` / ``--flink-master`` in front
    (:func:`runner_args`): the one place a job's runner is picked, for batch and predict (through
    :func:`pipeline_options`) and for each pipeline of a stream job (``flowtrain.commands.stream.job``)."""
    return runner_args(runner, flink_master, beam_args) + list(beam_args)


def pipeline_options(mode: Mode = "batch", beam_args: Sequence[str] = (), *, runner: str | None = None,
                     flink_master: str | None = None, **overrides) -> PipelineOptions:
    """Options for ``mode``; ``beam_args`` (standard Beam flags) always win over our defaults.

    ``runner`` and ``flink_master`` are flowtrain's ``--runner`` / ``--flink-master`` (see
    :func:`runner_args`). If ``beam_args`` names a ``--runner``, the mode's runner choice is
    skipped, so ``flowtrain batch --runner=FlinkRunner --flink_master=...`` goes where the user says.
    """
    args = pick_runner(runner, flink_master, beam_args)
    user_runner = _names(args, "--runner")
    defaults: list[str] = []
    if mode == "batch" and not user_runner:
        defaults = ["--runner=FnApiRunner"]
    elif mode == "streaming":
        defaults = ["--streaming"]
        if not user_runner:
            # prism_disable_sdf_split: Prism asks a slow SDF bundle (a Kafka read waiting on a
            # quiet or restarting broker) for a dynamic split. ReadFromKafka never splits a
            # partition, and Beam 2.77's Python harness can compute that split from a NaN
            # progress (output bytes read between the element and byte counters of the first
            # output) and fail the pipeline. Checkpoints (defer_remainder) are unaffected.
            defaults += [f"--runner={LocalPrismRunner.__module__}.LocalPrismRunner",
                         f"--prism_location={ensure_prism()}",
                         "--environment_type=LOOPBACK", "--experiments=prism_disable_sdf_split"]
    elif mode == "remote" and not user_runner:
        raise RunnerError("remote mode needs the runner's options, e.g. --runner=FlinkRunner "
                          "--flink_master=HOST:8081 or --runner=DataflowRunner --project=...")
    return PipelineOptions(defaults + args, **overrides)
