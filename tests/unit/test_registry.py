"""The adapter registry reads the built-in table (``encgraph.models.builtin``) and lets a user's entry replace a
built-in one; no adapter module is imported until a tower is wrapped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from encgraph.errors import UnsupportedModelError
from encgraph.models import registry
from encgraph.models.builtin import BUILTIN_ADAPTERS


def test_every_builtin_entry_is_known_and_its_factory_exists() -> None:
    assert set(registry.known_configs()) >= set(BUILTIN_ADAPTERS)
    families = registry.supported_families()
    assert len(families) == len(set(families)) and {"Qwen2.5-VL", "SigLIP", "DeepSeek-OCR2"} <= set(families)
    for factory, _ in BUILTIN_ADAPTERS.values():
        module, attr = factory.split(":")
        assert module.startswith("encgraph.models.") and attr.isidentifier()


def test_reading_the_table_imports_no_adapter() -> None:
    code = ("import sys, encgraph.models; "
            "print(sorted(m for m in sys.modules if m.startswith('encgraph.models.') and m.endswith(('qwen2_vl', "
            "'siglip', 'gemma4', 'deepseek_ocr2'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class _Config:
    pass


class _Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()


def make_adapter(module: torch.nn.Module, **options: object) -> tuple[str, dict]:
    return ("made by the test's factory", options)


def test_a_registered_entry_is_used_and_replaces_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    with pytest.raises(UnsupportedModelError, match="_Config"):
        registry.wrap(_Tower())
    registry.register_adapter("_Config", f"{__name__}:make_adapter", "Test family")
    assert registry.wrap(_Tower(), x=1) == ("made by the test's factory", {"x": 1})
    registry.register_adapter("SiglipVisionConfig", f"{__name__}:make_adapter")
    assert registry._REGISTRY["SiglipVisionConfig"] == f"{__name__}:make_adapter"
    assert "Test family" in registry.supported_families()
