"""Prometheus metrics of one server, in their own registry (several servers, e.g. in
tests, never collide in the global one)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram("terarec_request_latency_seconds",
                                 "Request latency by route", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("terarec_requests", "Requests by route and status code",
                                ["route", "code"], registry=r)
        self.scored_rows = Counter("terarec_scored_rows", "Candidate rows scored", registry=r)
        self.cache_lookups = Counter("terarec_cache_lookups",
                                     "Unique keys looked up in the hot-key cache", registry=r)
        self.cache_hits = Counter("terarec_cache_hits", "Hot-key cache hits", registry=r)
        self.cache_hit_rate = Gauge("terarec_cache_hit_rate",
                                    "Cache hits / lookups since start", registry=r)
        self.cache_hit_rate.set_function(self.hit_rate)
        self.model_version = Gauge("terarec_model_version", "Version number being served",
                                   registry=r)
        self.delta_lag = Gauge("terarec_delta_lag_seconds",
                               "Seconds from a version's export to it being served "
                               "(last swap)", registry=r)
        self.version_age = Gauge("terarec_version_age_seconds",
                                 "Seconds since the served version was exported", registry=r)
        self._created = float("nan")
        self.version_age.set_function(lambda: time.time() - self._created)
        self.swaps = Counter("terarec_version_swaps", "Versions swapped in", registry=r)
        self.refused = Counter("terarec_versions_refused",
                               "Versions refused as corrupted, half-written or inconsistent",
                               registry=r)

        self._lookups = 0
        self._hits = 0

    def cache_counts(self, lookups: int, hits: int) -> None:
        self._lookups += lookups
        self._hits += hits
        self.cache_lookups.inc(lookups)
        self.cache_hits.inc(hits)

    def hit_rate(self) -> float:
        return self._hits / self._lookups if self._lookups else 0.0

    def served(self, version: int, created: float) -> None:
        self.model_version.set(version)
        self._created = created
        self.delta_lag.set(max(0.0, time.time() - created))
        self.swaps.inc()
