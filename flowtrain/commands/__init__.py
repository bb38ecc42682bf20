"""Old import path of the command modules, kept working: see ``flowtrain.cli``."""
