"""``python -m flowtrain.cli``: the same as the ``flowtrain`` command."""
import sys

from flowtrain.cli.main import main

sys.exit(main())
