"""Loading what ``encgraph serve --model PATH`` serves, from tiny checkpoints saved here with ``save_pretrained``
(a full SigLIP dual encoder and a full Qwen2.5-VL model: only the vision tower is loaded), and the served
embeddings of the graphs and of ``--eager`` against the original model's own tower, per image."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from encgraph.cli import build_parser  # noqa: E402
from encgraph.cli.serve import build_models  # noqa: E402
from encgraph.errors import ConfigError, UnsupportedModelError  # noqa: E402
from encgraph.serving import loading  # noqa: E402

TOL = 1e-5
TIMEOUT = 60


def _images(n: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (40 + 13 * i, 60 - 5 * i, 3), dtype=np.uint8)) for i in range(n)]


CHECKPOINTS = {
    # name: (config class, model class, processor class, config kwargs, processor kwargs), all in transformers
    "siglip": ("SiglipConfig", "SiglipModel", "SiglipImageProcessor", dict(
        text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           image_size=28, patch_size=14),
    ), dict(size={"height": 28, "width": 28})),
    "qwen": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2VLImageProcessor", dict(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=60, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1], window_size=56),
    ), dict(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 32})),
}


def _save(tmp_path_factory, which: str):
    """A full random-weight model and its image processor, saved with save_pretrained: (directory, model)."""
    import transformers

    config_cls, model_cls, processor_cls, config, processor = CHECKPOINTS[which]
    path = tmp_path_factory.mktemp(which)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).eval()
    model.save_pretrained(path)
    getattr(transformers, processor_cls)(**processor).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory):
    return _save(tmp_path_factory, "siglip")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _save(tmp_path_factory, "qwen")


def _reference(model_name: str, model, processor, images):
    processed = processor(images=images, return_tensors="pt")
    with torch.no_grad():
        if model_name == "qwen":
            tokens = model.model.visual(processed["pixel_values"], grid_thw=processed["image_grid_thw"]).pooler_output
            sizes = (processed["image_grid_thw"].prod(-1) // 4).tolist()
            return [t.mean(0).numpy() for t in torch.split(tokens, sizes)]
        return list(model.vision_model(pixel_values=processed["pixel_values"]).pooler_output.numpy())


@pytest.mark.parametrize("which", ["siglip", "qwen"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_checkpoint_tower_serves_the_models_own_embeddings(which, eager, request):
    path, model = request.getfixturevalue(f"{which}_dir")
    tower, processor, description = loading.load_checkpoint(path, device=torch.device("cpu"), dtype=torch.float32)
    original = model.vision_model if which == "siglip" else model.model.visual
    assert type(tower).__name__ == type(original).__name__ and "parameters" in description
    for (name, a), b in zip(tower.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name  # the tower's weights, read from the full checkpoint
    served = loading.build_model(which, tower, processor, description, eager=eager)
    try:
        images = _images(3)
        results = served.front.submit(served.inputs(images)).result(TIMEOUT)
        got = served.embeddings(results, tokens=True)
    finally:
        served.front.close()
    want = _reference(which, model, processor, images)
    assert len(got) == len(want)
    for (pooled, seq), ref in zip(got, want):
        assert pooled.shape == ref.shape and seq.ndim == 2
        assert np.abs(pooled - ref).max() / np.abs(ref).max() < TOL
    assert served.info()["engine"] == ("hf-eager" if eager else "eager")  # the runner's CPU default


def test_a_checkpoint_loads_without_the_hub_kernels_package(siglip_dir, monkeypatch):
    """transformers 5.25 kernelizes in ``from_pretrained`` by default and raises where the ``kernels`` package is
    missing (as on a GPU image with an older one): the server loads the tower's own forward either way."""
    import transformers.modeling_utils as modeling_utils

    if hasattr(modeling_utils, "is_kernels_available"):
        monkeypatch.setattr(modeling_utils, "is_kernels_available", lambda *a, **k: False)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    tower, _, _ = loading.load_checkpoint(siglip_dir[0], device=torch.device("cpu"), dtype=torch.float32)
    assert not getattr(tower, "use_kernels", False)


def test_cli_builds_named_checkpoints_with_their_budgets(siglip_dir):
    path, _ = siglip_dir
    args = build_parser().parse_args(["serve", "--model", f"tiny={path}", "--budgets", "tiny=1,2,4",
                                      "--max-wait-ms", "0"])
    models = build_models(args)
    try:
        assert list(models) == ["tiny"]
        front = models["tiny"].front
        assert front.caps == {"default": 4} and front.max_wait_s == 0
    finally:
        for m in models.values():
            m.front.close()


def test_cli_rejects_budgets_of_an_unknown_model():
    args = build_parser().parse_args(["serve", "--budgets", "nope=1,2"])
    from encgraph.cli._common import UsageError

    with pytest.raises(UsageError, match="no model 'nope'"):
        build_models(args)


def test_load_errors_name_what_to_fix(tmp_path, siglip_dir):
    with pytest.raises(ConfigError, match="config.json"):
        loading.load_checkpoint(tmp_path, device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text((siglip_dir[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        loading.load_checkpoint(tmp_path, device="cpu", dtype=torch.float32)
    (tmp_path / "preprocessor_config.json").write_text("{}")
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UnsupportedModelError, match="not served"):
        loading.load_checkpoint(tmp_path, device="cpu", dtype=torch.float32)


def test_embedded_processors_and_towers_build():
    for name in loading.EMBEDDED:
        processor = loading.load_processor(name)
        tower, description = loading.embedded_tower(name, device=torch.device("cpu"), dtype=torch.float32)
        assert description and next(tower.parameters()).dtype == torch.float32
        assert processor(images=_images(1), return_tensors="pt")["pixel_values"].is_floating_point()
    with pytest.raises(ConfigError, match="embedded models"):
        loading.embedded_tower("clip", device="cpu", dtype=torch.float32)


def test_parser_accepts_named_and_plain_values():
    args = build_parser().parse_args(["serve", "--model", "/a/b", "--model", "x=/c", "--budgets", "8,4"])
    assert args.model == [(None, "/a/b"), ("x", "/c")] and args.budgets == [(None, (4, 8))]
    assert isinstance(args, argparse.Namespace)


@pytest.mark.parametrize("which", ["siglip", "qwen"])
def test_a_tower_saved_alone_loads_too(which, request, tmp_path):
    import transformers

    _, model = request.getfixturevalue(f"{which}_dir")
    original = model.vision_model if which == "siglip" else model.model.visual
    if which == "siglip":  # SiglipVisionModel around the dual encoder's tower
        from transformers import SiglipVisionModel

        standalone = SiglipVisionModel(model.config.vision_config).eval()
        standalone.load_state_dict(original.state_dict())
        original = standalone
    original.save_pretrained(tmp_path)
    _, _, processor_cls, _, processor = CHECKPOINTS[which]
    getattr(transformers, processor_cls)(**processor).save_pretrained(tmp_path)
    tower, _, _ = loading.load_checkpoint(tmp_path, device=torch.device("cpu"), dtype=torch.float32)
    assert type(tower) is type(original)
    for (name, a), b in zip(tower.state_dict().items(), original.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("argv, code", [
    (["serve", "--help"], 0),
    (["serve", "--max-wait-ms", "-1"], 2),
    (["serve", "--budgets", "a=0,1"], 2),
    (["serve", "--max-requests", "0"], 2),
])
def test_serve_command_line_exit_codes(argv, code, capsys):
    from encgraph.cli import main

    assert main(argv) == code
    captured = capsys.readouterr()
    assert ("usage:" in captured.out) if code == 0 else ("error" in captured.err and "\n" == captured.err[-1])


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _truncate(path):
    (weights,) = [p for p in path.iterdir() if p.suffix == ".safetensors"]
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])


def _edit_json(name, change):
    import json

    def edit(path):
        config = json.loads((path / name).read_text())
        change(config)
        (path / name).write_text(json.dumps(config))

    return edit


BROKEN = {
    # what: (how to break a good checkpoint, words of the one-line error)
    "config.json not JSON": (lambda p: (p / "config.json").write_text('{"model_type": "siglip",'),
                             "config.json is not valid JSON"),
    "unknown model type": (_edit_json("config.json", lambda c: c.update(model_type="llava_next_video_xl")),
                           "model_type 'llava_next_video_xl' is not served"),
    "a bad config field": (_edit_json("config.json", lambda c: c.update(vision_config=5)),
                           "transformers cannot read config.json"),
    "truncated weights": (_truncate, "model.safetensors is damaged: truncated"),
    "no weights": (lambda p: [f.unlink() for f in p.iterdir() if f.suffix == ".safetensors"], "no weights"),
    "preprocessor not JSON": (lambda p: (p / "preprocessor_config.json").write_text("{oops"),
                              "preprocessor_config.json is not valid JSON"),
    "unknown processor type": (_edit_json("preprocessor_config.json",
                                          lambda c: c.update(image_processor_type="NoSuchImageProcessor")),
                               "transformers cannot read preprocessor_config.json"),
    "processor of another size": (_edit_json("preprocessor_config.json",
                                             lambda c: c.update(size={"height": 56, "width": 56})),
                                  "processor's height x width is 56x56, but the tower's image_size is 28x28"),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_a_broken_checkpoint_is_one_line_and_exit_2_before_any_tower_is_built(what, siglip_dir, tmp_path, capsys,
                                                                               monkeypatch):
    from encgraph.cli import main

    break_it, words = BROKEN[what]
    path = _copy(siglip_dir[0], tmp_path / "ckpt")
    break_it(path)
    built = []
    monkeypatch.setattr(loading, "load_tower", lambda *a, **k: built.append(a))
    monkeypatch.setattr(loading, "embedded_tower", lambda *a, **k: built.append(a))
    # A good model first: no tower of it is built either, since every checkpoint is checked first.
    from tests.unit.test_cli_serve import free_port

    port = str(free_port())
    assert main(["serve", "--port", port, "--model", f"good={siglip_dir[0]}", "--model", f"bad={path}"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.startswith("encgraph serve: error: --model "), err
    assert built == []


def test_a_qwen_processor_of_another_patch_size_names_both(qwen_dir, tmp_path):
    path = _copy(qwen_dir[0], tmp_path / "ckpt")
    _edit_json("preprocessor_config.json", lambda c: c.update(merge_size=3))(path)
    with pytest.raises(ConfigError, match="processor's merge_size is 3, but the tower's spatial_merge_size is 2"):
        loading.inspect_checkpoint(path)


HIDE_TORCHVISION = "import sys; sys.modules['torchvision'] = None"
"""A standard install has no torchvision (not a dependency): ``find_spec`` and transformers then see none."""


def test_embedded_processors_load_without_torchvision_and_without_a_warning():
    """Issue 57: every start printed transformers' two "requires torchvision (not installed); falling back to
    ...Pil" warnings. Without torchvision the Pillow backends are chosen by name, silently."""
    import subprocess
    import sys

    code = (f"{HIDE_TORCHVISION}\nfrom encgraph.serving.loading import EMBEDDED, load_processor\n"
            "print(' '.join(type(load_processor(n)).__name__ for n in EMBEDDED))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SiglipImageProcessorPil", "Qwen2VLImageProcessorPil"]
    assert done.stderr == ""


def test_preprocessing_on_the_device_refuses_a_pillow_processor():
    """``--preprocess-on device`` needs transformers' torchvision processor; the Pillow one (what a standard install
    without torchvision loads) is refused at start, naming the fix."""
    import transformers

    from encgraph.serving.device_preprocess import device_processing

    pil = transformers.SiglipImageProcessorPil.from_dict(loading.load_config("siglip_processor"))
    with pytest.raises(ConfigError, match="install torchvision matching your torch, or preprocess on the host"):
        device_processing(pil)


def test_request_threads_reach_the_app(monkeypatch):
    """``encgraph serve --request-threads N`` (default 4, at least 1) is what the app's upload and answer pools
    get."""
    import encgraph.serving.app as app_module
    from encgraph.cli import serve

    seen: dict = {}
    monkeypatch.setattr(serve, "build_models", lambda args: {"m": None})
    monkeypatch.setattr(app_module, "create_app", lambda models, limits, **kw: seen.update(kw) or "app")
    args = build_parser().parse_args(["serve", "--request-threads", "16", "--preprocess-workers", "0"])
    args.resolved_api_key = None
    assert serve.make_app(args) == "app" and seen["request_threads"] == 16 and seen["preprocess_workers"] == 0
    assert build_parser().parse_args(["serve"]).request_threads == 4
    from encgraph.cli._common import UsageError

    with pytest.raises(UsageError, match="--request-threads: expected a positive int, got 0"):
        build_parser().parse_args(["serve", "--request-threads", "0"])


@pytest.mark.parametrize("tokens", [False, True], ids=["batch-tower", "token-tower"])
def test_a_call_is_copied_down_once_and_each_request_reads_its_own_rows(monkeypatch, tokens):
    """The served front's ``finish_call`` on a (faked) CUDA call of three requests of 2, 1 and 3 images: one pinned
    buffer, one copy and one event for the call; each request's rows are its own images' pooled embeddings, in
    order (a batch tower's ``pooler_output`` row, a token tower's mean of its merged tokens), as float32; the
    next call reuses the buffer once the first call's requests are done with it."""
    from tests.unit.test_serving_transfer import _fake_pinned, _OnCuda

    made = _fake_pinned(monkeypatch)
    buffers = loading.PinnedBuffers()
    gen = torch.Generator().manual_seed(0)

    def call(sizes):
        def item():
            if tokens:
                return {"pooler_output": torch.randn(3, 4, generator=gen).as_subclass(_OnCuda)}
            return {"pooler_output": torch.randn(1, 4, generator=gen).to(torch.bfloat16).as_subclass(_OnCuda),
                    "last_hidden_state": torch.randn(1, 3, 4, generator=gen).as_subclass(_OnCuda)}
        return [[item() for _ in range(n)] for n in sizes]

    def want(result):
        if tokens:
            return result["pooler_output"].float().mean(0).as_subclass(torch.Tensor).numpy()
        return result["pooler_output"][0].float().as_subclass(torch.Tensor).numpy()

    first = call([2, 1, 3])
    finished = loading._finish_call(tokens, buffers, first)
    assert len(finished) == 3 and len({id(f.pooled) for f in finished}) == 1 and len(made) == 1
    event = finished[0].pooled.event
    assert event.recorded == 1 and [f.rows for f in finished] == [slice(0, 2), slice(2, 3), slice(3, 6)]
    for f, results in zip(finished, first):
        rows = f.host_rows()
        assert rows.dtype == np.float32 and rows.shape == (len(results), 4) and f.results is results
        np.testing.assert_array_equal(rows, np.stack([want(r) for r in results]))
    assert event.synchronized == 3  # each request waits for the call's one event
    ptr = finished[0].pooled.tensors[0].data_ptr()
    del finished, f
    again = loading._finish_call(tokens, buffers, call([1]))
    assert len(made) == 1 and again[0].pooled.tensors[0].data_ptr() == ptr


def test_coalesced_requests_on_the_cpu_each_get_their_own_images_embeddings(siglip_dir):
    """Three requests (2, 1 and 3 images) in one call of the served tower on the CPU: each gets its own images'
    embeddings, in order, equal to the original model's."""
    path, model = siglip_dir
    tower, processor, description = loading.load_checkpoint(path, device=torch.device("cpu"), dtype=torch.float32)
    served = loading.build_model("siglip", tower, processor, description,
                                 front_options={"max_wait_ms": 5_000, "adaptive_wait": False, "max_requests": 3})
    batches = [_images(n, seed=n) for n in (2, 1, 3)]
    try:
        futures = [served.front.submit(served.inputs(images)) for images in batches]
        got = [served.embeddings(f.result(TIMEOUT), tokens=False) for f in futures]
        stats = served.front.stats
    finally:
        served.front.close()
    assert stats["calls"] == 1 and stats["requests_per_call"] == {3: 1}
    for images, answer in zip(batches, got):
        want = _reference("siglip", model, processor, images)
        assert len(answer) == len(want)
        for (pooled, seq), ref in zip(answer, want):
            assert seq is None and np.abs(pooled - ref).max() / np.abs(ref).max() < TOL
