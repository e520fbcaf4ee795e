"""Wire formats: vLLM's KV-event batches over ZeroMQ."""
