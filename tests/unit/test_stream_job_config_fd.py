"""Issue 44 item 11: the whole ``flowtrain stream`` job hands its parts their options (which may hold secrets)
without leaving a file behind. It wrote them to a 0600 temporary file and deleted it when the job ended, so a
SIGKILL of the job left it in the temporary directory. Now the file is deleted as soon as it is written; the
parts read it through a descriptor they inherit (``--config /dev/fd/N``).

The job here is the real ``_run_parts`` with the real supervisor; each part is a stand-in that reads its
``--config`` as the part's option parser does (``flowtrain.cli.options.load_config``) and waits (the parts
themselves need a broker: the stream tests run them)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time


def test_item11_the_stream_jobs_options_file_is_gone_at_once_and_after_a_sigkill(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    job = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from flowtrain.commands.stream import job as stream_job
        from flowtrain.commands.stream.options import StreamJob

        PART = ("import os, sys, time; from pathlib import Path; q = Path(sys.argv[1]); assert q.is_file(); "
                "print('pid:', os.getpid()); print('read:', q.read_text(), flush=True); time.sleep(120)")
        real = stream_job.supervise

        def parts(commands, **kwargs):  # each part reads its --config, then waits
            return real({name: ([sys.executable, "-c", PART, argv[argv.index("--config") + 1]], log)
                         for name, (argv, log) in commands.items()}, **kwargs)

        stream_job.supervise = parts
        stream_job.live_line = lambda job, out, last: ("stream: running", last)
        job = StreamJob(out=sys.argv[1], bootstrap="127.0.0.1:1", group_id="g-44")
        stream_job._run_parts(job, [], ["pipeline", "train"], given={"bootstrap", "group_id"})
    """), str(out)], env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 120
        logs = [out / "pipeline.log", out / "trainer.log"]
        while not all(p.exists() and "read:" in p.read_text() for p in logs):
            assert job.poll() is None, f"the job ended: {job.returncode}"
            assert time.monotonic() < deadline, [p.read_text() for p in logs if p.exists()]
            time.sleep(0.2)
        for log in logs:  # each part read the job's options through the inherited descriptor
            options = json.loads(log.read_text().split("read:", 1)[1].strip().splitlines()[0])
            assert options["group_id"] == "g-44" and options["metrics_port"] == 0
        assert list(tmp.iterdir()) == []  # no file while the job runs
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        time.sleep(0.5)
        assert list(tmp.iterdir()) == []  # nor after a SIGKILL
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=10)
        for log in [out / "pipeline.log", out / "trainer.log"]:  # the stand-ins end with their parent; if not
            text = log.read_text() if log.exists() else ""
            if "pid:" in text:
                pid = int(text.split("pid:", 1)[1].split()[0])
                if os.path.exists(f"/proc/{pid}") and "time.sleep(120)" in open(f"/proc/{pid}/cmdline").read():
                    os.kill(pid, signal.SIGKILL)
