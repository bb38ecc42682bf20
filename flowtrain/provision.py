"""Old entry point, kept working: ``python -m flowtrain.provision`` runs ``flowtrain.local.provision``."""
import sys

from flowtrain.local.provision import main

if __name__ == "__main__":
    sys.exit(main())
