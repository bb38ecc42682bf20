"""Issue 44 item 9: ``flowtrain registry stop --data-dir D`` without ``--port`` stops what D's ``registry.json``
records. It looked for a registry on the default port 8081 and left the one started on another port running.
What is tested is the stop (reading the state file, recognising the process, stopping it): the process stands
for the registry (a sleeper whose command line holds the registry's own port setting, recorded as the registry
records itself); ``test_event_formats_registry.py`` starts the real one."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from flowtrain.cli.main import main
from flowtrain.local.processes import identity
from flowtrain.local.registry import LocalRegistry


def test_item9_registry_stop_with_only_the_data_dir_stops_the_recorded_registry(tmp_path, capsys):
    data = tmp_path / "reg"
    data.mkdir()
    port = 18_571
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"-Dquarkus.http.port={port}"],
                            start_new_session=True)
    try:
        reg = LocalRegistry(port=port, data_dir=data)
        (data / "registry.json").write_text(json.dumps({**identity(proc.pid), "url": reg.url, "port": port,
                                                        "version": reg.version, "started_at": time.time()}))
        assert main(["registry", "status", "--data-dir", str(data), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["running"] and status["pid"] == proc.pid and status["url"] == reg.url
        assert main(["registry", "stop", "--data-dir", str(data)]) == 0
        assert f"registry: stopped pid {proc.pid} at {reg.url}" in capsys.readouterr().out
        assert proc.wait(timeout=30) is not None
        assert main(["registry", "status", "--data-dir", str(data)]) == 1
        assert LocalRegistry.of(data).port == port and LocalRegistry.of(data, 9).port == 9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
