# 2026-12-06, idle 2-core Intel Xeon (AMX), after a study cell; commit 69d19dd
.venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 512 --modes compiled --dtype float32 --out throughput_512.json
.venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 2048 --modes compiled --dtype float32 --skip-plain --out plugin_2048.json
