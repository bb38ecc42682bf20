"""flowtrain's version, in a module of its own: the bundle's manifest, MLflow's pip requirement and ``--version``
read it without importing the ``flowtrain`` package's API (which imports the commands)."""
__version__ = "0.1.0"
