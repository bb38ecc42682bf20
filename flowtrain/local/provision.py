"""Provision the real components that are not pip packages: Kafka jars, the Prism runner, Apicurio Registry,
Azurite (the tests' object store, from npm) and, with ``--flink``, Beam's Flink runner with the Flink 1.19 jars.

Run by ``make install`` (Kafka, Prism, the registry, Azurite) and ``make test`` (``--flink`` too: the Flink tests
run a real cluster); each step is skipped when its cache is already complete. ``flowtrain flink
start`` fetches the Flink jars on first use as well, so nobody has to run this first.
"""
from __future__ import annotations

import argparse
import sys
import time

from flowtrain.local.azurite import AzuriteError, ensure_azurite
from flowtrain.local.flink import FlinkError
from flowtrain.local.flink import ensure_jars as ensure_flink_jars
from flowtrain.local.kafka import BrokerError, ensure_jars
from flowtrain.local.registry import RegistryError, ensure_registry
from flowtrain.local.runners import RunnerError, ensure_prism


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowtrain.local.provision", description=__doc__)
    ap.add_argument("--flink", action="store_true",
                    help="also resolve Beam's Flink runner and Flink 1.19 (~160 jars, ~150 MiB) with mvn")
    ap.add_argument("--only-flink", action="store_true", help="only the Flink jars")
    args = ap.parse_args(argv)

    try:
        if not args.only_flink:
            t0 = time.monotonic()
            libs = ensure_jars()
            print(f"provision: Kafka jars ready in {libs} ({time.monotonic() - t0:.1f} s)")
            t0 = time.monotonic()
            prism = ensure_prism()
            print(f"provision: Prism runner ready at {prism} ({time.monotonic() - t0:.1f} s)")
            t0 = time.monotonic()
            registry = ensure_registry()
            print(f"provision: Apicurio Registry ready in {registry} ({time.monotonic() - t0:.1f} s)")
            t0 = time.monotonic()
            azurite = ensure_azurite()
            print(f"provision: Azurite ready at {azurite} ({time.monotonic() - t0:.1f} s)")
        if args.flink or args.only_flink:
            t0 = time.monotonic()
            libs = ensure_flink_jars()
            print(f"provision: Flink runner jars ready in {libs} ({time.monotonic() - t0:.1f} s)")
    except (BrokerError, RunnerError, FlinkError, RegistryError, AzuriteError) as err:
        print(f"provision: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
