"""The jobs behind the commands, typed: ``run_batch(BatchJob)``, ``run_predict(PredictJob)``,
``run_export(ExportJob)`` and ``load(bundle)``. The command line (``flowtrain.cli``) and the Python API
(``flowtrain.batch``, ``flowtrain.predict``, ``flowtrain.load``) both call these; each job's options are the
fields of its dataclass (``connectors.fields``).

These modules compose the Beam pipelines (``pipelines``) with the engine (``flowtrain.train``), so like
the command line they may import ``pipelines``; the engine's packages may not.
"""
