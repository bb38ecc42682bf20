"""Old entry point, kept working: ``python -m flowtrain.worker`` runs ``flowtrain.parallel.worker``."""
import sys

from flowtrain.parallel.worker import main

if __name__ == "__main__":
    sys.exit(main())
