"""The /metrics collector reads the runner's counters, the cost model's corrections included."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from encgraph.serving.metrics import _StatsCollector  # noqa: E402


def front_stats(corrections: dict[str, int]) -> dict:
    runner = {
        "graph_items": 5, "eager_items": 2, "eager_reasons": {"eager is cheaper": 2},
        "paths": {"default": {"replays": {64: 3}, "real_tokens": 100, "padded_tokens": 10, "padded_share": 0.09}},
        "cost_feedback": {"samples": 6, "explored": 1, "corrections": corrections, "scale": {}},
    }
    return {"queue_depth": 0, "calls": 4, "completed": 4, "failed": 0, "rejected": 0, "cancelled": 0,
            "requests_per_call": {1: 4}, "runner": runner}


def scrape(models: dict) -> str:
    registry = CollectorRegistry()
    registry.register(_StatsCollector(models))
    return generate_latest(registry).decode()


def test_cost_model_corrections_are_counted_per_model_and_kind():
    models = {"a": types.SimpleNamespace(front=types.SimpleNamespace(stats=front_stats({"graph": 2, "eager": 1}))),
              "b": types.SimpleNamespace(front=types.SimpleNamespace(stats=front_stats({})))}
    text = scrape(models)
    assert 'encgraph_cost_corrections_total{kind="graph",model="a"} 2.0' in text
    assert 'encgraph_cost_corrections_total{kind="eager",model="a"} 1.0' in text
    assert 'model="b"' in text and 'encgraph_cost_corrections_total{kind="graph",model="b"}' not in text


def test_a_runner_without_feedback_stats_still_scrapes():
    stats = front_stats({})
    del stats["runner"]["cost_feedback"]
    text = scrape({"a": types.SimpleNamespace(front=types.SimpleNamespace(stats=stats))})
    assert "encgraph_cost_corrections" in text and 'encgraph_runner_items_total{kind="graph",model="a"} 5.0' in text


def test_the_fronts_launches_are_counted_by_how_their_wait_ended():
    stats = {**front_stats({}), "waits_skipped": 7, "idle_launches": 5, "held_launches": 3}
    text = scrape({"a": types.SimpleNamespace(front=types.SimpleNamespace(stats=stats))})
    for kind, n in (("no_wait", 7), ("idle", 5), ("held", 3)):
        assert f'encgraph_front_launches_total{{kind="{kind}",model="a"}} {n}.0' in text
