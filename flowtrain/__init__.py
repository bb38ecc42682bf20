"""flowtrain: train PyTorch models straight from Apache Beam dataflows."""
__version__ = "0.1.0"
