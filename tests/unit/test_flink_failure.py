"""A failed Flink job's error names where it failed (``flowtrain.local.flink.failure``): the job's name from Beam's
message, and the lines made of the JobManager's exception history (here a response of the shape Flink 1.19's
``/jobs/:jobid/exceptions`` gives; the real one, a TaskManager killed on another host, is
tests/multihost/test_flink_hosts.py's)."""
from __future__ import annotations

from flowtrain.local.flink.failure import MAX_LINES, failed_job_name, failure_lines, history_lines

TRACE = """org.apache.flink.runtime.io.network.netty.exception.RemoteTransportException: Lost connection to task \
manager '10.0.0.3:41877 [ tm-10.0.0.3-1 ] '. This indicates that the remote task manager was lost.
\tat org.apache.flink.runtime.io.network.netty.CreditBasedPartitionRequestClientHandler.exceptionCaught(X.java:1)
\t... 12 more
Caused by: org.apache.flink.shaded.netty4.io.netty.channel.unix.Errors$NativeIoException: recvAddress(..) failed: \
Connection reset by peer
"""


def test_the_job_name_comes_from_beams_message_and_other_errors_have_none():
    err = RuntimeError("Pipeline flowtrain-3096928f3c8c_d753d9d7-4ffa-4efe-87c4-00cc1b4579d9 failed in state FAILED: "
                       "org.apache...NativeIoException: recvAddress(..) failed: Connection reset by peer")
    assert failed_job_name(err) == "flowtrain-3096928f3c8c"
    assert failed_job_name(RuntimeError("something else")) is None
    assert failure_lines(RuntimeError("something else")) == []  # not a Flink job: the error goes on as it was


def test_the_history_names_the_task_its_taskmanager_and_the_lost_one_from_the_stack_trace():
    history = {"exceptionHistory": {"entries": [
        {"exceptionName": "RemoteTransportException", "taskName": "ETL/Write (1/2)", "taskManagerId": "tm-10.0.0.2-1",
         "endpoint": "10.0.0.2:40001", "stacktrace": TRACE,
         "concurrentExceptions": [{"exceptionName": "TaskManagerLostException", "taskName": "ETL/Read (2/2)",
                                   "taskManagerId": "tm-10.0.0.3-1", "location": "10.0.0.3:41877",
                                   "stacktrace": "x.TaskManagerLostException: TaskManager tm-10.0.0.3-1 lost\n"}]},
        {"exceptionName": "OlderFailure", "taskName": "old", "taskManagerId": "tm-old", "stacktrace": ""}]}}
    lines = history_lines(history, "http://10.0.0.1:8081/jobs/j/exceptions")
    assert lines[0] == "Flink's exception history (http://10.0.0.1:8081/jobs/j/exceptions):"
    assert lines[1] == "task ETL/Write (1/2) on TaskManager tm-10.0.0.2-1 (10.0.0.2:40001): RemoteTransportException"
    assert lines[2] == "task ETL/Read (2/2) on TaskManager tm-10.0.0.3-1 (10.0.0.3:41877): TaskManagerLostException"
    assert any("Lost connection to task manager '10.0.0.3:41877 [ tm-10.0.0.3-1 ] '" in line for line in lines)
    assert not any("tm-old" in line or "\tat" in line or "Connection reset" in line for line in lines)
    assert len(lines) <= MAX_LINES
    assert history_lines({"exceptionHistory": {"entries": []}}, "x") == []
