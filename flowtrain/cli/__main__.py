"""``python -m flowtrain.cli``: the same as the ``flowtrain`` command."""
from flowtrain.cli.main import entry

entry()
