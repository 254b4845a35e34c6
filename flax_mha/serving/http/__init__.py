"""An OpenAI-compatible HTTP server on `flax_mha.serving.Server` (the `http` extra: FastAPI,
uvicorn, jinja2, prometheus-client; nothing on the library's import path loads them).

  python -m flax_mha.serving.http --checkpoint DIR --port 8000

Layered bottom to top:

  text      ids to text as they stream; stop strings across token boundaries (pure Python)
  chat      a checkpoint's chat template, rendered as transformers renders it; its tokenizer
  protocol  the OpenAI request bodies (typed, strict), response bodies and chunks, errors
  engine    the one Server's thread and the event loop's requests on it
  metrics   Prometheus counters and the Server's state
  app       the FastAPI routes
  cli       the command line (`experiments.serve` serves a model trained here with it)
  launch    a server as a subprocess (tests, benchmarks, notebooks)
"""
