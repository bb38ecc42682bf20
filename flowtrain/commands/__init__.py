"""The jobs behind the commands, typed, a folder per command family (``batch/``, ``predict/``, ``drift/``,
``features/``, ``stream/``, ``tune/``), each with its options (``options.py``) and its run function
(``run_batch(BatchJob)`` in ``batch/job.py``, ``run_predict(PredictJob)``, ``run_export(ExportJob)``,
``load(bundle)``...); what several share sits beside them. The command line (``flowtrain.cli``) and the Python API
(``flowtrain.batch``, ``flowtrain.predict``, ``flowtrain.load``) both call these; each job's options are the
fields of its dataclass (``connectors.fields``).

These modules compose the Beam pipelines (``pipelines``) with the engine (``flowtrain.train``), so like
the command line they may import ``pipelines``; the engine's packages may not.
"""
