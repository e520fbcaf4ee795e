"""The oracles: vLLM 0.34.0's and SGLang 0.5.23's real schedulers, each run on the CPU in its own venv, for
differential tests of kvemu's flavours (issue #47). ``env`` builds the venvs (``--sglang`` for SGLang's),
``vllm_driver`` and ``sglang_driver`` run in them (sharing ``driver_common``), ``conftest`` gives the tests their
pythons."""
