"""The vLLM plugin's tests, a package: their helpers import as ``tests.vllm.engines``."""
