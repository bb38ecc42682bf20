"""Drift and data-quality monitoring: reference profiles of a dataset's features, label and model scores
(``profile``), the measures that compare a window of data with them (``measures``), shared by
``flowtrain drift``, ``flowtrain predict`` and the stream scorer (``pipelines.serving.drift``)."""
