"""The HTML report of ``flowtrain drift``: one self-contained page (inline SVG, nothing fetched), features
ranked by drift, each with its measures (an alarm in red) and its reference and current histograms side by
side, then the data-quality findings. Every text from the data (column and category names) is escaped."""
from __future__ import annotations

import html
import math

_STYLE = """body{font-family:system-ui,sans-serif;margin:18px;color:#222;background:#f6f7f9}
h1{font-size:20px}h2{font-size:15px;margin:0 0 6px}section{background:#fff;border:1px solid #dde;border-radius:6px;
padding:10px 12px;margin:10px 0}section.alarm{border-color:#b33}.alarm-text{color:#b33;font-weight:600}
table{border-collapse:collapse;font-size:12px}td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:left}
.muted{color:#667;font-size:12px}.legend span{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}"""
REF_COLOR, CUR_COLOR = "#7a8ca6", "#e08a2c"


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if not math.isfinite(value) else f"{value:.4g}"
    return html.escape(str(value))


def histogram_svg(buckets: list[str], reference: list[float], current: list[float], *, width: int = 520,
                  height: int = 150) -> str:
    """Grouped bars: each bucket's share in the reference and in the current data."""
    n = max(1, len(buckets))
    top = max([*reference, *current, 1e-9])
    slot = width / n
    bar = max(1.0, slot * 0.38)
    parts = [f'<svg width="{width}" height="{height + 40}" role="img" aria-label="histograms">']
    for i, name in enumerate(buckets):
        x = i * slot + slot * 0.1
        for j, (shares, color) in enumerate(((reference, REF_COLOR), (current, CUR_COLOR))):
            share = shares[i] if i < len(shares) else 0.0
            h = height * share / top
            parts.append(f'<rect x="{x + j * bar:.1f}" y="{height - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{color}"><title>{html.escape(str(name))}: {share:.1%}</title></rect>')
        label = html.escape(str(name)[:14])
        parts.append(f'<text x="{x:.1f}" y="{height + 12}" font-size="9" transform="rotate(25 {x:.1f} '
                     f'{height + 12})">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_report(report: dict, *, title: str = "drift") -> str:
    """The report (``pipelines.drift.profile.compare``'s, with ``model``/``inputs``) as one HTML page."""
    alarms = report.get("alarms") or []
    head = (f"<h1>{html.escape(title)}</h1><p>{report.get('rows', 0):,} rows compared with the training data of "
            f"{html.escape(str(report.get('model_version') or report.get('model') or ''))}. "
            + (f'<span class="alarm-text" id="alarms">alarms: {html.escape(", ".join(alarms))}</span>' if alarms
               else '<span id="alarms">no measure over its threshold</span>')
            + "</p>"
            + '<p class="muted legend"><span style="background:' + REF_COLOR + '"></span>reference (training; '
            + 'scores: validation split)<span style="background:' + CUR_COLOR + '"></span>current</p>'
            + "<p class=muted>thresholds: " + ", ".join(f"{html.escape(k)}={v:g}"
                                                        for k, v in (report.get("thresholds") or {}).items())
            + f"; fewer than {report.get('min_rows', 0)} rows are never an alarm</p>")
    quality = report.get("quality") or []
    q_html = ""
    if quality:
        rows = "".join(f"<tr><td>{html.escape(q['feature'])}</td><td>{html.escape(q['issue'])}</td>"
                       f"<td>{q['rows']:,}</td><td>{html.escape(q['detail'])}</td></tr>" for q in quality)
        q_html = (f'<section id="quality"><h2>data quality</h2><table><tr><th>feature</th><th>issue</th>'
                  f"<th>rows</th><th>detail</th></tr>{rows}</table></section>")
    sections = []
    for e in report.get("features") or []:
        measures = "".join(
            f'<tr><td>{html.escape(m)}</td><td class="{"alarm-text" if m in e["alarms"] else ""}">{_fmt(v)}</td></tr>'
            for m, v in e["measures"].items())
        extra = "constant" if "constant" in e["alarms"] else ""
        chart = histogram_svg(e["buckets"], e["reference"], e["current"]) if e.get("buckets") else ""
        sections.append(
            f'<section class="{"alarm" if e["alarm"] else ""}" data-feature="{html.escape(e["feature"])}" '
            f'data-alarm="{1 if e["alarm"] else 0}"><h2>{html.escape(e["feature"])} <span class="muted">'
            f'{html.escape(e["kind"])}, {e["rows"]:,} rows</span> '
            + (f'<span class="alarm-text">ALARM: {html.escape(", ".join(e["alarms"]))}</span>' if e["alarm"] else "")
            + f'</h2><div style="display:flex;gap:18px;flex-wrap:wrap"><table>{measures}</table>{chart}</div>'
            + (f"<p class=alarm-text>{extra}</p>" if extra else "") + "</section>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>{head}{q_html}{''.join(sections)}</body></html>\n")
