"""The oracle: vLLM 0.34.0's real scheduler, run on the CPU in its own venv, for differential tests of kvemu's vLLM flavour
(issue #47). ``env`` builds the venv, ``vllm_driver`` runs in it, ``conftest`` gives the tests its python."""
