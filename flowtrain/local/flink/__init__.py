"""A local Apache Flink session cluster with Beam's Flink job server, from Maven jars."""
from flowtrain.local.flink.cluster import DIR_ENV, LocalFlink, default_dir
from flowtrain.local.flink.jars import BEAM_RUNNER_VERSION, FLINK_VERSION, FlinkError, ensure_jars, job_server_jar
from flowtrain.local.flink.memory import TaskManagerMemory

__all__ = ["BEAM_RUNNER_VERSION", "DIR_ENV", "FLINK_VERSION", "FlinkError", "LocalFlink", "TaskManagerMemory",
           "default_dir", "ensure_jars", "job_server_jar"]
