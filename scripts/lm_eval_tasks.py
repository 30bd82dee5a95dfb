"""Write two lm-evaluation-harness tasks built from the bundled GSM8K copy, for ``epikv serve``
driven by lm-eval offline (docs/serving.md, "lm-evaluation-harness as a client").

- ``epikv_gsm8k_gen``: the first N GSM8K test problems as a generate-until task (0-shot,
  "Question: ... Answer:", stop at the next "Question:", flexible numeric extraction, exact match).
- ``epikv_gsm8k_mc``: the same problems as a 4-way multiple-choice log-likelihood task: the gold
  final answer against the answers of the next problems (distinct numbers), the gold one placed at
  position index % 4, scored by lm-eval's ``acc`` / ``acc_norm``.

Data files are written beside the YAML and named by absolute path (lm-eval's ``json`` loader reads
them relative to the working directory otherwise). ``--tokenizer`` also saves the embedded model's
tokenizer, which ``local-completions`` needs (``tokenizer=DIR/tokenizer``).

    python scripts/lm_eval_tasks.py --out /tmp/epikv-lm-eval --problems 8 --tokenizer
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

GEN_YAML = """task: epikv_gsm8k_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{problem}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Question:", "\\n\\n"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: {max_gen_toks}
filter_list:
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]
metadata:
  version: 1.0
"""

MC_YAML = """task: epikv_gsm8k_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{problem}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def gsm8k(count: int) -> list[dict]:
    text = resources.files("epikv").joinpath("data", "gsm8k.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()][:count]


def multiple_choice(problems: list[dict], pool: list[dict]) -> list[dict]:
    """Each problem with its gold answer and three distinct answers of the problems after it."""
    out = []
    for index, problem in enumerate(problems):
        wrong: list[str] = []
        for other in pool[index + 1 :]:
            if other["answer"] != problem["answer"] and other["answer"] not in wrong:
                wrong.append(other["answer"])
            if len(wrong) == 3:
                break
        label = index % 4
        choices = [*wrong[:label], problem["answer"], *wrong[label:]]
        out.append({"problem": problem["problem"], "choices": choices, "label": label})
    return out


def write_tasks(out: Path, problems: int, max_gen_toks: int = 256) -> list[str]:
    """The two tasks' files under ``out``; returns their names."""
    out.mkdir(parents=True, exist_ok=True)
    pool = gsm8k(problems + 20)
    rows = [{"problem": p["problem"], "answer": p["answer"]} for p in pool[:problems]]
    gen, mc = out / "epikv_gsm8k_gen.jsonl", out / "epikv_gsm8k_mc.jsonl"
    gen.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    mc_rows = multiple_choice(pool[:problems], pool)
    mc.write_text("".join(json.dumps(r) + "\n" for r in mc_rows), encoding="utf-8")
    data = {"data": json.dumps(str(gen.resolve())), "max_gen_toks": max_gen_toks}
    (out / "epikv_gsm8k_gen.yaml").write_text(GEN_YAML.format(**data), encoding="utf-8")
    (out / "epikv_gsm8k_mc.yaml").write_text(MC_YAML.format(data=json.dumps(str(mc.resolve()))), "utf-8")
    return ["epikv_gsm8k_gen", "epikv_gsm8k_mc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the task files (lm_eval --include_path)")
    parser.add_argument("--problems", type=int, default=8, help="GSM8K problems in each task")
    parser.add_argument("--max-gen-toks", type=int, default=256, help="generate-until token limit")
    parser.add_argument("--tokenizer", action="store_true", help="also save the embedded tokenizer")
    args = parser.parse_args()
    if args.problems < 1:
        parser.error(f"--problems must be at least 1, got {args.problems}")
    out = Path(args.out)
    names = write_tasks(out, args.problems, args.max_gen_toks)
    if args.tokenizer:
        from epikv.models import load_model

        load_model()[1].save_pretrained(out / "tokenizer")
    print(",".join(names))


if __name__ == "__main__":
    main()
