"""``encgraph serve --preprocess-on device`` (encgraph.serving.device_preprocess) on the CPU: the host half decodes
only, the device half runs transformers' torchvision processor, and the server answers as with host
preprocessing, in its threads and through a worker process. In the vision libraries' CI step: it needs
torchvision, which the main step's CPU torch cannot import beside it."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("torchvision")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from encgraph.serving import loading  # noqa: E402
from encgraph.serving.app import create_app  # noqa: E402
from encgraph.serving.device_preprocess import DeviceProcessing, device_processing  # noqa: E402


def images(seed: int) -> list[Image.Image]:
    """Photos of several sizes and modes (a grayscale and an RGBA one: the processors convert them to RGB)."""
    rng = np.random.default_rng(seed)
    shapes = [(120, 200, "RGB"), (384, 384, "RGB"), (701, 333, "RGB"), (64, 90, "L"), (50, 40, "RGBA")]
    out = []
    for h, w, mode in shapes:
        channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
        data = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
        out.append(Image.fromarray(data[..., 0] if channels == 1 else data, mode))
    return out


@pytest.mark.parametrize("name", sorted(loading.EMBEDDED))
def test_the_device_half_is_the_torchvision_processor_exactly(name):
    processor = loading.load_processor(name)
    split = device_processing(processor)
    pictures = images(0)
    want = loading.process_images(processor, [p.convert("RGB") for p in pictures])
    arrays = loading.process_images(split, pictures)
    assert arrays["pixel_values"].dtype == np.uint8
    assert arrays["decoded_sizes"].tolist() == [[p.height, p.width] for p in pictures]
    got = split.on_device(arrays, torch.device("cpu"), torch.float32)
    assert torch.equal(got["pixel_values"], torch.from_numpy(want["pixel_values"]))
    if "image_grid_thw" in want:
        assert torch.equal(got["image_grid_thw"], torch.from_numpy(want["image_grid_thw"]))
    assert split.label == f"{type(processor).__name__} (on the device)"


def _b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _answers(name: str, processor, workers: int, texts: list[str]) -> tuple[list[list[float]], dict]:
    tower, description = loading.embedded_tower(name, device=torch.device("cpu"), dtype=torch.float32)
    served = loading.build_model(name, tower, processor, description, budgets=loading.EMBEDDED[name])
    app = create_app({name: served}, preprocess_workers=workers)
    try:
        with TestClient(app) as client:
            got = client.post("/v1/embeddings", json={"model": name, "input": texts})
            health = client.get("/health").json()["models"][name]
    finally:
        served.front.close()
    assert got.status_code == 200, got.text
    return [d["embedding"] for d in got.json()["data"]], health


@pytest.mark.parametrize("workers", [0, 1], ids=["server threads", "a worker process"])
@pytest.mark.parametrize("name", sorted(loading.EMBEDDED))
def test_served_embeddings_equal_host_preprocessing(name, workers):
    texts = [_b64(p) for p in images(1)[:3]]
    processor = loading.load_processor(name)
    want, _ = _answers(name, processor, 0, texts)
    got, health = _answers(name, DeviceProcessing(processor), workers, texts)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    assert health["image_processor"].endswith("(on the device)")


def test_the_command_line_wraps_every_served_processor():
    from encgraph.cli import build_parser
    from encgraph.cli.serve import build_models, describe

    args = build_parser().parse_args(["serve", "--preprocess-on", "device", "--max-wait-ms", "0"])
    models = build_models(args)
    try:
        assert sorted(models) == sorted(loading.EMBEDDED)
        assert all(isinstance(m.processor, DeviceProcessing) for m in models.values())
        app = create_app(models)
        assert "resizing and normalising on the device" in describe(app)
    finally:
        for m in models.values():
            m.front.close()


def _requests(seed: int) -> list[list[Image.Image]]:
    """Requests of one or several images, sizes mixed within and across requests (two of one size, so that a
    grouping processor stacks them)."""
    rng = np.random.default_rng(seed)
    shapes = [[(120, 200)], [(384, 384), (64, 90), (120, 200)], [(701, 333)], [(50, 40), (50, 40)], [(224, 224)]]
    return [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in one] for one in shapes]


@pytest.mark.parametrize("grouping", [False, True], ids=["the CPU's default", "grouped by shape, as on CUDA"])
@pytest.mark.parametrize("name", sorted(loading.EMBEDDED))
def test_one_call_over_many_requests_gives_each_its_own_output_exactly(name, grouping):
    """``on_device_many`` (the server's batched device half) against ``on_device`` per request: the same pixels
    and the same grids, bit for bit, each request its own rows in order."""
    processor = loading.load_processor(name)
    if grouping:
        processor.disable_grouping = False  # what the processor does on a CUDA device: stack images by shape
    split = device_processing(processor)
    assert split.batches
    parts = [loading.process_images(split, one) for one in _requests(2)]
    cpu = torch.device("cpu")
    together = split.on_device_many(parts, cpu, torch.float32)
    assert len(together) == len(parts)
    for part, got in zip(parts, together, strict=True):
        alone = split.on_device(part, cpu, torch.float32)
        assert sorted(got) == sorted(alone)
        assert torch.equal(got["pixel_values"], alone["pixel_values"])
        if "image_grid_thw" in alone:
            assert torch.equal(got["image_grid_thw"], alone["image_grid_thw"])
            assert got["pixel_values"].shape[0] == int(got["image_grid_thw"].prod(-1).sum())
        else:
            assert got["pixel_values"].shape[0] == len(part["decoded_sizes"])


def test_a_processor_whose_images_may_differ_in_size_does_not_batch():
    processor = loading.load_processor("siglip")
    processor.do_resize = False
    assert not device_processing(processor).batches
    assert device_processing(loading.load_processor("siglip")).batches


@pytest.mark.parametrize("workers", [0, 1], ids=["server threads", "a worker process"])
@pytest.mark.parametrize("name", sorted(loading.EMBEDDED))
def test_concurrent_requests_each_get_their_own_embeddings(name, workers):
    """16 concurrent requests of 1-3 images, preprocessed on the device in shared calls: each answer equals that
    request's answer with host preprocessing, one at a time (so no image is lost, reordered or given to another
    request); a request with a corrupt image fails alone, with the error it gets on the host path."""
    import concurrent.futures

    pictures = [p for one in _requests(3) for p in one]
    bodies = [[_b64(pictures[(k + i) % len(pictures)]) for i in range(1 + k % 3)] for k in range(16)]
    bodies[5] = [bodies[5][0], "aGVsbG8="]  # base64 of "hello": not an image
    processor = loading.load_processor(name)
    tower, description = loading.embedded_tower(name, device=torch.device("cpu"), dtype=torch.float32)
    host = loading.build_model(name, tower, processor, description, budgets=loading.EMBEDDED[name])
    device = loading.build_model(name, tower, DeviceProcessing(processor), description, budgets=loading.EMBEDDED[name])
    try:
        with TestClient(create_app({name: host})) as client:
            want = [client.post("/v1/embeddings", json={"model": name, "input": b}) for b in bodies]
        app = create_app({name: device}, preprocess_workers=workers)
        with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda b: client.post("/v1/embeddings", json={"model": name, "input": b}), bodies))
            stats = app.state.batchers[name].stats
            health = client.get("/health").json()["models"][name]["device_preprocess"]
            scraped = client.get("/metrics").text
    finally:
        host.front.close()
        device.front.close()
    for w, g in zip(want, got, strict=True):
        assert g.status_code == w.status_code, g.text
        if w.status_code != 200:
            assert g.json() == w.json()
            continue
        np.testing.assert_allclose(np.array([d["embedding"] for d in g.json()["data"]]),
                                   np.array([d["embedding"] for d in w.json()["data"]]), rtol=1e-5, atol=1e-6)
    assert want[5].status_code == 400
    assert stats["requests"] == 15 and stats["images"] == sum(len(b) for b in bodies) - 2
    assert health == stats
    assert f'encgraph_device_preprocess_total{{kind="requests",model="{name}"}} 15.0' in scraped
