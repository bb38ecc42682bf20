"""docker/: no Docker engine runs on the development machines, so the image is linted and its inputs
checked instead of built: hadolint passes, every path the Dockerfile copies from the build context
exists, and the compose file publishes ports on 127.0.0.1 only."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def test_hadolint_passes():
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), "hadolint is missing: it comes with the test extra (pip install -e '.[test]')"
    result = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_path_the_dockerfile_copies_from_the_context_exists():
    copied = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.upper().startswith("COPY "):
            continue
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() != "COPY" or any(w.startswith("--from") for w in words):
            continue
        copied += [w for w in words[1:-1] if not w.startswith("--")]
    assert {"pyproject.toml", "flowtrain", "pipelines", "connectors"} <= set(copied)
    missing = [p for p in copied if not (ROOT / p).exists()]
    assert not missing, f"docker/Dockerfile copies paths the repository lacks: {missing}"


def test_compose_publishes_ports_on_loopback_only():
    services = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())["services"]
    assert {"kafka", "jobmanager", "taskmanager", "jobserver", "flowtrain"} <= set(services)
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports), ports
