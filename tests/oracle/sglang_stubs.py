"""What SGLang 0.5.23 needs on a CPU-only machine with no model, for ``sglang_driver.py`` (the SGLang oracle venv).

Imported by the oracle venv's python only (never by kvemu's). Two parts:

* ``install_import_stubs()``, before anything imports sglang. SGLang imports ``triton`` unconditionally
  (``sglang/srt/utils/common.py``) and ``torchvision`` from two multimodal config modules; neither is installed
  (triton is a CUDA-named package, and torchvision from PyPI does not load beside torch 2.13.0+cpu). For triton
  this runs SGLang's own stub installer, ``sglang/_platform_stubs.py`` (meant for macOS on Apple silicon), loaded
  by path with its platform checks answered "darwin/arm64/MPS" for that one call and its MPS-only tensor patch
  left out. A stubbed triton kernel that is launched raises (``'function' object is not subscriptable``), so none
  can silently do nothing; with ``attention_backend="torch_native"`` none is reached. torchvision gets SGLang's
  ``_MockModule`` through a meta-path finder, after transformers has cached that torchvision is absent.
  ``SGLANG_USE_CPU_ENGINE`` stays unset, so nothing imports ``sgl_kernel``.
* ``install_model_free_runner()``, after that: SGLang's ``ModelRunner`` without weights, attention backends or
  CUDA graphs (``forward`` gives empty logits), and ``KVCacheConfigurator`` sizing the KV pool to exactly
  ``--max-total-tokens``, the way SGLang's simulator (tools/sglang-simulator) patches the same classes. The
  scheduler, batches, allocator and radix tree stay SGLang's own. ``sample`` returns ``NEXT_TOKENS``, which the
  driver sets before each batch runs: one token per request of the batch, in the batch's order.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import sysconfig
from typing import Any

NEXT_TOKENS: list[int] = []  # the fake model's samples for the batch about to run (set by the driver)
STUBBED_PACKAGES = ("torchvision",)
_installed = {"imports": False, "runner": False}


def install_import_stubs() -> None:
    if _installed["imports"]:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    import torch

    path = os.path.join(sysconfig.get_paths()["purelib"], "sglang", "_platform_stubs.py")
    spec = importlib.util.spec_from_file_location("_kvemu_sglang_platform_stubs", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"SGLang's stub module is missing: {path}")
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    saved = (sys.platform, platform.machine, torch.backends.mps.is_available)
    sys.platform, platform.machine = "darwin", (lambda: "arm64")  # type: ignore[misc]
    torch.backends.mps.is_available = lambda: True
    stubs._patch_non_blocking = lambda: None  # the MPS-only Tensor.to/copy_ patch: not wanted on the CPU
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available = saved  # type: ignore[misc]
    if "stub" not in repr(sys.modules.get("triton")):
        raise RuntimeError(f"SGLang's triton stub did not install: {sys.modules.get('triton')!r}")

    # transformers caches whether torchvision is importable: ask it now, before the stub makes it so.
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():
        raise RuntimeError("torchvision is installed in the oracle venv; it should not be")
    sys.meta_path.insert(0, _MockFinder(stubs._MockModule, STUBBED_PACKAGES))
    _installed["imports"] = True


class _MockFinder:
    """Serves SGLang's ``_MockModule`` for the listed packages and their submodules."""

    def __init__(self, mock: Any, roots: tuple[str, ...]) -> None:
        self.mock = mock
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not any(fullname == root or fullname.startswith(root + ".") for root in self.roots):
            return None
        if fullname not in sys.modules:
            module = self.mock(fullname)
            sys.modules[fullname] = module
            parent, _, child = fullname.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
        return sys.modules[fullname].__spec__


def install_model_free_runner() -> None:
    if _installed["runner"]:
        return
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    class NoWeights:
        preloaded_weights_bytes = 0

    class NoModel(torch.nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> None:
            return None

    def load_model(self: Any) -> None:
        self.model = NoModel()
        self.dtype = self.model_config.dtype
        self.sliding_window_size = model_runner.resolve_sliding_window_size(self.model, self.model_config)
        self.prefill_aware_swa = False
        self.weight_load_mem_usage = 0
        self.load_config = None
        self.loader = NoWeights()

    def forward(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        logits = LogitsProcessorOutput(next_token_logits=torch.zeros((forward_batch.batch_size, 1)))
        return model_runner.ModelRunnerOutput(logits_output=logits, can_run_graph=False,
                                              expert_distribution_metrics=None)

    def sample(self: Any, logits_output: Any, *args: Any, **kwargs: Any) -> Any:
        rows = logits_output.next_token_logits.shape[0]
        if rows != len(NEXT_TOKENS):
            raise RuntimeError(f"the batch has {rows} rows but the driver planned {len(NEXT_TOKENS)} samples")
        return torch.tensor(NEXT_TOKENS, dtype=torch.int64)

    def init_attention_backends(self: Any) -> None:
        self.prefill_attention_backend_str = self.server_args.attention_backend
        self.decode_attention_backend_str = self.server_args.attention_backend
        self.attn_backend = self.decode_attn_backend = self.decode_attn_backend_group = None

    def init_cuda_graphs(self: Any, capture_decode_cuda_graph: bool = True) -> None:
        self.graph_mem_usage = 0
        self.cuda_graph_runner = self.eager_runner = None
        self.prefill_cuda_graph_runner = self.decode_cuda_graph_runner = None

    def profile_available_bytes(self: Any, pre_model_load_memory: Any) -> int:
        """The fewest bytes whose pool holds ``max_total_tokens`` tokens (a bisection over the byte budget)."""
        configurator = create_memory_pool_configurator(self)
        want = self.server_args.max_total_tokens
        page = getattr(self, "page_size", None) or self.server_args.page_size or 1

        def pool_tokens(budget: int) -> int:
            try:
                return configurator.calculate_pool_sizes(budget, page).max_total_num_tokens
            except RuntimeError:
                return 0

        low, high = 0, 1
        while pool_tokens(high) < want:
            low, high = high, high * 2
        while low + 1 < high:
            middle = (low + high) // 2
            if pool_tokens(middle) < want:
                low = middle
            else:
                high = middle
        return high

    runner = model_runner.ModelRunner
    runner.load_model = load_model
    runner.forward = forward
    runner.sample = sample
    runner.compute_logprobs_only = lambda *args, **kwargs: None
    runner.init_attention_backends = init_attention_backends
    runner.init_cuda_graphs = init_cuda_graphs
    kv_cache_configurator.KVCacheConfigurator._profile_available_bytes = profile_available_bytes
    _installed["runner"] = True
