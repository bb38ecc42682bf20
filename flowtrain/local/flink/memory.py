"""What a local Flink cluster is configured with: each TaskManager's memory, given explicitly as Flink's start
scripts would compute it, and the processes' log4j configuration."""
from __future__ import annotations

from dataclasses import dataclass

LOG4J = """\
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = MainAppender
appender.main.name = MainAppender
appender.main.type = File
appender.main.fileName = ${sys:log.file}
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %-5p %-60c %x - %m%n
logger.pekko.name = org.apache.pekko
logger.pekko.level = WARN
"""


@dataclass
class TaskManagerMemory:
    """One TaskManager's memory (MiB), given to Flink explicitly as its start scripts would.

    The defaults suit the tests' inputs. A pipeline that broadcasts a big side input or
    aggregates into one big element (the demo ETL's reference tables at 10x: one 23 MB
    record) needs more of all three of task heap (records on the JVM side), managed memory
    (Flink's sort buffers: a record must fit one) and task off-heap (the gRPC data plane to the
    Python workers uses direct memory); the 10x demo ETL ran with 1024 / 768 / 768.
    """

    framework_heap: int = 128
    task_heap: int = 384
    framework_off_heap: int = 128
    task_off_heap: int = 256  # Beam's Fn API data plane (gRPC, Netty) allocates direct buffers
    network_per_slot: int = 256  # Beam's batch jobs deploy every operator at once: many channels
    managed: int = 128
    metaspace: int = 256
    overhead: int = 192

    def flink_options(self, slots: int) -> dict[str, str]:
        net = f"{self.network_per_slot * slots}m"
        return {
            "taskmanager.memory.framework.heap.size": f"{self.framework_heap}m",
            "taskmanager.memory.task.heap.size": f"{self.task_heap}m",
            "taskmanager.memory.framework.off-heap.size": f"{self.framework_off_heap}m",
            "taskmanager.memory.task.off-heap.size": f"{self.task_off_heap}m",
            "taskmanager.memory.network.min": net,
            "taskmanager.memory.network.max": net,
            "taskmanager.memory.managed.size": f"{self.managed}m",
            "taskmanager.memory.jvm-metaspace.size": f"{self.metaspace}m",
            "taskmanager.memory.jvm-overhead.min": f"{self.overhead}m",
            "taskmanager.memory.jvm-overhead.max": f"{self.overhead}m",
        }

    def jvm_options(self, slots: int) -> list[str]:
        heap = self.framework_heap + self.task_heap
        direct = self.framework_off_heap + self.task_off_heap + self.network_per_slot * slots
        return [f"-Xmx{heap}m", f"-Xms{heap}m", f"-XX:MaxDirectMemorySize={direct}m",
                f"-XX:MaxMetaspaceSize={self.metaspace}m"]
