"""Prometheus metrics with vLLM's names (`vllm:` prefix, `model_name` + `engine` labels).
One registry per engine object: no process-global state.

Every `vllm:*` family here is one real vLLM 0.24.0 and 0.29.0 engines export (recorded from
real VE and PD engines in tests/real_engines/recorded/, held by
tests/unit/test_engine_metric_names.py); what the sim counts that vLLM does not export is
`epd_sim:*`, which only tests read (docs/observability.md "Engine metrics the kit reads")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SimMetrics:
    def __init__(self, model_name: str, engine_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": engine_id}
        names = list(labels)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*names, "finished_reason"],
            registry=r,
        )
        self._labels = labels
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens produced.")
        # vLLM counts prefix-cache queries and hits in tokens (v1/metrics/loggers.py)
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        # the sim's own counts (vLLM exports none of them): tests read them, the kit's
        # dashboard, alerts and advisor never do
        self.ec_queries = counter("epd_sim:encoder_cache_queries", "VE encoder-cache lookups.")
        self.ec_hits = counter("epd_sim:encoder_cache_hits", "VE encoder-cache hits (no encode).")
        self.ec_loads = counter("epd_sim:ec_loads", "PD embedding reads from a VE.")
        self.ec_load_failures = counter("epd_sim:ec_load_failures", "PD ECLoadFailure events.")
        self._faults = Counter(
            "epd_sim:injected_faults",
            "Faults injected by the simulator.",
            [*names, "kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        # vLLM: from arrival to the scheduler first running the request (its WAITING time)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent in the WAITING phase for request.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def fault(self, kind: str) -> None:
        self._faults.labels(**self._labels, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
