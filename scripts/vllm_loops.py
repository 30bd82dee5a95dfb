"""The loop study's float32 cells through vLLM with the epikv plugin, against epikv's own engine
(issue 35 item 3, docs/vllm-quality.md). The cells run in vLLM's environment (``.venv-vllm``, a
child process each); the comparison grades MATH answers, so run the script from ``.venv``:

  OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv/bin/python scripts/vllm_loops.py

For each cell (``epikv@192``: Seg-Q at K = 192; ``full``: no eviction, the control) the problems,
prompt ids, cap and stop ids are the study's own (:mod:`epikv.bench.loops.study`), checked against
the fingerprints of the engine's stored parts; all prompts of a cell go to one ``llm.generate``
call (greedy, float32, eager, in-process engine) in a fresh child process, and the cell's records
are written to ``OUT/<cell>.json`` as soon as it completes (a rerun skips finished cells). Prompts
the study skipped (the strict rule of comparisons at equal K: protected tokens past K,
:meth:`epikv.spec.CacheSpec.check_prompt`) are skipped here too, and each one is then sent to vLLM
alone to record what it does with it (it refused them until issue 42 item 0; it now runs them at
the smallest K that holds them). Then ``OUT/compare.json``: problem by problem against the engine's
record (identical token ids, first divergence), and the study's loop tests over both.
``--regrade`` grades the stored records again after a grading rule changed (issue 58; the engine's
parts first, with ``epikv bench regrade``) and makes ``compare.json`` again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ROOT / "results/loops/fp32/loops-parts"
# cell -> (policy, K, requests decoded at once): all of Seg-Q's 172 at once (each reserves K + tau
# = 320 tokens), `full` 64 at a time (each may grow to MAX_MODEL_LEN; the pool holds 64 of them)
CELLS = {"epikv@192": ("epikv", 192, 192), "full": ("full", None, 64)}
BLOCK = 32
FP32_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head dim x 4 bytes
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"  # runs the cells; the comparison runs where math-verify is
MAX_MODEL_LEN = 1408  # the longest prompt (371) + the cap (1,024), in whole blocks
log = logging.getLogger("vllm_loops")


def study_config() -> Any:
    """The float32 rerun's settings (docs/loops.md, "Float32 rerun of the deciding cells")."""
    from epikv.bench.loops.study import LoopsConfig

    return LoopsConfig(
        problems=(128, 64), batch_size=16, dtype="float32", policies=("full", "epikv"), peaks=(320,),
        sweep_policies=(), sweep_budgets=(), references=("full",),
    )  # fmt: skip


def study_inputs(cell: str) -> dict[str, Any]:
    """The cell's problems exactly as the study builds them, with the engine's spec of the cell,
    the stop ids, and each batch's fingerprint checked against the engine's stored part."""
    from epikv.bench.loops.study import _batches, plan_cells
    from epikv.bench.shared import model_loading
    from epikv.bench.shared.parts import cell_print, fingerprint_of
    from epikv.generation import eos_ids

    config = study_config()
    model, tokenizer = model_loading.load_bench_model(None, "cpu", "float32")
    specs, _ = plan_cells(model, config)
    stop = sorted(eos_ids(model, tokenizer))
    name = model_loading.model_name(model)
    settings = {"max_new_tokens": config.max_new_tokens, "stop": stop, "model": name}
    work = _batches(config, tokenizer)
    checks = []
    for dataset, b, batch in work:
        mine = cell_print(fingerprint_of([p.key for p in batch], settings), specs[cell])
        stored = json.loads((PARTS / dataset / f"b{b:02d}" / f"{cell}.json").read_text())["fingerprint"]
        checks.append(dict(dataset=dataset, batch=b, vllm=mine, engine=stored, equal=mine == stored))
    return {
        "work": work, "stop": stop, "settings": settings,
        "engine_spec": specs[cell].config(), "fingerprints": checks, "max_new_tokens": config.max_new_tokens,
    }  # fmt: skip


def run_cell(cell: str, out: Path, max_num_seqs: int | None, limit: int | None = None) -> None:
    """One cell through vLLM in this process; writes ``out/<cell>.json`` (``limit``: the first
    problems only, a smoke test)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import epikv.vllm
    from epikv.bench.shared import machine
    from epikv.models.embedded import embedded_cache_folder
    from epikv.vllm.config import plan_request  # the plugin's rule, after the study's strict one

    policy, budget, default_seqs = CELLS[cell]
    max_num_seqs = max_num_seqs or default_seqs
    inputs = study_inputs(cell)
    bad = [c for c in inputs["fingerprints"] if not c["equal"]]
    if bad:
        raise SystemExit(f"{cell}: prompts or settings differ from the engine's parts: {bad}")
    log.info("%s: prompts and settings equal the engine's in all %d batches", cell, len(inputs["work"]))
    gc.collect()
    kwargs = epikv.vllm.engine_kwargs(policy, budget)
    options = {
        "dtype": "float32", "enforce_eager": True, "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": max_num_seqs, "enable_prefix_caching": False, "seed": 0,
        # room for 64 requests of MAX_MODEL_LEN: vLLM never has to preempt (it would recompute a
        # prompt, other arithmetic; the plugin fails a preempted request)
        "kv_cache_memory_bytes": 64 * MAX_MODEL_LEN * FP32_TOKEN_BYTES,
    }  # fmt: skip
    folder = str(embedded_cache_folder())
    started = time.perf_counter()
    llm = LLM(model=folder, **options, **kwargs)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    spec = scheduler.epikv_spec
    problems = [(d, b, i, p) for d, b, batch in inputs["work"] for i, p in enumerate(batch)][:limit]
    refused: dict[int, str] = {}
    for n, (_, _, _, p) in enumerate(problems):
        try:
            spec.check_prompt(len(p.prompt))
            plan_request(spec, len(p.prompt), inputs["max_new_tokens"], None)
        except ValueError as err:
            refused[n] = str(err)
    seen = {"steps": 0, "max_running": 0, "preempted": 0}
    schedule = scheduler.schedule

    def watch(*args: Any, **kw: Any) -> Any:
        result = schedule(*args, **kw)
        seen["steps"] += 1
        seen["max_running"] = max(seen["max_running"], len(scheduler.running))
        seen["preempted"] += len(result.preempted_req_ids or ())
        if seen["steps"] % 100 == 0:
            running, waiting = len(scheduler.running), len(scheduler.waiting)
            log.info("%s: step %d, %d running, %d waiting", cell, seen["steps"], running, waiting)
        return result

    scheduler.schedule = watch
    params = SamplingParams(
        temperature=0, max_tokens=inputs["max_new_tokens"], stop_token_ids=inputs["stop"], ignore_eos=False
    )
    todo = [n for n in range(len(problems)) if n not in refused]
    log.info("%s: %d prompts to vLLM, %d refused by the request rule", cell, len(todo), len(refused))
    clock = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(problems[n][3].prompt)) for n in todo], params)
    wall = time.perf_counter() - clock
    by_index = dict(zip(todo, outs, strict=True))
    records = []
    for n, (dataset, b, i, p) in enumerate(problems):
        head = dict(dataset=dataset, id=p.example.id, batch=b, index=i, prompt_tokens=len(p.prompt))
        if n in refused:
            records.append({**head, "skipped": refused[n], "vllm_refusal": refusal(llm, p.prompt, params)})
            continue
        records.append({**head, **record(by_index[n])})
    doc = {
        "cell": cell,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": machine.cpu()["model"],
        "threads": torch.get_num_threads(),
        "vllm": vllm.__version__,
        "git": git_state(),
        "command": f".venv/bin/python scripts/vllm_loops.py --out {out}",  # this cell in .venv-vllm
        "engine_kwargs": kwargs,
        "llm_options": options,
        "sampling": {"temperature": 0, "max_tokens": params.max_tokens, "stop_token_ids": inputs["stop"]},
        "spec": spec.config() if spec is not None else None,
        "engine_spec": inputs["engine_spec"],
        "spec_equal": spec is not None and spec.config() == inputs["engine_spec"],
        "settings": inputs["settings"],
        "fingerprints": inputs["fingerprints"],
        "init_s": round(clock - started, 1),
        "wall_s": round(wall, 1),
        "tokens": sum(len(r.get("token_ids", ())) for r in records),
        "scheduler": seen,
        "load_average": os.getloadavg(),
        "results": records,
    }
    path = out / f"{cell}.json"
    path.with_suffix(".tmp").write_text(json.dumps(doc) + "\n")
    path.with_suffix(".tmp").replace(path)
    log.info("%s: %d tokens in %.0f s, wrote %s", cell, doc["tokens"], wall, path)
    llm.llm_engine.engine_core.shutdown()


def record(output: Any) -> dict[str, Any]:
    """One generation's tokens and the plugin's counters (graded later, in ``.venv``, which has the
    MATH grader); vLLM's ``stop`` (a stop id) is the engine's ``eos``."""
    done = output.outputs[0]
    counters = (output.kv_transfer_params or {}).get("epikv") or {}
    return {
        "token_ids": list(done.token_ids),
        "finish_reason": {"stop": "eos"}.get(done.finish_reason, done.finish_reason),
        **{k: counters.get(k) for k in ("evictions", "compactions", "peak_cache_tokens")},
    }


def graded(result: dict[str, Any], problem: Any, tokenizer: Any) -> dict[str, Any]:
    """``result`` graded by its task, as :mod:`epikv.bench.loops.runs` grades the engine's."""
    from epikv.bench.loops.runs import graded_tokens

    ids, finish = result["token_ids"], result["finish_reason"]
    _, grade = graded_tokens(problem.task, problem.example, ids, finish, tokenizer)
    return {**result, "correct": grade.correct, "extracted": grade.extracted}


def regrade(out: Path, cells: list[str]) -> None:
    """The cells' stored records graded again by the grader's current rules (issue 58); where a
    verdict moved, ``OUT/regrade.json`` lists it (:func:`epikv.bench.loops.regrade.regrade_cells`)."""
    from epikv.bench.loops.regrade import regrade_cells

    for row in regrade_cells(out, cells, study_config()):
        log.info("%s: %d records graded again, %d updated, %d verdicts moved", row["cell"], row["records"],
                 row["updated"], len(row["moved"]))  # fmt: skip


def refusal(llm: Any, prompt: tuple[int, ...], params: Any) -> str:
    """What vLLM itself does with a prompt the study skipped, sent alone."""
    from vllm.inputs import TokensPrompt

    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    except Exception as err:  # the plugin's front end refuses it: that is what we record
        return f"{type(err).__name__}: {err}"
    done = outs[0].outputs[0]
    return f"not refused: finished {done.finish_reason!r} with {len(done.token_ids)} tokens"


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout

    return {
        "head": git("rev-parse", "HEAD").strip(),
        "dirty_src": git("status", "--short", "src").splitlines(),
    }


# --------------------------------------------------------------------------- comparison


def engine_records(cell: str) -> dict[tuple[str, int, int], dict[str, Any]]:
    found = {}
    for dataset in ("gsm8k", "math500"):
        for path in sorted((PARTS / dataset).glob(f"b*/{cell}.json")):
            b = int(path.parent.name[1:])
            for i, result in enumerate(json.loads(path.read_text())["results"]):
                found[(dataset, b, i)] = result
    return found


def compare_cell(cell: str, out: Path, loops: Any, numbers: frozenset[int], study: Any) -> dict[str, Any]:
    """The vLLM run of ``cell`` against the engine's, problem by problem and by the study's tests."""
    from epikv.bench.loops.summary import cell_facts, cell_row, paired_row, problem_facts
    from epikv.bench.shared import stats
    from epikv.eval.loops import first_divergence

    mine = json.loads((out / f"{cell}.json").read_text())
    engine, engine_full = engine_records(cell), engine_records("full")
    name = f"vllm:{cell}"
    problems, rows = [], []
    for r in mine["results"]:
        key = (r["dataset"], r["batch"], r["index"])
        theirs = engine[key]
        vllm_rec = {
            k: v for k, v in r.items() if k not in ("dataset", "id", "batch", "index", "vllm_refusal")
        }
        if "skipped" not in r:
            vllm_rec = graded(vllm_rec, study["problems"][key], study["tokenizer"])
        cells = {"full": engine_full[key], cell: theirs, name: vllm_rec}
        raw = {"dataset": r["dataset"], "id": r["id"], "prompt_tokens": r["prompt_tokens"], "cells": cells}
        problems.append(problem_facts(raw, loops, numbers))
        row = {"dataset": r["dataset"], "id": r["id"], "prompt_tokens": r["prompt_tokens"]}
        if "skipped" in r or "skipped" in theirs:
            row["skipped"] = {"engine": "skipped" in theirs, "vllm": "skipped" in r}
            rows.append(row)
            continue
        a, b = theirs["token_ids"], r["token_ids"]
        row.update(
            identical=a == b,
            first_divergence=first_divergence(a, b),
            first_evicted_engine=theirs.get("first_evicted_index"),
            lengths=[len(a), len(b)],
            finish=[theirs["finish_reason"], r["finish_reason"]],
        )
        for k in ("evictions", "compactions", "peak_cache_tokens"):
            row[k] = [theirs.get(k), r.get(k)]
        rows.append(row)
    ran = [x for x in rows if "skipped" not in x]
    differ = [x for x in ran if not x["identical"]]
    firsts = [x["first_divergence"] for x in differ]
    facts_e, facts_v = cell_facts(problems, cell), cell_facts(problems, name)
    both = [k for k in facts_e if k in facts_v]
    ci = {
        prop: stats.paired_difference(
            [facts_v[k][prop] for k in both], [facts_e[k][prop] for k in both]
        )._asdict()
        for prop in ("loop", "near_loop", "cap_hit")
    }
    counters = {
        k: sum(x[k][0] == x[k][1] for x in ran) for k in ("evictions", "compactions", "peak_cache_tokens")
    }
    counters_identical = {
        k: sum(x[k][0] == x[k][1] for x in ran if x["identical"])
        for k in ("evictions", "compactions", "peak_cache_tokens")
    }
    skipped_engine = sorted(f"{x['dataset']}/{x['id']}" for x in rows if x.get("skipped", {}).get("engine"))
    skipped_vllm = sorted(f"{x['dataset']}/{x['id']}" for x in rows if x.get("skipped", {}).get("vllm"))
    return {
        "cell": cell,
        "spec_equal": mine["spec_equal"],
        "fingerprints_equal": all(c["equal"] for c in mine["fingerprints"]),
        "problems": len(rows),
        "compared": len(ran),
        "skipped_engine": skipped_engine,
        "skipped_vllm": skipped_vllm,
        "skips_agree": skipped_engine == skipped_vllm,
        "refusals": sorted({x["vllm_refusal"].split(":")[0] for x in mine["results"] if "vllm_refusal" in x}),
        "identical": len(ran) - len(differ),
        "identical_by_dataset": {
            d: [sum(x["identical"] for x in ran if x["dataset"] == d), sum(x["dataset"] == d for x in ran)]
            for d in ("gsm8k", "math500")
        },
        "first_divergence": stats.describe(firsts),
        "diverged_before_first_eviction": sum(
            x["first_evicted_engine"] is None or x["first_divergence"] < x["first_evicted_engine"]
            for x in differ
        ),
        "engine": cell_row(problems, cell),
        "vllm": cell_row(problems, name),
        "paired": paired_row(problems, name, cell),
        "paired_ci": {k: {m: round(v, 4) for m, v in c.items()} for k, c in ci.items()},
        "counters_equal": counters,
        "counters_equal_where_identical": counters_identical,
        "vllm_run": {
            k: mine[k] for k in ("date", "cpu", "threads", "wall_s", "init_s", "tokens", "scheduler")
        },
        "per_problem": rows,
    }


def compare(out: Path, cells: list[str]) -> None:
    from epikv.bench.loops.study import _batches
    from epikv.bench.shared import model_loading
    from epikv.eval.loops import number_token_ids

    _, tokenizer = model_loading.load_bench_model(None, "cpu", "float32")
    loops, numbers = study_config().loop_config(), number_token_ids(tokenizer)
    work = _batches(study_config(), tokenizer)
    problems = {(d, b, i): p for d, b, batch in work for i, p in enumerate(batch)}
    study = {"problems": problems, "tokenizer": tokenizer}
    done = [cell for cell in cells if (out / f"{cell}.json").is_file()]
    found = {cell: compare_cell(cell, out, loops, numbers, study) for cell in done}
    (out / "compare.json").write_text(json.dumps(found, indent=1) + "\n")
    for cell, c in found.items():
        brief = {k: v for k, v in c.items() if k not in ("per_problem", "engine", "vllm")}
        log.info("%s: %s", cell, json.dumps(brief))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="results/vllm/loops")
    parser.add_argument("--cells", default=",".join(CELLS), help=f"of {list(CELLS)}")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded at once (per cell)")
    parser.add_argument("--limit", type=int, default=None, help="the first N problems only (a smoke test)")
    parser.add_argument(
        "--regrade", action="store_true", help="grade the stored records again (current rules), then compare"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [c for c in args.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; known: {list(CELLS)}")
    if args.child:
        run_cell(args.child, out, args.max_num_seqs, args.limit)
        return
    if args.regrade:
        regrade(out, cells)
        compare(out, cells)
        return
    for cell in cells:
        if (out / f"{cell}.json").is_file():
            log.info("%s: done already (%s)", cell, out / f"{cell}.json")
            continue
        command = [str(VLLM_PYTHON), __file__, "--out", str(out), "--cells", cell, "--child", cell]
        command += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
        command += ["--limit", str(args.limit)] if args.limit else []
        if subprocess.run(command, check=False).returncode:
            raise SystemExit(f"{cell}: the vLLM run failed (see above); finished cells are kept")
    compare(out, cells)


if __name__ == "__main__":
    main()
