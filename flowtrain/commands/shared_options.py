"""Option sections that several commands take, each option declared once with its one default (``connectors.fields``:
a command lists the sections it takes as its bases; ``connectors.fields.tailor`` gives one command its own help where
the option means something of its own there, e.g. ``--bundle-key-file`` signs in ``batch`` and verifies in
``predict``; ``connectors.fields.narrow`` gives one its own stricter check, e.g. ``--out`` a local path only where
the command cannot write to an object store). The engine's sections are in ``flowtrain.train.options``; the local
services' in ``commands.local``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from connectors.fields import COMPOSED, at_least, option, store_path

#: --help sections.
RUNNER = "where the Beam pipeline runs"
GENERAL = "options"


# --- what a command reads and writes: each command tailors the help (and where one has it, the default) and narrows
# the check where it can use less than the declaration takes (a local path only: connectors.fields.narrow) -----------
@dataclass
class Out:
    """``--out``: what a command writes, a file or a directory, local or on an object store (``batch``, ``tune``,
    ``predict``, ``export``, ``features``, ``drift``, ``predictions``, ``stream``; the ones that write locally only
    narrow it to a local path)."""

    out: str | None = option(None, "where the command writes, local or on an object store (gs://, s3://, az://: "
                             "docs/object-stores.md)", parse=store_path("--out"))


@dataclass
class Input:
    """``--input``: the files a command reads (``batch``, ``predict``, ``features``, ``drift``, ``replay``; the ones
    that read through a filesystem check narrow it to paths: ``connectors.paths.check_path``)."""

    input: tuple[str, ...] = option((), "files or globs to read (repeat or comma-separate)", repeat=True)


@dataclass
class Dataset:
    """``--dataset``: a `flowtrain batch` dataset directory a command reads (``batch``, ``schema``, ``stream``,
    ``replay``, ``predictions``; the ones that read it through a filesystem check narrow it to a path)."""

    dataset: str | None = option(None, "a `flowtrain batch` dataset directory")


@dataclass
class RunOrBundle:
    """``--model`` of the commands that use a trained model: a `flowtrain batch` run directory or a bundle
    (``predict``, ``drift``). Not ``flowtrain batch --model``, your own model's factory (``flowtrain.train.options``):
    one flag name, two meanings."""

    model: str | None = option(None, "a `flowtrain batch` run directory (its bundle/) or a bundle directory "
                               "(`flowtrain export`)", metavar="RUN_OR_BUNDLE", parse=store_path("--model"))


@dataclass
class RunnerOptions:
    """Where a Beam pipeline of the job runs (``flowtrain.local.runners.pick_runner``)."""

    runner: str | None = option(
        None, "flink: the local Flink cluster of `flowtrain flink start` (its directory from $FLOWTRAIN_FLINK_DIR), "
              "or --flink-master's; any other value is Beam's --runner (FnApiRunner, PrismRunner, DataflowRunner, "
              "...). Default: Beam's FnApiRunner for batch ETL, Prism for streaming", group=RUNNER)
    flink_master: str | None = option(
        None, "with --runner flink: the JobManager REST address of another Flink 1.19 cluster; Beam starts its Flink "
              "job server from flowtrain's jars. Give the SDK workers' environment too: --environment_type=EXTERNAL "
              "--environment_config=HOST:PORT (a worker pool on every TaskManager host: python -m "
              "flowtrain.local.flink.worker_pool) or PROCESS (default: none)", metavar="HOST:PORT", group=RUNNER)


@dataclass
class BeamArgs:
    """Beam's own pipeline options, passed through (``batch``, ``features``, ``predict``; ``stream`` takes them after
    ``--``)."""

    beam_args: tuple[str, ...] = option((), "Beam pipeline options, e.g. --beam-args=--direct_num_workers=2 (on the "
                                        "command line, give Beam's options as they are)", group=RUNNER, repeat=True)


@dataclass
class BundleKey:
    """The key of a bundle's signature: ``batch`` and ``export`` sign with it, ``predict`` and ``drift`` verify."""

    bundle_key_file: str | None = option(None, "sign the run's bundle/ with this key (HMAC-SHA256; a file only you "
                                         "may read; else $FLOWTRAIN_BUNDLE_KEY; default: none, not signed); "
                                         "`flowtrain predict --bundle-key-file` verifies it", metavar="FILE")


@dataclass
class Overwrite:
    """``--overwrite``: a command whose ``--out`` exists replaces it (only what flowtrain wrote; each command says
    what that is)."""

    overwrite: bool = option(False, "replace --out when it exists")


@dataclass
class TrustCode:
    """``--trust-code``: a bundle whose model is a user's own code (``--model MODULE:FACTORY``) is imported and run."""

    trust_code: bool = option(False, "the bundle's model is your own code (trained with --model MODULE:FACTORY): "
                              "import and run that module (only for a bundle you trust; without, such a bundle is "
                              "refused and loading runs no code)")


@dataclass
class LabelColumn:
    """The label column of the rows a command reads (``batch``, ``replay``)."""

    label: str | None = option(None, "label column")


@dataclass
class TimeColumn:
    """The time column of the rows a command reads, and how it is written (``batch``, ``features``; ``replay`` takes
    the column only)."""

    time_column: str | None = option(None, "each row's time column")


@dataclass
class TimeFormat:
    """How a text time column is written (``batch``, ``features``)."""

    time_format: str | None = option(None, "how the time column is written when it is text: a strptime format "
                                     "(e.g. '%d.%m.%Y %H:%M'), or epoch / epoch_ms / epoch_us / epoch_ns for numbers "
                                     "(default: ISO dates and timestamps, YYYY/MM/DD, epoch seconds)")


@dataclass
class Timeout:
    """``--timeout``: how long a command waits, in seconds: each local service's action for its service (each its own
    default: what it waits for differs), ``flowtrain tune`` before it stops starting trials (section tune)."""

    SECTION: ClassVar[str] = COMPOSED
    timeout: float | None = option(90.0, "seconds to wait for the service (default 90)")


@dataclass
class Limit:
    """``--limit``: how many records a command handles at most (``flowtrain replay``'s events, ``flowtrain
    predictions``' predictions, which narrows it to >= 1)."""

    limit: int | None = option(None, "at most this many (default: all)", parse=at_least(0))
