#!/bin/bash
# 2026-12-06 06:34-06:41 UTC, idle 2-core Intel Xeon (AMX), HEAD a4742e8 (plugin code as at be7ecc2); OpenVINO set up by ../shared/peers/openvino/setup_ov.sh
set -u
cd /work/main
OV=$HOME/.cache/epikv-peers/ov-venv/bin/python; P=../shared/peers/openvino; IR=$HOME/.cache/epikv-peers/ov-models/smollm2-135m-fp32
echo "== ov $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
$OV $P/ov_serve_bench.py --ir $IR -n 16 -t 2048 --threads 2 --eviction on --start 64 --recent 64 --max-cache 352 --out /work/logs/ov_2048_intel.jsonl --show 0 >/work/logs/ov_intel.out 2>>/work/logs/ov_err.log
echo "== plugin $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
.venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 2048 --modes compiled --dtype float32 --skip-plain --out /work/logs/plugin_2048_intel.json >/work/logs/plugin_intel.out 2>>/work/logs/ov_err.log
echo "== done $(date -u +%T)"
