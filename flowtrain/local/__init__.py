"""Local real components: the Kafka broker from the Apache jars (``kafka``), Beam runner options
and the Prism binary (``runners``), the Flink session cluster (``flink``), provisioning and the
cache (``provision``, ``paths``), and what they share: tools on the PATH, Java, ports (``tools``)."""
