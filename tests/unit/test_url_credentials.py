"""Issue 44 item 8: credentials in a URL are never printed, logged or written. ``--input
'az://alice:S3cretPW@acct/c/x.csv'`` printed the password in the error and wrote it into run.json; a registry URL
with ``user:pass@`` was printed in the client's warnings and in "waiting for schema registry";
``connectors.secrets.redact`` left ``az://user:pass@...`` and ``s3://KEY:SECRET@...`` unchanged."""
from __future__ import annotations

import base64
import json
import logging
import socket

import pytest

from tests.hostile_registry import HostileRegistry

SECRETS = ("S3cretPW", "wJalr/XUtnFEMI+K7MDENG", "SIGSECRET", "regpass", "AKIAKEYID")


def _clean(text: str) -> bool:
    return not any(s in text for s in SECRETS)


@pytest.mark.parametrize("url,shown", [
    ("az://alice:S3cretPW@acct/c/x.csv", "az://<redacted>@acct/c/x.csv"),
    ("s3://AKIAKEYID:wJalr/XUtnFEMI+K7MDENG@bucket/k.csv", "s3://<redacted>@bucket/k.csv"),
    ("s3://AKIAKEYID@bucket/k.csv", "s3://<redacted>@bucket/k.csv"),
    ("https://acct.blob.core.windows.net/c/x.csv?sv=2022-11-02&sp=r&sig=SIGSECRET%3D&se=2030",
     "https://acct.blob.core.windows.net/c/x.csv?sv=2022-11-02&sp=r&sig=<redacted>&se=2030"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAKEYID%2F2024&X-Amz-Signature=SIGSECRET&x=1",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=<redacted>&X-Amz-Signature=<redacted>&x=1"),
    ("http://reg:regpass@127.0.0.1:8081/apis/ccompat/v7", "http://<redacted>@127.0.0.1:8081/apis/ccompat/v7"),
    # no credentials: unchanged
    ("s3://bucket/runs/a@2.csv", "s3://bucket/runs/a@2.csv"), ("gs://b/x.csv?generation=3", "gs://b/x.csv?generation=3"),
    ("write to me@example.org", "write to me@example.org"),
])
def test_item8_redact_strips_userinfo_and_secret_query_parameters(url, shown):
    from connectors.secrets import redact, redact_url

    assert redact_url(url) == shown
    assert redact({"input": [url], "note": f"--input {url}: failed"}) == {"input": [shown],
                                                                        "note": f"--input {shown}: failed"}
    assert redact(["--input", url]) == ["--input", shown]


def test_item8_a_url_with_credentials_is_not_in_the_error_or_in_run_json(tmp_path, capsys):
    from flowtrain.cli.main import main

    out = tmp_path / "run"
    url = "az://alice:S3cretPW@acct/c/x.csv?sv=1&sig=SIGSECRET"
    assert main(["batch", "--input", url, "--label", "y", "--numeric", "a", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "az://<redacted>@acct/c/x.csv" in err and _clean(err), err
    text = (out / "run.json").read_text()
    marker = json.loads(text)
    assert marker["status"] == "failed" and marker["options"]["input"] == ["az://<redacted>@acct/c/x.csv?sv=1&sig="
                                                                           "<redacted>"]
    assert _clean(text), text
    for name in ("config.json", "job.json"):
        if (out / name).exists():
            assert _clean((out / name).read_text()), name


def test_item8_a_registry_url_with_credentials_authenticates_and_is_never_shown(caplog):
    """The client sends ``user:password@`` as HTTP basic authentication and names the URL without it: in dead
    letters, in its warnings while the registry does not answer, and in the jobs' "waiting for" lines."""
    from pipelines.stream.formats import SchemaRegistry, wait_for_registry

    with HostileRegistry({}) as reg:
        url = reg.url.replace("http://", "http://reg:regpass@")
        client = SchemaRegistry(url)
        assert client.url == reg.url and client.schema(7) is None
        assert reg.auth == ["Basic " + base64.b64encode(b"reg:regpass").decode()]
        assert wait_for_registry(url, what="stream score", say=print)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: every connection refused
    down = f"http://reg:regpass@127.0.0.1:{port}/apis/ccompat/v7"
    lines, waits = [], []
    caplog.set_level(logging.WARNING)
    with pytest.raises(Exception) as err:
        SchemaRegistry(down, wait_s=0.3, on_wait=waits.append).schema(1)
    stopped = iter([False, True])
    assert not wait_for_registry(down, what="stream pipeline", say=lines.append, should_stop=lambda: next(stopped, True))
    shown = [str(err.value), *map(str, waits), *lines, caplog.text]
    assert all(_clean(text) for text in shown), shown
    assert lines[0].startswith(f"stream pipeline: waiting for schema registry http://127.0.0.1:{port}/apis/ccompat/v7")
    with pytest.raises(ValueError) as bad:
        SchemaRegistry("ftp://reg:regpass@h/x")
    assert _clean(str(bad.value)) and "ftp://<redacted>@h/x" in str(bad.value)


def test_item8_every_log_record_is_redacted_once_the_command_line_runs(caplog):
    from connectors.secrets import redact_logs

    redact_logs()
    redact_logs()  # once is enough: no second wrapper
    caplog.set_level(logging.INFO)
    logging.getLogger("fsspec.example").warning("opening %s failed", "az://alice:S3cretPW@acct/c/x.csv")
    assert "opening az://<redacted>@acct/c/x.csv failed" in caplog.text and _clean(caplog.text)
