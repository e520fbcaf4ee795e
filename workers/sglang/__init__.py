"""The SGLang flavour: its engine core (``engine.py``: ``SglangEngineCore``) and radix cache of pages
(``radix.py``).

What every flavour shares sits one level up (``workers/engine_base.py``, ``blocks.py``, ``sequence.py``, ...).
"""
