"""Writes ``runs/*.json`` shaped like ``vllm bench serve --save-result`` output for docs/profiles.md's grid, so that
the page's conversion block runs here as written (the GPU measurements themselves cannot).

The figures are made up but shaped like a GPU's: TTFT grows with the prompt, ITL with the batch's KV and context.
"""

import json
import sys
from pathlib import Path


def write(name: str, ttft_ms: float, itl_ms: float, prompts: int) -> None:
    result = {"backend": "vllm", "model_id": "stand-in", "num_prompts": prompts, "completed": prompts,
              "mean_ttft_ms": ttft_ms * 1.02, "median_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms * 1.3,
              "mean_itl_ms": itl_ms * 1.05, "median_itl_ms": itl_ms, "p99_itl_ms": itl_ms * 1.8}
    (out / f"{name}.json").write_text(json.dumps(result))


out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs")
out.mkdir(parents=True, exist_ok=True)
for isl in (128, 256, 512, 1024, 2048, 4096, 8192):
    write(f"prefill-{isl}", 8.0 + isl * 0.06, 0.0, 20)
for active in (8192, 32768, 131072, 262144):
    for context in (512, 1024, 2048, 4096, 8192):
        batch = max(1, active // context)
        write(f"decode-{active}-{context}", 0.0, 6.0 + active * 2e-5 + context * 1e-4, batch)
