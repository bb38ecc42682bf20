"""Local real components: the Kafka broker from the Apache jars (``kafka``), Beam runner options
and the Prism binary (``runners``), provisioning and the cache (``provision``, ``paths``)."""
