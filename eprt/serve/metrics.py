"""``/metrics`` of ``eprt serve`` through prometheus_client, in its own registry per server.

Two sources: the server's own metrics (HTTP requests by route and status, end-to-end
latency and time to first token of generation requests, requests in flight), and
``engine.stats()``, read fresh on every scrape by a collector.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as CONTENT_TYPE  # noqa: F401 (for /metrics)

from eprt.engine.expert_load import imbalance

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
disable_created_metrics()  # no *_created samples: they only repeat the start time

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# engine.stats() key -> (metric name, type, help); counters are named without _total here
ENGINE_METRICS = {
    "running": ("eprt_requests_running", "gauge", "Sequences being generated now"),
    "waiting": ("eprt_requests_waiting", "gauge", "Requests queued for a free slot or KV blocks"),
    "free_blocks": ("eprt_kv_blocks_free", "gauge", "KV cache blocks not held by any sequence"),
    "cached_blocks": ("eprt_kv_blocks_cached", "gauge", "KV cache blocks held by the prefix cache"),
    "total_blocks": ("eprt_kv_blocks_capacity", "gauge", "KV cache blocks in all"),
    "prompt_tokens": ("eprt_prompt_tokens", "counter", "Prompt tokens received"),
    "cached_tokens": ("eprt_prompt_cached_tokens", "counter", "Prompt tokens served from the prefix cache"),
    "generation_tokens": ("eprt_generation_tokens", "counter", "Tokens generated"),
    "requests_finished": ("eprt_requests_finished", "counter", "Requests the engine finished"),
    "ticks": ("eprt_scheduler_ticks", "counter", "Scheduler steps run"),
    "decode_steps": ("eprt_decode_steps", "counter", "Batched decode steps run"),
    "decode_rows": (
        "eprt_decode_rows",
        "counter",
        "Sequence rows over all decode steps (rows / steps is the mean decode batch)",
    ),
    "preemptions": ("eprt_preemptions", "counter", "Sequences preempted when KV blocks ran out"),
    "spec_proposed_tokens": ("eprt_spec_draft_tokens", "counter", "Speculative draft tokens proposed"),
    "spec_accepted_tokens": ("eprt_spec_accepted_tokens", "counter", "Speculative draft tokens accepted"),
    "spec_verify_steps": ("eprt_spec_verify_steps", "counter", "Verify steps run (speculative decoding)"),
    "spec_mean_accepted_length": (
        "eprt_spec_mean_accepted_length",
        "gauge",
        "Tokens emitted per sequence row with drafts in a verify step (accepted drafts + 1)",
    ),
    "moe_layers": (
        "eprt_moe_exchange_layers",
        "counter",
        "MoE layers rank 0 ran, each one exchange between the ranks (the per-layer figures divide by it)",
    ),
    "moe_sent_bytes": ("eprt_moe_exchange_sent_bytes", "counter", "MoE exchange bytes rank 0 sent to other ranks"),
    "moe_recv_bytes": (
        "eprt_moe_exchange_received_bytes",
        "counter",
        "MoE exchange bytes rank 0 received from other ranks",
    ),
    "moe_exchange_seconds": (
        "eprt_moe_exchange_seconds",
        "counter",
        "Seconds rank 0 spent inside the MoE exchange's collectives",
    ),
    "prompt_tokens_computed": (
        "eprt_prompt_tokens_computed",
        "counter",
        "Prompt tokens prefilled (not served from the prefix cache)",
    ),
}


class EngineCollector:
    """Reads ``engine.stats()`` at every scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for key, (name, kind, help_text) in ENGINE_METRICS.items():
            if key in stats:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, help_text, value=stats[key])
        if "moe_exchange" in stats:
            info = GaugeMetricFamily("eprt_moe_exchange_info", "The MoE exchange this job runs", labels=["exchange"])
            info.add_metric([stats["moe_exchange"]], 1)
            yield info
        if stats.get("total_blocks"):
            used = 1.0 - stats.get("free_blocks", 0) / stats["total_blocks"]
            yield GaugeMetricFamily("eprt_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", value=used)
        if hasattr(self.engine, "expert_load"):
            yield from expert_families(self.engine.expert_load())
        figures = getattr(self.engine, "eplb_figures", lambda: None)()
        if figures is not None:
            yield from eplb_families(figures)


def eplb_families(figures: dict):
    """Each MoE layer's rank imbalance without EPLB (contiguous) and with the current placement."""
    ratio = GaugeMetricFamily(
        "eprt_eplb_rank_imbalance",
        "(max - mean) / mean tokens per rank since the current placement took effect",
        labels=["layer", "placement"],
    )
    for placement in ("contiguous", "eplb"):
        for layer, r in zip(figures["layers"], figures[placement]):
            ratio.add_metric([str(layer), placement], float(r))
    yield ratio
    yield GaugeMetricFamily("eprt_eplb_epoch", "Expert placements switched to while serving", value=figures["epoch"])


def expert_families(counts: np.ndarray):
    """Tokens routed per (layer, expert) and each MoE layer's max/mean imbalance."""
    tokens = CounterMetricFamily("eprt_expert_tokens", "Tokens routed to an expert", labels=["layer", "expert"])
    ratio = GaugeMetricFamily("eprt_expert_imbalance_ratio", "Max over mean tokens per expert", labels=["layer"])
    for layer, (row, r) in enumerate(zip(counts, imbalance(counts))):
        if row.any():
            for expert, n in enumerate(row):
                tokens.add_metric([str(layer), str(expert)], float(n))
            ratio.add_metric([str(layer)], float(r))
    yield tokens
    yield ratio


class ServerMetrics:
    """The server's metrics and the engine's, in one registry; thread-safe."""

    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            "eprt_http_requests",
            "HTTP requests answered, by route and status",
            ("route", "status"),
            registry=self.registry,
        )
        self._in_flight = Gauge(
            "eprt_http_requests_in_flight", "HTTP requests being handled now", registry=self.registry
        )
        self._latency = Histogram(
            "eprt_request_latency_seconds",
            "End-to-end time of generation requests",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            "eprt_time_to_first_token_seconds",
            "Time from submission to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine))

    def request_started(self) -> None:
        self._in_flight.inc()

    def request_finished(
        self, route: str, status: int, latency_s: float | None = None, ttft_s: float | None = None
    ) -> None:
        """Count one answered request; latency and TTFT only for generation requests."""
        self._in_flight.dec()
        self._requests.labels(route, str(status)).inc()
        if latency_s is not None:
            self._latency.observe(latency_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
