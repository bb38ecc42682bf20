"""Provision the real components that are not pip packages: Kafka jars and the Prism runner.

Run by ``make install``; each step is skipped when its cache is already complete.
"""
from __future__ import annotations

import sys
import time

from flowtrain.local.kafka import BrokerError, ensure_jars
from flowtrain.local.runners import RunnerError, ensure_prism


def main() -> int:
    try:
        t0 = time.monotonic()
        libs = ensure_jars()
        print(f"provision: Kafka jars ready in {libs} ({time.monotonic() - t0:.1f} s)")
        t0 = time.monotonic()
        prism = ensure_prism()
        print(f"provision: Prism runner ready at {prism} ({time.monotonic() - t0:.1f} s)")
    except (BrokerError, RunnerError) as err:
        print(f"provision: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
