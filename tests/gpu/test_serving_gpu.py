"""The batching front over captured CUDA graphs (GRAPH mode), at real geometry with fewer layers: 32 threads
submit fresh random requests at once, the worker coalesces them into replays, and every request's items equal
the adapter's static forward run eagerly (``RunMode.STATIC``) on that request alone AND the Hugging Face tower's
own forward on it; the static input buffers are NaN-poisoned after capture, so a replay that read a row it did
not write would show. A coalesced replay pads and batches differently from the request alone, so both
comparisons are at bf16 tolerance (an item's output depends on that item alone: design rule 13).

Towers: the Qwen2.5-VL-7B tower at depth 4 (full attention in layer 3), and SigLIP-so400m at 384 px, depth 4.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
from typing import Any

import numpy as np
import pytest
import torch

import encgraph
from encgraph.capture.records import RunMode
from encgraph.models import wrap
from encgraph.serving import BatchingFront

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HF_RTOL = 2e-2  # bf16: flash varlen / batched kernels vs the tower's own per-request forward
STATIC_RTOL = 2e-2  # bf16: another budget and other neighbours than the request alone
CLIENTS = 32
TIMEOUT = 300


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def poison(runner) -> None:
    """NaN in every floating static buffer: a replay must overwrite every row it reads."""
    for buffers in runner.buffers.values():
        for t in buffers.storage.values():
            if t.is_floating_point():
                t.fill_(float("nan"))


def qwen_tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                 out_hidden_size=3584, patch_size=14, window_size=112, spatial_merge_size=2,
                                 temporal_patch_size=2, fullatt_block_indexes=[3])
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.bfloat16).cuda().eval()


def siglip_tower():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=4, num_attention_heads=16,
                             patch_size=14, image_size=384)
    torch.manual_seed(0)
    return SiglipVisionModel._from_config(cfg, dtype=torch.bfloat16).cuda().eval()


def qwen_request(rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(rng.integers(1, 4))
    grid = np.stack([np.ones(n, int), rng.integers(2, 17, n) * 2, rng.integers(2, 17, n) * 2], axis=1)
    pixels = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 14 * 14, dtype=torch.bfloat16, device="cuda")
    return pixels, torch.from_numpy(grid).cuda()


def test_qwen_front_coalesces_replays_equal_per_request():
    hf = qwen_tower()
    adapter = wrap(copy.deepcopy(hf))
    runner = encgraph.EncoderGraphRunner(adapter, budgets=[64, 256, 1024, 2048])
    static = encgraph.EncoderGraphRunner(adapter, budgets=[64, 256, 1024, 2048], mode=RunMode.STATIC)
    rng = np.random.default_rng(0)
    requests = [qwen_request(rng) for _ in range(CLIENTS)]
    with BatchingFront(runner, capture=True, max_wait_ms=20) as front:
        poison(runner)
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            futures = list(ex.map(lambda r: front.submit(adapter.inputs(*r)), requests))
        results = [f.result(TIMEOUT) for f in futures]
        stats = front.stats
    assert max(stats["requests_per_call"]) > 1, stats  # 32 threads at once: some calls held several requests
    with torch.inference_mode():
        for (pixels, grid), items in zip(requests, results):
            alone = torch.cat([r["pooler_output"] for r in static(adapter.inputs(pixels, grid))])
            ref = hf(pixels, grid_thw=grid).pooler_output
            got = torch.cat([r["pooler_output"] for r in items])
            assert got.shape == ref.shape and torch.isfinite(got).all()
            assert rel(got, alone) < STATIC_RTOL and rel(got, ref) < HF_RTOL


def test_siglip_graphed_front_equal_per_request():
    hf = siglip_tower()
    fast = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8, 16, 32])
    static = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8, 16, 32], mode=RunMode.STATIC)
    gen = torch.Generator(device="cuda").manual_seed(0)
    requests = [torch.randn(int(n), 3, 384, 384, generator=gen, device="cuda", dtype=torch.bfloat16)
                for n in np.random.default_rng(1).integers(1, 5, CLIENTS)]
    with BatchingFront(fast, capture=True, max_wait_ms=20) as front:
        poison(encgraph.graphs(fast).runner)
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            futures = list(ex.map(lambda x: front.submit(pixel_values=x), requests))
        outs = [f.result(TIMEOUT) for f in futures]
        stats = front.stats
    assert max(stats["requests_per_call"]) > 1, stats
    with torch.inference_mode():
        for x, out in zip(requests, outs):
            ref, alone = hf(pixel_values=x), static(pixel_values=x)
            for field in ("last_hidden_state", "pooler_output"):
                got, want = getattr(out, field), getattr(ref, field)
                assert got.shape == want.shape and torch.isfinite(got).all()
                assert rel(got, want) < HF_RTOL and rel(got, getattr(alone, field)) < STATIC_RTOL, field


def pooled_by_clients(fast, prepare, requests) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """``CLIENTS`` threads, one request each: ``prepare(request)`` (the pixels on the GPU, on the thread's own
    stream; or ``(pixels, ready)``, their work still in flight, handed to ``submit_after``), then the front's
    answer, its host copy started by the worker right after the call; the NaN-poisoned pool under them. Returns
    per request ``(pixels, pooled host embedding)``, and the front's stats."""
    from encgraph.serving.transfer import to_host

    def client(request) -> tuple[torch.Tensor, torch.Tensor]:
        prepared = prepare(request)
        pixels, ready = prepared if isinstance(prepared, tuple) else (prepared, None)
        return pixels, front.submit_after(ready, pixel_values=pixels).result(TIMEOUT).wait()[0]

    finish = lambda out: to_host([out.pooler_output.float()])  # noqa: E731
    with BatchingFront(fast, capture=True, max_wait_ms=20, finish=finish) as front:
        poison(encgraph.graphs(fast).runner)
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            answers = list(ex.map(client, requests))
        return answers, front.stats


def test_side_stream_uploads_and_worker_host_copies_stay_exact():
    """What ``encgraph serve`` does on a GPU: 32 threads upload host pixels on their own side streams
    (``transfer.upload``) while the worker replays, and the worker starts each request's device-to-host copy
    right after its call (``finish`` + ``transfer.to_host``); every request's host embedding equals the
    per-request forward on the same pixels, and the upload is bit-identical to ``.to("cuda", bf16)``."""
    from encgraph.serving.transfer import upload

    hf = siglip_tower()
    fast = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8, 16, 32])
    static = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8, 16, 32], mode=RunMode.STATIC)
    gen = torch.Generator().manual_seed(2)
    host = [torch.randn(int(n), 3, 384, 384, generator=gen) for n in np.random.default_rng(3).integers(1, 5, CLIENTS)]

    answers, stats = pooled_by_clients(fast, lambda x: upload(x, "cuda", torch.bfloat16), host)
    assert max(stats["requests_per_call"]) > 1, stats
    with torch.inference_mode():
        for x, (pixels, got) in zip(host, answers):
            assert torch.equal(pixels, x.to("cuda", torch.bfloat16))
            assert got.device.type == "cpu" and got.is_pinned() and torch.isfinite(got).all()
            want = hf(pixel_values=pixels).pooler_output.float().cpu()
            alone = static(pixel_values=pixels).pooler_output.float().cpu()
            assert rel(got, want) < HF_RTOL and rel(got, alone) < STATIC_RTOL


def test_served_calls_copy_down_once_and_each_request_gets_its_own_rows():
    """``encgraph serve``'s model on a GPU (``loading.build_model``): 32 threads prepare (side-stream uploads) and
    submit requests of 1-4 images at once; each call's pooled rows go down in one copy into a reused pinned buffer
    (``PinnedBuffers``), and every request's embeddings are its own images', in order, equal to the tower's
    forward on that request alone. A lone request afterwards makes no new buffer: the free ones are reused."""
    from encgraph.serving import loading

    hf = siglip_tower()
    served = loading.build_model("siglip", copy.deepcopy(hf), None, "test", budgets=[1, 2, 4, 8, 16, 32])
    buffers = served.front._finishing.call.args[1]
    gen = torch.Generator().manual_seed(5)
    host = [torch.randn(int(n), 3, 384, 384, generator=gen) for n in np.random.default_rng(6).integers(1, 5, CLIENTS)]

    def client(x: torch.Tensor) -> np.ndarray:
        finished = served.submit(served.prepare({"pixel_values": x.numpy()})).result(TIMEOUT)
        served.on_host(finished)
        return np.stack([pooled for pooled, _ in served.embeddings(finished, tokens=False)])

    try:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
            answers = list(ex.map(client, host))
        stats, made = served.front.stats, buffers.buffers
        assert client(host[0]).shape == answers[0].shape and buffers.buffers == made
    finally:
        served.front.close()
    assert max(stats["requests_per_call"]) > 1 and made <= stats["calls"], (stats, made)
    with torch.inference_mode():
        for x, got in zip(host, answers):
            want = hf(pixel_values=x.to("cuda", torch.bfloat16)).pooler_output.float().cpu()
            assert got.shape == tuple(want.shape) and np.isfinite(got).all()
            assert rel(torch.from_numpy(got), want) < HF_RTOL


def test_calls_wait_only_while_the_device_is_busy():
    """The front's CUDA wait rule (``encgraph.serving.waiting``) on a real device: a lone client whose previous
    answer has finished on the device never waits; requests that arrive while the device runs an earlier call
    (a 0.3 s ``torch.cuda._sleep`` ahead of it on the same stream) are gathered into one call, launched when the
    device goes idle, well before ``max_wait_ms``; every answer equals the per-request forward."""
    hf = siglip_tower()
    fast = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8])
    gen = torch.Generator(device="cuda").manual_seed(4)
    xs = [torch.randn(n, 3, 384, 384, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (1, 2, 1, 3)]
    with BatchingFront(fast, capture=True, max_wait_ms=10_000) as front:
        lone = []
        for x in xs:
            start = time.perf_counter()
            lone.append(front.submit(pixel_values=x).result(TIMEOUT).pooler_output)
            torch.cuda.synchronize()
            assert time.perf_counter() - start < 5.0
        assert front.stats["idle_launches"] == len(xs) and front.stats["requests_per_call"] == {1: len(xs)}
        torch.cuda._sleep(int(0.3 * torch.cuda.get_device_properties(0).clock_rate * 1e3))  # the device busy
        first = front.submit(pixel_values=xs[0])
        first.result(TIMEOUT)  # launched at once (the last call had finished); it runs after the sleep
        start = time.perf_counter()
        later = [front.submit(pixel_values=x) for x in xs[1:]]
        outs = [f.result(TIMEOUT).pooler_output for f in later]
        waited = time.perf_counter() - start
        stats = front.stats
    assert stats["requests_per_call"][1] == len(xs) + 1 and stats["requests_per_call"].get(3) == 1, stats
    assert waited < 5.0, waited
    with torch.inference_mode():
        for x, got_lone, got in zip(xs[1:], lone[1:], outs):
            ref = hf(pixel_values=x).pooler_output
            assert rel(got, ref) < HF_RTOL and rel(got_lone, ref) < HF_RTOL


def test_device_preprocessing_beside_replays_matches_the_host_processor():
    """``encgraph serve --preprocess-on device`` on a GPU: 32 threads each upload their request's decoded bytes and
    run the torchvision processor on their side stream (``DeviceProcessing.on_device``) while the worker replays,
    handing each request's event to the worker (``submit_after``: no thread waits for the device);
    each request's pixels are the host processor's within a few 8-bit steps (torchvision's antialiased bicubic on
    the GPU against Pillow's, then bf16: on these noise pictures, the worst case for resampling, the largest
    difference measured 0.040 = 5.1 steps on an H100), and its embedding is the tower's own forward on those pixels
    and agrees with the embedding of the host processor's pixels."""
    pytest.importorskip("torchvision")
    from PIL import Image
    from transformers import SiglipImageProcessor

    from encgraph.serving import loading
    from encgraph.serving.device_preprocess import DeviceProcessing
    from encgraph.serving.transfer import Handoff, side_stream_work

    processor = SiglipImageProcessor(size={"height": 384, "width": 384}, resample=3, image_mean=[0.5] * 3,
                                     image_std=[0.5] * 3)
    split = DeviceProcessing(processor)
    rng = np.random.default_rng(4)

    def picture() -> Image.Image:
        h, w = (int(v) for v in rng.integers(100, 1500, 2))
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    requests = [[picture() for _ in range(int(n))] for n in rng.integers(1, 4, CLIENTS)]
    hf = siglip_tower()
    fast = encgraph.graphed(copy.deepcopy(hf), budgets=[1, 2, 4, 8, 16, 32])

    def prepare(images: list) -> tuple[torch.Tensor, Any]:
        arrays = loading.process_images(split, images)
        with side_stream_work("cuda", Handoff.EVENT) as work:  # as ServedModel.prepare: left in flight
            pixels = work(split.on_device(arrays, torch.device("cuda"), torch.bfloat16)["pixel_values"])
        return pixels, work.ready

    answers, _ = pooled_by_clients(fast, prepare, requests)
    steps = 2 / 255  # one 8-bit step in SigLIP's normalised units (std 0.5)
    worst, mean, drift = 0.0, [], []
    with torch.inference_mode():
        for images, (pixels, got) in zip(requests, answers):
            host = torch.from_numpy(loading.process_images(processor, images)["pixel_values"])
            diff = (pixels.float().cpu() - host).abs()
            worst, mean = max(worst, float(diff.max())), mean + [float(diff.mean())]
            want = hf(pixel_values=pixels).pooler_output.float().cpu()
            assert torch.isfinite(got).all() and rel(got, want) < HF_RTOL
            on_host = hf(pixel_values=host.to("cuda", torch.bfloat16)).pooler_output.float().cpu()
            drift.append(rel(got, on_host))
    print(f"device vs host pixels: max {worst / steps:.2f} steps, mean {np.mean(mean) / steps:.3f} steps; "
          f"embedding vs the host pixels' norm-relative: max {max(drift):.4f}")
    assert worst <= 32 * steps and np.mean(mean) <= steps / 2  # 32 steps: a wrong rescale or norm is hundreds
    assert max(drift) < HF_RTOL
