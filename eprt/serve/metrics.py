"""Prometheus text exposition (format 0.0.4) for ``eprt serve``'s ``/metrics``.

Two sources: the server's own counters (HTTP requests by route and status, end-to-end
latency and time to first token of generation requests, requests in flight), kept
here behind a lock, and ``engine.stats()`` read fresh on every scrape.
"""
from __future__ import annotations

import bisect
import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# engine.stats() key -> (metric name, type, help)
ENGINE_METRICS = {
    "running": ("eprt_requests_running", "gauge", "Sequences being generated now"),
    "waiting": ("eprt_requests_waiting", "gauge", "Requests queued for a free slot or KV blocks"),
    "free_blocks": ("eprt_kv_blocks_free", "gauge", "KV cache blocks not held by any sequence"),
    "cached_blocks": ("eprt_kv_blocks_cached", "gauge", "KV cache blocks held by the prefix cache"),
    "total_blocks": ("eprt_kv_blocks_capacity", "gauge", "KV cache blocks in all"),
    "prompt_tokens": ("eprt_prompt_tokens_total", "counter", "Prompt tokens received"),
    "cached_tokens": ("eprt_prompt_cached_tokens_total", "counter", "Prompt tokens served from the prefix cache"),
    "generation_tokens": ("eprt_generation_tokens_total", "counter", "Tokens generated"),
    "requests_finished": ("eprt_requests_finished_total", "counter", "Requests the engine finished"),
    "ticks": ("eprt_scheduler_ticks_total", "counter", "Scheduler steps run"),
    "decode_steps": ("eprt_decode_steps_total", "counter", "Batched decode steps run"),
    "decode_rows": ("eprt_decode_rows_total", "counter", "Sequence rows over all decode steps "
                    "(rows / steps is the mean decode batch)"),
    "preemptions": ("eprt_preemptions_total", "counter", "Sequences preempted when KV blocks ran out"),
    "prompt_tokens_computed": ("eprt_prompt_tokens_computed_total", "counter",
                               "Prompt tokens prefilled (not served from the prefix cache)"),
}


class Histogram:
    def __init__(self, buckets: tuple):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)   # last slot: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list:
        out, total = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {total}"]
        return out


def _header(name: str, kind: str, help_text: str) -> list:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class ServerMetrics:
    """Request counters of the HTTP server; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: Counter = Counter()      # (route, status code) -> count
        self._latency = Histogram(LATENCY_BUCKETS)
        self._ttft = Histogram(TTFT_BUCKETS)
        self._in_flight = 0

    def request_started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def request_finished(self, route: str, status: int, latency_s: float | None = None,
                         ttft_s: float | None = None) -> None:
        """Count one answered request; latency and TTFT only for generation requests."""
        with self._lock:
            self._in_flight -= 1
            self._requests[(route, status)] += 1
            if latency_s is not None:
                self._latency.observe(latency_s)
            if ttft_s is not None:
                self._ttft.observe(ttft_s)

    def render(self, stats: dict) -> str:
        with self._lock:
            lines = _header("eprt_http_requests_total", "counter", "HTTP requests answered, by route and status")
            for (route, status), n in sorted(self._requests.items()):
                lines.append(f'eprt_http_requests_total{{route="{route}",status="{status}"}} {n}')
            lines += _header("eprt_http_requests_in_flight", "gauge", "HTTP requests being handled now")
            lines.append(f"eprt_http_requests_in_flight {self._in_flight}")
            lines += _header("eprt_request_latency_seconds", "histogram",
                             "End-to-end time of generation requests")
            lines += self._latency.lines("eprt_request_latency_seconds")
            lines += _header("eprt_time_to_first_token_seconds", "histogram",
                             "Time from submission to the first generated token")
            lines += self._ttft.lines("eprt_time_to_first_token_seconds")
        for key, (name, kind, help_text) in ENGINE_METRICS.items():
            if key in stats:
                lines += _header(name, kind, help_text) + [f"{name} {stats[key]}"]
        if stats.get("total_blocks"):
            used = 1.0 - stats.get("free_blocks", 0) / stats["total_blocks"]
            lines += _header("eprt_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use")
            lines.append(f"eprt_kv_cache_usage_ratio {used:.6f}")
        return "\n".join(lines) + "\n"
