"""`make demo`: the Shakespeare run, start to finish, through the same commands a user types.

  strata data prepare --source shakespeare --tokenizer bpe:8192 --out runs/demo/data
  strata train --model small --data runs/demo/data --dtype bf16 ... --save runs/demo/ckpt --tensorboard runs/demo/tb
  strata plot runs/demo/metrics.jsonl --out runs/demo/loss.png
  strata generate --checkpoint runs/demo/ckpt --prompt "ROMEO:" ..."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys

from strata.cli import main as strata

OUT = os.environ.get("STRATA_DEMO_DIR", "runs/demo")
STEPS = int(os.environ.get("STRATA_DEMO_STEPS", 150))  # about 5 minutes on 2 CPU cores in bf16


def step(*args: str) -> None:
    print(f"\n$ strata {shlex.join(args)}", flush=True)
    code = strata(list(args))
    if code:
        sys.exit(code)


def main() -> None:
    data, metrics = f"{OUT}/data", f"{OUT}/metrics.jsonl"
    # the events need the optional tensorboard package (`pip install tensorboard`; `make demo` installs it)
    events = ["--tensorboard", f"{OUT}/tb"] if importlib.util.find_spec("tensorboard") else []
    if not os.path.isfile(f"{data}/meta.json"):
        step("data", "prepare", "--source", "shakespeare", "--tokenizer", "bpe:8192", "--out", data)
    step("train", "--model", "small", "--data", data, "--dtype", "bf16", "--seq-len", "256",
         "--micro-batch", "8", "--global-batch", "16", "--steps", str(STEPS), "--lr", "2e-3",
         "--min-lr", "2e-4", "--warmup-steps", "10", "--eval-every", "25", "--eval-batches", "4",
         "--metrics", metrics, "--save", f"{OUT}/ckpt", *events)
    step("plot", metrics, "--out", f"{OUT}/loss.png")
    step("generate", "--checkpoint", f"{OUT}/ckpt", "--prompt", "ROMEO:\n", "--max-new-tokens", "120",
         "--temperature", "0.8", "--top-k", "50", "--seed", "1")
    evals = [r for r in map(json.loads, open(metrics)) if r["kind"] == "eval"]
    drop = evals[0]["val_loss"] - evals[-1]["val_loss"]
    print(f"\nvalidation loss {evals[0]['val_loss']:.3f} -> {evals[-1]['val_loss']:.3f} "
          f"(down {drop:.2f} nats); loss curve in {OUT}/loss.png")
    if events:
        print(f"TensorBoard: tensorboard --logdir {OUT}/tb")


if __name__ == "__main__":
    main()
