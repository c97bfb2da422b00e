"""Worked examples for an SFT warm-up (`minigrpo sft`) before GRPO on a reasoning-gym task: questions of the
task's generator drawn with a seed of their own, each answered in the tags its prompt asks for, none of them a
held-out question of the run's seed.

    python scripts/warmup_examples.py rg:basic_arithmetic:min_digits=1,max_digits=1 --count 48 --out warmup.jsonl
"""

import argparse
import json

from minigrpo.tasks import get_task

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("task", help="a reasoning-gym task spec, rg:NAME[:options]")
parser.add_argument("--count", type=int, default=48)
parser.add_argument("--out", required=True)
parser.add_argument("--seed", type=int, default=4242, help="the examples' own seed (not the run's)")
parser.add_argument("--run-seed", type=int, default=0, help="the run's seed, whose held-out questions are left out")
args = parser.parse_args()

task = get_task(args.task)
held_out = {row["prompt"][-1]["content"] for row in task.make_data("test", args.run_seed)}
rows = [row for row in task.make_data("train", args.seed) if row["prompt"][-1]["content"] not in held_out]
if len(rows) < args.count:
    raise SystemExit(f"only {len(rows)} questions outside the held-out ones; ask for fewer")
with open(args.out, "x") as out:  # never over a file that is there
    for row in rows[:args.count]:
        out.write(json.dumps({"prompt": row["prompt"], "completion": f"<answer>{row['answer']}</answer>"}) + "\n")
print(f"wrote {args.count} examples to {args.out}")
