"""Beam pipeline options for the three ways flowtrain runs a pipeline.

* ``local batch``: Beam's FnApiRunner, chosen explicitly. Beam's default (the
  SwitchingDirectRunner) first tries to download Prism from GitHub, which hangs offline.
* ``local streaming``: Prism, built once per machine from the Go module proxy with
  ``go install`` and passed with ``--prism_location``. It really executes unbounded
  splittable DoFns, fires windows on a real clock and can be cancelled.
* ``remote``: the user's own options (``--runner=FlinkRunner ...``, ``DataflowRunner``),
  passed through untouched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from flowtrain.local.paths import cache_root

Mode = Literal["batch", "streaming", "remote"]


class RunnerError(RuntimeError):
    """The local runner could not be provisioned; the message says what to install."""


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
        print(f"prism: building github.com/apache/beam/sdks/v2/go/cmd/prism@v{version} into {binary.parent}",
              flush=True)
    t0 = time.monotonic()
    proc = subprocess.run([go, "install", f"github.com/apache/beam/sdks/v2/go/cmd/prism@v{version}"],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not binary.exists():
        raise RunnerError(f"building Prism failed:\n{proc.stderr[-3000:]}")
    if not quiet:
        print(f"prism: built in {time.monotonic() - t0:.0f} s", flush=True)
    return binary


def pipeline_options(mode: Mode = "batch", beam_args: Sequence[str] = (), **overrides) -> PipelineOptions:
    """Options for ``mode``; ``beam_args`` (standard Beam flags) always win over our defaults.

    If ``beam_args`` names a ``--runner``, the mode's runner choice is skipped, so
    ``flowtrain batch --runner=FlinkRunner --flink_master=...`` goes where the user says.
    """
    args = list(beam_args)
    user_runner = any(a == "--runner" or a.startswith("--runner=") for a in args)
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
