"""The tabular ETL's Beam metrics on Prism (Beam's portable local runner, a real job server) equal the
run's rows and dead letters, as on the FnApiRunner (tests/unit/test_etl_metrics.py)."""
from __future__ import annotations

import apache_beam as beam
import pytest

from tests.unit.test_etl_metrics import check_etl_metrics

pytestmark = [pytest.mark.streaming, pytest.mark.timeout(300)]


def test_beam_metrics_of_a_prism_run_equal_the_runs_rows_and_dead_letters(tmp_path):
    from apache_beam.options.pipeline_options import PipelineOptions

    from flowtrain.local.runners import LocalPrismRunner, ensure_prism

    options = PipelineOptions([f"--runner={LocalPrismRunner.__module__}.LocalPrismRunner",
                               f"--prism_location={ensure_prism()}", "--environment_type=LOOPBACK"])
    check_etl_metrics(tmp_path, beam.Pipeline(options=options))
