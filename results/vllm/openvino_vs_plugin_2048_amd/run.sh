set -u
cd /work/main
OV=$HOME/.cache/epikv-peers/ov-venv/bin/python; P=../shared/peers/openvino; IR=$HOME/.cache/epikv-peers/ov-models/smollm2-135m-fp32
for round in 1 2 3; do
  echo "== round $round ov $(date +%T)"
  $OV $P/ov_serve_bench.py --ir $IR -n 16 -t 2048 --threads 2 --eviction on --start 64 --recent 64 --max-cache 352 --out /work/logs/ov_2048.jsonl --show 0 >/work/logs/ov_r$round.out 2>>/work/logs/ov_err.log
  echo "== round $round plugin $(date +%T)"
  .venv-vllm/bin/python scripts/vllm_bench.py throughput --lengths 2048 --modes compiled --dtype float32 --skip-plain --out /work/logs/plugin_2048_r$round.json >/work/logs/plugin_r$round.out 2>>/work/logs/ov_err.log
done
echo "== done $(date +%T)"
