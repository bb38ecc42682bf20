"""Beam pipeline options for the three ways flowtrain runs a pipeline.

* ``local batch``: Beam's FnApiRunner, chosen explicitly. Beam's default (the
  SwitchingDirectRunner) first tries to download Prism from GitHub, which hangs offline.
* ``local streaming``: Prism, built once per machine from the Go module proxy with
  ``go install`` and passed with ``--prism_location``. It really executes unbounded
  splittable DoFns, fires windows on a real clock and can be cancelled.
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
import time
import uuid
from pathlib import Path
from typing import Literal, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from flowtrain.local.paths import cache_root

Mode = Literal["batch", "streaming", "remote"]


class RunnerError(RuntimeError):
    """The local runner could not be provisioned; the message says what to install."""


class RunnerOptionError(RunnerError, ValueError):
    """A runner option cannot be used as given (no local Flink cluster, a malformed --flink-master)."""


def beam_version() -> str:
    from apache_beam.version import __version__

    return __version__


def prism_path(version: str | None = None) -> Path:
    version = version or beam_version()
    return cache_root() / "prism" / f"v{version}" / "prism"


def ensure_prism(version: str | None = None, *, quiet: bool = False) -> Path:
    """Build Prism for this Beam version with ``go install`` once per machine."""
    binary = prism_path(version)
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        raise RunnerError("`go` was not found on PATH; flowtrain builds Beam's Prism runner (the local "
                          "streaming runner) with it. Install Go 1.22+ (https://go.dev/doc/install or "
                          "Debian `apt-get install golang`).")
    version = version or beam_version()
    env = dict(os.environ, GOBIN=str(binary.parent), CGO_ENABLED="0")
    if not quiet:
        print(f"prism: first streaming run on this machine: building Beam's Prism runner (go install "
              f"github.com/apache/beam/sdks/v2/go/cmd/prism@v{version}) into {binary.parent} (once; 1-2 minutes)",
              flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([go, "install", f"github.com/apache/beam/sdks/v2/go/cmd/prism@v{version}"],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not binary.exists():
        raise RunnerError(f"building Prism failed:\n{proc.stderr[-3000:]}")
    if not quiet:
        print(f"prism: built in {time.monotonic() - t0:.0f} s", flush=True)
    return binary


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
            from flowtrain.local.flink.cluster import cancel_flink_jobs

            cancel_flink_jobs(rest, job_name, timeout_s=timeout_s)


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


def pipeline_options(mode: Mode = "batch", beam_args: Sequence[str] = (), *, runner: str | None = None,
                     flink_master: str | None = None, **overrides) -> PipelineOptions:
    """Options for ``mode``; ``beam_args`` (standard Beam flags) always win over our defaults.

    ``runner`` and ``flink_master`` are flowtrain's ``--runner`` / ``--flink-master`` (see
    :func:`runner_args`). If ``beam_args`` names a ``--runner``, the mode's runner choice is
    skipped, so ``flowtrain batch --runner=FlinkRunner --flink_master=...`` goes where the user says.
    """
    args = runner_args(runner, flink_master, beam_args) + list(beam_args)
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
            defaults += ["--runner=PrismRunner", f"--prism_location={ensure_prism()}",
                         "--environment_type=LOOPBACK", "--experiments=prism_disable_sdf_split"]
    elif mode == "remote" and not user_runner:
        raise RunnerError("remote mode needs the runner's options, e.g. --runner=FlinkRunner "
                          "--flink_master=HOST:8081 or --runner=DataflowRunner --project=...")
    return PipelineOptions(defaults + args, **overrides)
