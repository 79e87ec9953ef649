"""Shim tests. vLLM, where installed (the separate CI step's environment), runs on its CPU platform here."""

import os

# Before any vLLM import: without a CUDA device vLLM picks no platform and its stream helpers fail.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
