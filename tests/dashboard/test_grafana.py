"""The Grafana dashboard (deploy/grafana/kvsp.json) asks only for what /metrics exports: every
metric an expression names has samples in a scrape of a cluster that did everything the
dashboard charts, and every label it selects, groups by or shows in a legend is one of theirs."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest

from common.metrics import tally
from tests.dashboard.conftest import checkpoint_document
from tests.dashboard.test_metrics import scrape
from workers import metrics as node_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvsp.json"

_SELECTOR = re.compile(r"\b(kvsp_[a-z0-9_]+)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(?:=~|!=|!~|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def targets() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


@pytest.fixture
def exported(client, scene, django_capture_on_commit_callbacks) -> dict[str, list[dict]]:
    """Per sample name, the label sets a scrape exports, once the scene has also recomputed a
    placement, reported a session's timeline, and a node counted its directive blocks and
    evictions (the node tests drive those through real nodes: tests/node)."""
    cluster = scene.cluster
    assert cluster.place(tokens=list(range(9_000, 9_040)), request_ref="cold").status_code == 200
    session = str(uuid.uuid4())
    document = checkpoint_document(cluster, session, offset=1, generated=[7])
    timings = {"queued": 10, "keys": 10, "directive": 10, "prompt": 10, "first_token": 10}
    with django_capture_on_commit_callbacks(execute=True):
        path = f"/kvsp/sessions/{session}/checkpoint"
        assert scene.ii1.put(path, document | {"timings_us": timings}).status_code == 201
    node_metrics.count_directive_blocks("ii1", {"host": 3}, {"not_found": 1})
    node_metrics.count_evictions("ii1", [("capacity", 4096)])
    node_metrics.count_tier_move("ii1", "host", "disk", 4096)
    tally.write()
    found: dict[str, list[dict]] = {}
    for (name, labels), _ in scrape(client).items():
        found.setdefault(name, []).append(dict(labels))
    return found


@pytest.mark.django_db
def test_every_expression_names_metrics_and_labels_that_metrics_exports(exported):
    assert targets(), "the dashboard has queries"
    for title, expr, legend in targets():
        selectors = _SELECTOR.findall(expr)
        assert selectors, f"{title}: {expr} names no kvsp metric"
        labels_of_expr = set()
        for metric, matchers in selectors:
            assert metric in exported, f"{title}: /metrics exports no {metric}"
            label_sets = exported[metric]
            labels = {label for label_set in label_sets for label in label_set}
            labels_of_expr |= labels
            for label, value in _MATCHER.findall(matchers):
                assert label in labels, f"{title}: {metric} has no label {label}"
                values = {label_set.get(label) for label_set in label_sets}
                assert value in values, f"{title}: {metric} never has {label}={value!r}"
        named = {
            label.strip()
            for group in _GROUPING.findall(expr)
            for label in group.split(",")
            if label.strip()
        }
        named |= set(_LEGEND.findall(legend))
        missing = named - labels_of_expr
        assert not missing, f"{title}: no metric of {expr!r} has the labels {missing}"
