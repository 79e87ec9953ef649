"""Prometheus metrics of ``encgraph serve`` (``GET /metrics``), in a registry of the app's own.

HTTP-level counters (requests by status, images, latency) are kept by the app; the runner's and the front's
counters are read at scrape time from their ``stats`` (one source of truth, nothing counted twice):

- ``encgraph_requests_total{model,status}``, ``encgraph_images_total{model}``,
  ``encgraph_request_latency_seconds{model}`` (histogram);
- ``encgraph_request_stage_seconds{model,stage}`` (histogram, answered requests): where a request's time went,
  ``read`` (body and JSON), ``decode`` (base64 and image decoding), ``preprocess`` (the image processor and the
  copy to the device), ``encode`` (queued in the batching front, its call run, and the device's work for that
  call up to the request's embeddings on the host, as an answer thread sees it), ``answer`` (the JSON reply
  alone); each includes the wait for a worker thread and the hop back to the event loop, so a host-bound server
  shows its queue there. With preprocessing worker processes, ``decode`` is the worker's own decoding time and
  ``preprocess`` the rest of the round trip (the wait for a worker, the processor, the transfer, the copy to the
  device); docs/serving.md defines each stage's start and end;
- ``encgraph_runner_items_total{model,kind=graph|eager}``, ``encgraph_replays_total{model,path,budget}``,
  ``encgraph_eager_items_total{model,reason}``, ``encgraph_tokens_total{model,path,kind=real|padded}``,
  ``encgraph_padded_share{model,path}``, ``encgraph_cost_corrections_total{model,kind=graph|eager}`` (times the
  runner's cost model was rescaled from what it measured while serving: ``encgraph.capture.feedback``);
- ``encgraph_preprocess_pipe_results_total`` (with preprocessing worker processes): requests whose pixels came
  back through the pool's pipe rather than a shared-memory slot, being larger than one
  (:mod:`encgraph.serving.slots`);
- ``encgraph_device_preprocess_total{model,kind}`` (``--preprocess-on device``): the device half of
  preprocessing run per group of requests (:mod:`encgraph.serving.device_batch`): ``groups`` (processor calls),
  ``requests`` and ``images`` in them, ``retried_groups`` (calls that raised: their requests ran again alone) and
  ``alone`` (requests run alone: those, or every request of a processor that cannot batch);
- ``encgraph_preprocess_restarts_total`` (with preprocessing worker processes): times the server's one pool was
  restarted after a worker died;
- ``encgraph_queue_depth{model}``, ``encgraph_front_calls_total{model}``, ``encgraph_front_requests_total{model,
  outcome}`` (completed, failed, rejected, cancelled), ``encgraph_coalesced_requests_total{model}`` (requests
  that ran in a call of more than one request), ``encgraph_front_launches_total{model,kind}`` (calls by how their
  wait ended: ``no_wait``, ``idle`` of those the device being idle, ``held`` behind two calls on the device:
  :mod:`encgraph.serving.waiting`);
- ``encgraph_gc_collections_total{generation}``, ``encgraph_gc_pause_seconds_total{generation}``,
  ``encgraph_gc_longest_pause_seconds{generation}``: the server process's garbage collections and the pauses
  they cost every thread (:mod:`encgraph.serving.heap`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from encgraph.serving.heap import PAUSES

__all__ = ["Metrics", "LATENCY_BUCKETS", "STAGES"]

STAGES = ("read", "decode", "preprocess", "encode", "answer")
"""The stages of an answered request, in order (``encgraph_request_stage_seconds``)."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StatsCollector:
    """Reads every served model's ``front.stats`` (with the runner's counters inside) at scrape time."""

    def __init__(self, models: Mapping[str, Any], preprocess: Any = None, batchers: Mapping[str, Any] | None = None
                 ) -> None:
        self.models = models
        self.preprocess = preprocess
        self.batchers = dict(batchers or {})

    def describe(self) -> list[Any]:
        return []  # collected on demand only (the label sets depend on the traffic)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        items = CounterMetricFamily("encgraph_runner_items", "Items the runner encoded, by how", labels=["model", "kind"])
        replays = CounterMetricFamily("encgraph_replays", "Graph replays (static forwards on the CPU) per budget",
                                      labels=["model", "path", "budget"])
        eager = CounterMetricFamily("encgraph_eager_items", "Items run eagerly, by reason", labels=["model", "reason"])
        tokens = CounterMetricFamily("encgraph_tokens", "Budget units run: real and padding", labels=["model", "path", "kind"])
        padded = GaugeMetricFamily("encgraph_padded_share", "Padding share of the units replayed", labels=["model", "path"])
        depth = GaugeMetricFamily("encgraph_queue_depth", "Requests waiting for the batching front", labels=["model"])
        calls = CounterMetricFamily("encgraph_front_calls", "Calls of the runner by the batching front", labels=["model"])
        outcome = CounterMetricFamily("encgraph_front_requests", "Requests of the batching front, by outcome",
                                      labels=["model", "outcome"])
        coalesced = CounterMetricFamily("encgraph_coalesced_requests", "Requests that shared a runner call",
                                        labels=["model"])
        launches = CounterMetricFamily("encgraph_front_launches", "Calls of the batching front by how their wait "
                                       "ended: no wait, the device idle, held behind two calls on the device",
                                       labels=["model", "kind"])
        corrections = CounterMetricFamily("encgraph_cost_corrections", "Corrections of the runner's cost model "
                                          "from what it measured while serving, by part", labels=["model", "kind"])
        for name, model in self.models.items():
            stats = model.front.stats
            runner = stats.get("runner") or {}
            depth.add_metric([name], stats["queue_depth"])
            calls.add_metric([name], stats["calls"])
            for key in ("completed", "failed", "rejected", "cancelled"):
                outcome.add_metric([name, key], stats[key])
            coalesced.add_metric([name], sum(k * v for k, v in stats["requests_per_call"].items() if k > 1))
            for kind, key in (("no_wait", "waits_skipped"), ("idle", "idle_launches"), ("held", "held_launches")):
                if key in stats:
                    launches.add_metric([name, kind], stats[key])
            if not runner:
                continue
            items.add_metric([name, "graph"], runner["graph_items"])
            items.add_metric([name, "eager"], runner["eager_items"])
            for reason, n in runner["eager_reasons"].items():
                eager.add_metric([name, reason], n)
            for path, p in runner["paths"].items():
                for budget, n in p["replays"].items():
                    replays.add_metric([name, path, str(budget)], n)
                tokens.add_metric([name, path, "real"], p["real_tokens"])
                tokens.add_metric([name, path, "padded"], p["padded_tokens"])
                padded.add_metric([name, path], p["padded_share"])
            for kind, n in (runner.get("cost_feedback") or {}).get("corrections", {}).items():
                corrections.add_metric([name, kind], n)
        yield from (items, replays, eager, tokens, padded, depth, calls, outcome, coalesced, launches, corrections)
        yield from _gc_families()
        if self.batchers:
            device = CounterMetricFamily("encgraph_device_preprocess", "Device preprocessing per group of requests: "
                                         "groups, requests, images, retried_groups, alone", labels=["model", "kind"])
            for name, batcher in self.batchers.items():
                for kind, n in batcher.stats.items():
                    if kind != "largest_group":
                        device.add_metric([name, kind], n)
            yield device
        if self.preprocess is not None:
            yield CounterMetricFamily("encgraph_preprocess_restarts", "Restarts of the preprocessing pool after a "
                                      "worker process died", value=self.preprocess.restarts)
            yield CounterMetricFamily("encgraph_preprocess_pipe_results", "Preprocessed requests whose pixels came "
                                      "back through the pool's pipe, not a shared-memory slot (larger than a "
                                      "slot)", value=self.preprocess.stats["overflows"])


def _gc_families() -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    count = CounterMetricFamily("encgraph_gc_collections", "Garbage collections of the server process",
                                labels=["generation"])
    spent = CounterMetricFamily("encgraph_gc_pause_seconds", "Seconds the server process spent in garbage "
                                "collections (every thread waits)", labels=["generation"])
    longest = GaugeMetricFamily("encgraph_gc_longest_pause_seconds", "The longest garbage collection pause so far",
                                labels=["generation"])
    for g in range(3):
        count.add_metric([str(g)], PAUSES.collections[g])
        spent.add_metric([str(g)], PAUSES.seconds[g])
        longest.add_metric([str(g)], PAUSES.longest[g])
    yield from (count, spent, longest)


class Metrics:
    """The app's registry: HTTP counters it updates, and the served models' stats read at scrape time."""

    def __init__(self, models: Mapping[str, Any], *, preprocess: Any = None,
                 batchers: Mapping[str, Any] | None = None) -> None:
        """``preprocess``: the server's :class:`~encgraph.serving.preprocess.PreprocessPool`, if it has one;
        ``batchers``: model name -> its :class:`~encgraph.serving.device_batch.DeviceBatcher`, if any."""
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("encgraph_requests", "Embedding requests by model and HTTP status",
                                ["model", "status"], registry=self.registry)
        self.images = Counter("encgraph_images", "Images embedded", ["model"], registry=self.registry)
        self.latency = Histogram("encgraph_request_latency_seconds", "Embedding request latency (answered requests)",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.stages = Histogram("encgraph_request_stage_seconds", "Time of an answered request per stage",
                                ["model", "stage"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_StatsCollector(models, preprocess, batchers))
        PAUSES.install()

    def observe(self, model: str, status: int, *, images: int = 0, seconds: float | None = None,
                stages: Mapping[str, float] | None = None) -> None:
        """One finished request: its status; for an answered one its images, latency and ``stages`` (seconds
        per name of :data:`STAGES`)."""
        self.requests.labels(model, str(status)).inc()
        if images:
            self.images.labels(model).inc(images)
        if seconds is not None:
            self.latency.labels(model).observe(seconds)
        for stage, spent in (stages or {}).items():
            self.stages.labels(model, stage).observe(spent)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
