"""The vLLM flavour (also TRT-LLM's): its engine core (``engine.py``: ``VllmEngineCore``), scheduler, decode runs
and look-ahead (``fast_forward.py``), hybrid KV cache groups (``hybrid.py``) and host KV tier (``host_tier.py``).

What every flavour shares sits one level up (``workers/engine_base.py``, ``blocks.py``, ``sequence.py``, ...).
"""
