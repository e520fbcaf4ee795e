"""Wire formats: vLLM's KV-event batches over ZeroMQ (their records are `kvemu.kv_events`), socket bounds and security."""
