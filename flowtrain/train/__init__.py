"""Training: the loop (``loop``), the online stream trainer (``stream``), the columnar loader
(``loader``), models (``model``), checkpoints, metrics and the run report."""
