"""Issue 45 item 11, the small ones a user hit next: the report's text reads as plain text (``arr_delay > 15``, not
``&gt;``) while the data still cannot make HTML; ``--device cuda`` without CUDA stops before the ETL."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest
import torch

import flowtrain
from flowtrain.train.report import md_text

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("text, shown", [
    ("arr_delay > 15 minutes (delayed)", "arr_delay > 15 minutes (delayed)"),  # was arr_delay &gt; 15
    ("AT&T & co", "AT&T & co"),  # was AT&amp;T &amp; co
    ("a < b", "a < b"),
    ("<img src=x onerror=alert(1)>", "&lt;img src=x onerror=alert(1)>"),  # a tag: never HTML
    ("</b>", "&lt;/b>"), ("<!-- x -->", "&lt;!-- x -->"),
    ("&amp; and &#60;", "&amp;amp; and &amp;#60;"),  # an entity: shown as written, not decoded
    ("> quoted", "\\> quoted"),  # a leading > is no block quote
    ("[x](javascript:1)", "[x]\\(javascript:1)"),
])
def test_report_text_reads_as_plain_text_and_makes_no_markup(text, shown):
    assert md_text(text) == shown


def test_report_title_and_target_show_greater_than_as_is(tmp_path):
    from flowtrain.train.report import _html, _markdown

    blocks = [("h1", "flowtrain run: x > 0 & y"), ("p", "Target: arr_delay > 15 minutes (delayed).")]
    md = _markdown(blocks)
    assert "# flowtrain run: x > 0 & y" in md and "Target: arr_delay > 15 minutes" in md and "&gt;" not in md
    page = _html(blocks, tmp_path)
    assert "<title>flowtrain run: x &gt; 0 &amp; y</title>" in page  # HTML's own escaping, shown as > and &


def test_device_cuda_without_cuda_stops_before_the_etl(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    pacsv.write_csv(pa.table({"x": [float(i) for i in range(40)], "y": [i % 2 for i in range(40)]}),
                    tmp_path / "t.csv")
    with pytest.raises(flowtrain.FlowtrainError, match="--device cuda: no CUDA device"):
        flowtrain.batch(input=[str(tmp_path / "t.csv")], label="y", numeric=["x"], device="cuda",
                        out=str(tmp_path / "run"))
    assert not (tmp_path / "run" / "dataset").exists()  # no ETL ran
