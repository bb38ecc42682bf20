"""What a streaming run shows: TensorBoard event files of `flowtrain stream train` against the
real broker (prequential metrics, model version, hparams)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from connectors.arrow import encode_batch
from connectors.dataset import read_manifest

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "flowtrain.cli"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def publish_features(bootstrap: str, topic: str, dataset: str, rows: int = 40) -> int:
    """The dataset's rows as feature messages on partition 0, as the stream pipeline writes them
    (each row with its source); returns the rows sent."""
    from kafka import KafkaProducer

    manifest = read_manifest(dataset)
    table = pa.concat_tables([pq.read_table(Path(dataset) / s["file"]) for split in ("train", "valid", "test")
                              for s in manifest["splits"][split]])
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for start in range(0, table.num_rows, rows):
        chunk = table.slice(start, rows).combine_chunks()
        chunk = chunk.append_column("src_partition", pa.array([0] * chunk.num_rows, pa.int32()))
        chunk = chunk.append_column("src_offset", pa.array(range(start, start + chunk.num_rows), pa.int64()))
        (batch,) = chunk.to_batches()
        producer.send(topic, value=encode_batch(batch), partition=0).get(timeout=30)
    producer.close()
    return table.num_rows


@pytest.fixture(scope="module")
def stream_train_run(bootstrap, shared_data, tmp_path_factory):
    from kafka.admin import KafkaAdminClient, NewTopic

    base = tmp_path_factory.mktemp("observe-stream")
    dataset, batch = shared_data.regression_run()
    topic = f"obs-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    admin.close()
    rows = publish_features(bootstrap, topic, dataset)
    out = base / "stream"
    t0 = time.time()
    proc = subprocess.run(CLI + ["stream", "train", "--bootstrap", bootstrap, "--features-topic", topic,
                                 "--updates-topic", f"{topic}-updates", "--dataset", dataset, "--out", str(out),
                                 "--init-weights", str(batch / "model.pt"), "--checkpoint-every", "5",
                                 "--checkpoint-seconds", "1000", "--idle-exit", "2"],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, rows, t0, time.time()


def test_stream_train_writes_prequential_metrics_and_versions_to_tensorboard(stream_train_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out, rows, t0, t1 = stream_train_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    preq = [r for r in records if r["kind"] == "prequential"]
    assert preq and all(t0 <= r["time"] <= t1 for r in records)
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("prequential/loss", "prequential/rmse", "prequential/mae", "prequential/version",
                "prequential/rows_trained"):
        assert tag in scalars, (tag, scalars)
    # one point per published version, at its step, equal to metrics.jsonl
    assert [(e.step, e.value) for e in acc.Scalars("prequential/version")] == [(r["step"], r["version"]) for r in preq]
    with_rows = [r for r in preq if "rmse" in r]
    assert [e.value for e in acc.Scalars("prequential/rmse")] == pytest.approx([r["rmse"] for r in with_rows])
    assert acc.Scalars("prequential/rows_trained")[-1].value == rows
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["checkpoint_every"].number_value == 5
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    assert "prequential/rmse" in {m.name.tag for m in experiment.experiment.metric_infos}


# --- `flowtrain stream --metrics-port`: /metrics scraped during a real run, the status page in Chromium -----------
BROWSER_PACKAGES = "chromium chromium-driver"


def _chrome():
    """Headless Chromium from Debian's packages, driven by Selenium; missing is a failure naming the packages."""
    import shutil

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.fail(f"the status page test needs a real browser: install Debian's {BROWSER_PACKAGES} "
                    f"(apt-get install -y {BROWSER_PACKAGES}; `make test` does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1500"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _scrape(url: str) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _wait(condition, deadline_s: float, what: str, proc=None, out: Path | None = None):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    logs = "".join((out / f).read_text()[-1500:] for f in ("pipeline.log", "trainer.log")
                   if out is not None and (out / f).exists())
    pytest.fail(f"timed out waiting for {what} (job exit {proc.poll() if proc else None}); {logs}")


@pytest.fixture(scope="module")
def flights_dataset(shared_data) -> str:
    return shared_data.flights(every=80)


@pytest.mark.streaming
@pytest.mark.timeout(600)
def test_stream_job_serves_prometheus_metrics_and_a_live_status_page_in_a_real_browser(bootstrap, new_topic,
                                                                                        flights_dataset, tmp_path):
    import signal

    from kafka import KafkaConsumer, TopicPartition

    from flowtrain.local.tools import free_port

    driver = _chrome()  # first: no browser, no run
    raw = new_topic(partitions=2, prefix="raw")
    out, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = subprocess.Popen(CLI + ["stream", "--bootstrap", bootstrap, "--raw-topic", raw,
                                   "--features-topic", f"{raw}-features", "--dead-letter-topic", f"{raw}-dead",
                                   "--updates-topic", f"{raw}-updates", "--group-id", f"{raw}-group",
                                   "--dataset", flights_dataset, "--out", str(out), "--batch-size", "50",
                                   "--checkpoint-every", "2", "--metrics-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                            start_new_session=True)
    try:
        _wait(lambda: _try(lambda: _scrape(url)), 120, "/metrics to answer", proc, out)
        driver.get(url)
        # events arrive while the page watches: 600 at 100/s, 5% of them malformed (dead letters)
        replay = subprocess.Popen(CLI + ["replay", "--bootstrap", bootstrap, "--topic", raw, "--limit", "600",
                                         "--rate", "100", "--malformed", "0.05", "--seed", "3"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        chart = driver.find_element("id", "chart-events")
        first = int(chart.get_attribute("data-points"))
        _wait(lambda: int(chart.get_attribute("data-points")) >= first + 3, 120, "the events/s chart to update")
        replay_out, _ = replay.communicate(timeout=120)
        assert replay.returncode == 0, replay_out[-2000:]

        # every event counted: rows + unlabelled + dead letters = events = 600, the trainer took every row,
        # a version is published, no lag on either partition, the reasons add up to the dead letters
        def caught_up():
            m = _scrape(url)
            events = m.get(("flowtrain_events_total", ()), 0)
            reasons = sum(v for (name, _), v in m.items() if name == "flowtrain_dead_letters_by_reason_total")
            ok = (events == 600 and m[("flowtrain_rows_total", ())] + m[("flowtrain_unlabelled_total", ())]
                  + m[("flowtrain_dead_letters_total", ())] == 600
                  and m.get(("flowtrain_rows_trained_total", ()), -1) == m[("flowtrain_rows_total", ())]
                  and m.get(("flowtrain_published_version", ()), 0) >= 1
                  and reasons == m[("flowtrain_dead_letters_total", ())]
                  and [m.get(("flowtrain_consumer_lag", (("partition", p),))) for p in ("0", "1")] == [0, 0])
            return m if ok else None

        metrics = _wait(caught_up, 300, "the job to take every event", proc, out)
        dead = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        on_topic = sum(dead.end_offsets([TopicPartition(f"{raw}-dead", p) for p in range(2)]).values())
        dead.close()
        assert metrics[("flowtrain_dead_letters_total", ())] == on_topic > 0
        assert metrics[("flowtrain_half_up", (("half", "pipeline"),))] == 1
        assert metrics[("flowtrain_half_up", (("half", "trainer"),))] == 1
        assert ("flowtrain_prequential", (("metric", "auc"),)) in metrics

        # the page shows the same numbers as /metrics (compared on the same snapshot)
        def same_snapshot():
            m = _scrape(url)
            number = m[("flowtrain_sample_number", ())]
            if driver.find_element("tag name", "body").get_attribute("data-sample") != str(int(number)):
                return None
            cells = driver.execute_script(
                "return [...document.querySelectorAll('[data-metric]')].map(e => "
                "[e.dataset.metric, e.dataset.labels, e.dataset.value, e.textContent])")
            if driver.find_element("tag name", "body").get_attribute("data-sample") != str(int(number)):
                return None  # the page moved on while it was read
            return m, cells

        m, cells = _wait(same_snapshot, 60, "the page and /metrics on one snapshot")
        seen = set()
        for name, labels, value, text in cells:
            key = (name, tuple(sorted(json.loads(labels).items())))
            assert float(value) == m[key], (name, labels, value, m.get(key))
            number = float(text.replace(",", ""))  # what a person reads: the same number, rounded for floats
            assert number == m[key] if m[key] == int(m[key]) else abs(number - m[key]) <= max(0.05, 1e-3 * m[key])
            seen.add(key)
        for key in [("flowtrain_events_total", ()), ("flowtrain_dead_letters_total", ()),
                    ("flowtrain_trainer_step", ()), ("flowtrain_published_version", ()),
                    ("flowtrain_consumer_lag", (("partition", "0"),)),
                    ("flowtrain_consumer_lag", (("partition", "1"),)), ("flowtrain_rows_trained_total", ())]:
            assert key in seen, key
        shown = driver.execute_script(
            "return document.querySelector('#cards [data-metric=\"flowtrain_events_total\"]').textContent")
        assert shown == "600"
        letters = driver.find_elements("css selector", "#dead-letters tbody tr")
        assert letters and letters[0].find_elements("tag name", "td")[1].text  # newest dead letters, with a reason
        assert driver.find_element("id", "state").text == "running"
        assert "published" in driver.find_element("id", "versions").text
        shot = tmp_path / "status-page.png"
        driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("FLOWTRAIN_UPDATE_DOCS") == "1":  # the screenshot in docs/observability.md, on request
            (ROOT / "docs" / "img" / "status-page.png").write_bytes(shot.read_bytes())
        os.killpg(proc.pid, signal.SIGINT)
        printed, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, printed[-3000:]
        assert f"metrics on {url}metrics" in printed
    finally:
        driver.quit()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _try(fn):
    try:
        return fn()
    except OSError:
        return None
