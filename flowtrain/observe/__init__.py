"""Seeing what runs: TensorBoard event files (``board``), Prometheus metrics and the live status
page of a streaming job (``server``), and ``flowtrain compare`` (``compare``)."""
