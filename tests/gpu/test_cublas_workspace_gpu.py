"""Whether captured graphs outlive the cuBLAS workspace they were captured with.

A cuBLAS (and cuBLASLt) matmul uses a workspace that torch caches per handle and stream. The runner warms every
budget up on its capture stream, so that stream's workspace is allocated in ordinary memory before the capture,
and every graph captured on the stream bakes that address in. Two things free it while the graphs still live:

- ``torch._C._cuda_clearCublasWorkspaces()``, which ``torch.compile(mode="reduce-overhead")`` runs before and
  after each of its warm-ups and recordings (``torch._inductor.cudagraph_trees.clear_cublass_cache``): any model
  in the process compiled that way, an LLM beside the vision tower say, frees it;
- on torch versions whose ``CUDAGraph::reset`` clears the capture stream's workspaces (pytorch issue 193402),
  destroying any graph captured on that stream: another runner's, when torch's stream pool hands both runners the
  same stream (it hands out 32 streams per priority round-robin), or a budget the runner drops.

A replay then writes the matmuls' scratch into memory the allocator has given to someone else (corrupting their
tensors, or its own output) or that the driver no longer maps (an illegal address). Measured on an H100 (torch 2.11)
before the runner captured on a stream of its own (encgraph/capture/streams.py): the global clear, then replays,
changed 196,607 sentinel elements; the shared-stream scenario passed. Each scenario runs in a
subprocess, since an illegal address poisons the CUDA context: the cache is emptied after the workspace goes, the
freed memory is filled with sentinel tensors, and the replays must equal the module's own forward per item while
every sentinel keeps its value. Shapes with few rows and a long reduction (where cuBLAS picks split-K kernels that
use the workspace), with and without bias (cuBLASLt and cuBLAS)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = textwrap.dedent(
    """
    import copy, gc, sys
    import torch
    import encgraph

    scenario = sys.argv[1]
    K = 16384

    def mlp(seed):
        torch.manual_seed(seed)
        with torch.device("cuda"):
            return torch.nn.Sequential(
                torch.nn.Linear(K, 512, bias=True), torch.nn.GELU(), torch.nn.Linear(512, K, bias=False),
                torch.nn.GELU(), torch.nn.Linear(K, 256, bias=False),
            ).to(torch.bfloat16).eval()

    def rel(a, b):
        a, b = a.float(), b.float()
        return float((a - b).norm() / b.norm().clamp_min(1e-6))

    if scenario == "shared-stream":  # what torch's stream pool does to the 33rd stream asked for
        shared = torch.cuda.Stream()
        torch.cuda.Stream = lambda *args, **kwargs: shared
    kept, other = mlp(0), mlp(1)
    reference = copy.deepcopy(kept)
    gen = torch.Generator(device="cuda").manual_seed(2)
    with torch.inference_mode():
        for module in (kept, other) if scenario == "shared-stream" else (kept,):
            encgraph.graphed(module, costs=False)  # greedy: every batch replays, none runs eagerly
            x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            module(x)  # learns the call's shape
            module(x)  # captures it
        assert encgraph.graphs(kept).stats["graph_items"] > 0, encgraph.graphs(kept).stats
        info = encgraph.graphs(kept).runner.capture_info
        assert info["capture_stream"] == "own", info
        torch.cuda.synchronize()
        if scenario == "global-clear":  # what torch.compile(mode="reduce-overhead") runs at each warm-up and record
            torch._C._cuda_clearCublasWorkspaces()
        else:  # the other runner's graphs go: on some torch versions their reset clears the stream's workspace
            encgraph.graphs(other).reset()
            gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = encgraph.graphs(kept).stats["graph_items"]
        sentinels = [torch.full((16 * 2**20,), 7.0, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
        worst = 0.0
        for n in (8, 3, 32, 13):
            x = torch.randn(n, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            got, want = kept(x), reference(x)
            for i in range(n):
                assert torch.isfinite(got[i]).all(), (n, i)
                worst = max(worst, rel(got[i], want[i]))
        torch.cuda.synchronize()
        touched = sum(int((s != 7.0).sum()) for s in sentinels)
        replayed = encgraph.graphs(kept).stats["graph_items"] - before
    print(f"RESULT worst={worst:.4g} touched={touched} replayed_items={replayed}")
    sys.exit(0 if worst < 5e-2 and touched == 0 and replayed == 56 else 1)
    """
)


@pytest.mark.parametrize("scenario", ["global-clear", "shared-stream"])
def test_replays_stay_right_after_the_capture_streams_cublas_workspace_is_freed(scenario):
    done = subprocess.run([sys.executable, "-c", SCRIPT, scenario], check=False, capture_output=True, text=True,
                          timeout=300)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"{scenario}: replays after the workspace was freed went wrong:\n{tail}"
    assert "RESULT" in done.stdout, tail
