"""Beam I/O anyone can reuse: Kafka (pure Python), Arrow codec, dataset files, dead letters.

Depends on Apache Beam, pyarrow and kafka-python only.
"""
