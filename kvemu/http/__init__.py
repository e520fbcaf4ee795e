"""The OpenAI-compatible HTTP layer: routes, request validation, SSE streaming, tokenizer, Prometheus metrics.

Imported only by processes that serve HTTP (its dependencies, uvicorn, tokenizers and prometheus_client,
cost startup time elsewhere).
"""

DEFAULT_MODEL = "kvemu"
"""The model name served when none is given (``--model``)."""
