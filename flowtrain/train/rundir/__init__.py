"""A run directory (``--out``) as one concept: the rules of who may write into it and what a later run replaces
(``rules``: ``prepare_run_dir``, ``prepare_stream_dir`` and the ``RunDir`` they return, which ends the run), its marker
``run.json`` (``marker``), its lock (``lock``) and the table of its files (``files``: ``RunFiles(path).model``).
docs/runs.md is the user's side of it. The table and the marker import neither torch nor Beam (the command line reads
them); the rules do.
"""
