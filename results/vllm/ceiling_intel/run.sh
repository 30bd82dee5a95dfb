# 2026-12-06 06:06-06:14 UTC, idle 2-core Intel Xeon (AMX), right after a study cell; HEAD ea9b7f2 (vllm_bench.py and src/epikv/vllm last changed at be7ecc2)
.venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 512 --modes compiled --dtype float32 --out throughput_512.json
.venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 2048 --modes compiled --dtype float32 --skip-plain --out plugin_2048.json
