"""The server's Prometheus metrics (`GET /metrics`, in Prometheus' text format), in a registry of
the app's own:

  flax_mha_http_requests_total{route,status}      answers, by route and status
  flax_mha_http_request_seconds{route}            time to the answer's end
  flax_mha_prompt_tokens_total, flax_mha_generation_tokens_total
  flax_mha_time_to_first_token_seconds            submission to the first piece of text
  flax_mha_time_per_output_token_seconds          after the first, per token (per request)
  flax_mha_requests_finished_total{reason}        answered to their end: "stop" or "length"
  flax_mha_requests_aborted_total                 cancelled when their client went away
  flax_mha_new_tokens_total                       tokens the loop made
  flax_mha_requests_waiting, flax_mha_requests_running, flax_mha_requests_active
  flax_mha_free_pages, flax_mha_cached_pages, flax_mha_pages
  flax_mha_prefix_cache_hit_tokens_total          prompt tokens taken from shared pages
  flax_mha_spec_decode_draft_tokens_total         speculative decoding's drafts proposed
  flax_mha_spec_decode_accepted_tokens_total      and kept (both 0 without --speculate)
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import core

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
  """The counters of one app over `engine` (its Server read at each scrape)."""

  def __init__(self, engine):
    self.engine = engine
    self.registry = prometheus_client.CollectorRegistry()
    r = dict(registry=self.registry)
    self.answers = prometheus_client.Counter("flax_mha_http_requests", "HTTP answers",
                                             ["route", "status"], **r)
    self.latency = prometheus_client.Histogram("flax_mha_http_request_seconds",
                                               "time to the answer's end", ["route"],
                                               buckets=LATENCY_BUCKETS, **r)
    self.prompt_tokens = prometheus_client.Counter("flax_mha_prompt_tokens",
                                                   "prompt tokens admitted", **r)
    self.generation_tokens = prometheus_client.Counter("flax_mha_generation_tokens",
                                                       "tokens generated", **r)
    self.first_token = prometheus_client.Histogram(
        "flax_mha_time_to_first_token_seconds", "submission to the first piece of text",
        buckets=LATENCY_BUCKETS, **r)
    self.per_token = prometheus_client.Histogram(
        "flax_mha_time_per_output_token_seconds", "after the first token, per token",
        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1), **r)
    self.finished = prometheus_client.Counter("flax_mha_requests_finished",
                                              "requests answered to their end, by reason",
                                              ["reason"], **r)
    self.registry.register(_ServerState(engine))
    engine.observers.append(self.observe)

  def answered(self, path: str, status: int, seconds: float) -> None:
    route = path if path in ROUTES else "other"
    self.answers.labels(route, str(status)).inc()
    self.latency.labels(route).observe(seconds)

  def observe(self, request, output, seconds: float, first) -> None:
    """A piece of `request`'s answer `seconds` after its submission; `first`: the (seconds,
    tokens) of its first piece, None when this is it."""
    if first is None:
      first = (seconds, output.tokens)
      self.first_token.observe(seconds)
      self.prompt_tokens.inc(len(request.prompt))
    if output.finish is not None:
      self.finished.labels(output.finish).inc()
      self.generation_tokens.inc(output.tokens)
      if output.tokens > first[1]:
        self.per_token.observe((seconds - first[0]) / (output.tokens - first[1]))

  def render(self) -> bytes:
    return prometheus_client.generate_latest(self.registry)


class _ServerState:
  """The Server's state at scrape time (`Server.snapshot`)."""

  def __init__(self, engine):
    self.engine = engine

  def collect(self):
    now = self.engine.server.snapshot()
    gauge = lambda name, doc, value: core.GaugeMetricFamily(name, doc, value=value)
    yield gauge("flax_mha_requests_waiting", "requests waiting for a row", now["waiting"])
    yield gauge("flax_mha_requests_running", "requests in a row", now["running"])
    yield gauge("flax_mha_requests_active", "HTTP requests being answered",
                self.engine.active)
    yield gauge("flax_mha_free_pages", "pages on the free stack", now["free_pages"])
    yield gauge("flax_mha_cached_pages", "pages held by prefix entries", now["cached_pages"])
    yield gauge("flax_mha_pages", "pages in the pool", self.engine.server.pool.num_pages)
    yield core.CounterMetricFamily("flax_mha_new_tokens",
                                   "tokens the loop made (aborted requests' included)",
                                   value=now["new_tokens"])
    yield core.CounterMetricFamily("flax_mha_requests_aborted",
                                   "requests cancelled when their client went away",
                                   value=self.engine.aborted)
    yield core.CounterMetricFamily("flax_mha_prefix_cache_hit_tokens",
                                   "prompt tokens taken from shared pages",
                                   value=now["shared_tokens"])
    yield core.CounterMetricFamily("flax_mha_spec_decode_draft_tokens",
                                   "speculative decoding's drafts proposed", value=now["drafted"])
    yield core.CounterMetricFamily("flax_mha_spec_decode_accepted_tokens",
                                   "speculative decoding's drafts kept", value=now["accepted"])
