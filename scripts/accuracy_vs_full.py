"""The accuracy study's serving figures (issue 41): evicting cells against `full` on the engine the
study runs them on (vLLM with the plugin, compiled, the study's batch), in one run, on an idle machine.

  .venv/bin/python scripts/accuracy_vs_full.py --cells gsm8k/epikv@K288,gsm8k/keydiff@K319 \
      --problems 64 --out results/accuracy/serving.json

``full`` runs first and again last (the two bracket the run's drift); each listed cell runs between
them on the same first ``--problems`` problems, exactly as the study runs it. Per run: generated
tokens per second (generate calls only, start-up excluded), each request's peak cache (mean and
largest), and accuracy on these problems. Per cell: its tokens/s over the mean of the two `full`
runs, and `full`'s largest peak over the cell's, which is how many more requests a pool sized for
the longest request holds at once. `full` here is the plugin under `full`, which writes plain vLLM's
tokens (tests/vllm/test_qwen_real.py, float32); compare only ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from epikv.bench.accuracy.cells import timed_cell
from epikv.bench.accuracy.design import Study
from epikv.bench.shared import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", required=True, help="comma-separated evicting cells of one arm")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    study = Study()
    names = [n.strip() for n in args.cells.split(",") if n.strip()]
    arms = {n.split("/")[0] for n in names}
    if len(arms) != 1:
        parser.error(f"--cells {args.cells!r}: give cells of one arm (gsm8k or math500), not {sorted(arms)}")
    full = f"{arms.pop()}/full@full"
    known = {cell.name: cell.engine for cell in study.cells()}
    for name in names:  # refused before anything runs: an unknown cell, or one vLLM cannot run
        if name not in known:
            parser.error(f"--cells: no cell {name!r} in the study (epikv bench accuracy status lists them)")
        if known[name] != study.engine:
            parser.error(f"--cells: {name} runs on {known[name]}, not on vLLM with the plugin")
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, name in enumerate([full, *names, full]):
            run = timed_cell(study, name, study.engine, study.batch_size, args.problems, f"{scratch}/{index}")
            del run["token_ids"]
            runs.append(run)
    full_speed = (runs[0]["tokens_per_s"] + runs[-1]["tokens_per_s"]) / 2
    full_peak = max(runs[0]["peak_cache_max"], runs[-1]["peak_cache_max"])
    ratios = {
        run["cell"]: {
            "tokens_per_s_over_full": round(run["tokens_per_s"] / full_speed, 3),
            "full_peak_over_cell_peak": round(full_peak / run["peak_cache_max"], 2),
        }
        for run in runs[1:-1]
    }
    doc = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": machine.cpu(), "problems": args.problems,
        "engine": study.engine, "batch": study.batch_size, "runs": runs, "ratios": ratios,
    }  # fmt: skip
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
