"""Bad inputs of issue 51 (hardening, second round), flags: rows of tests/test_bad_input.py's table,
each (argv, what its one line must say, extra environment or None). A placeholder '{group.name}'
in argv is a path of tests/bad_input_files.py's fixture."""

from __future__ import annotations

TRAIN = ["train", "--model", "tiny", "--steps", "1", "--no-progress"]
GEN = ["generate", "--checkpoint"]
KERNEL = "which holds the kernel's state or devices, not files"  # an output path under /proc or /sys

CASES: list[tuple[list[str], str, dict | None]] = [
    # --- output paths that cannot be written: one line before any process starts ----------------------
    ([*TRAIN, "--tensorboard", "/proc/1/tb"], f"--tensorboard /proc/1/tb: /proc/1 is on a proc file system, {KERNEL}", None),
    ([*TRAIN, "--metrics", "/proc/1/metrics.jsonl"], "--metrics /proc/1/metrics.jsonl: /proc/1 is on a proc file system", None),
    ([*TRAIN, "--save", "/proc/1/ck", "--nproc", "2"], "--save /proc/1/ck: /proc/1 is on a proc file system", None),
    ([*TRAIN, "--run-dir", "/proc/1/run"], "--run-dir /proc/1/run: /proc/1 is on a proc file system", None),
    ([*TRAIN, "--pp", "2", "--nproc", "2", "--trace", "/proc/1/trace.json"], "--trace /proc/1/trace.json:", None),
    ([*TRAIN, "--metrics", "/sys/kernel/m.jsonl"], "--metrics /sys/kernel/m.jsonl: /sys/kernel is", None),
    ([*TRAIN, "--metrics", "x" * 300 + ".jsonl"], "file systems take at most 255", None),
    (["launch", "--slurm-script", "/proc/1/job.sh", "--nodes", "1", "--gpus-per-node", "1", "--", *TRAIN],
     "--slurm-script /proc/1/job.sh: /proc/1 is on a proc file system", None),
    (["plan", "--model", "tiny", "--chart", "/proc/1/chart.png"], "--chart /proc/1/chart.png:", None),
    (["calibrate", "--nproc", "1", "--out", "/proc/1/profile.json"], "--out /proc/1/profile.json:", None),
    (["data", "prepare", "--source", "{data.corpus}", "--out", "/proc/1/data"], "--out /proc/1/data:", None),
    (["convert", "--to-hf", "{ck.good}", "--out", "/proc/1/hf"], "--out /proc/1/hf:", None),
    # --- sizes with no upper bound: refused with the limit, before anything is allocated ----------------
    ([*TRAIN, "--max-seq-len", "100000000"], "--max-seq-len 100000000: must be at most 16,777,216", None),
    ([*TRAIN, "--micro-batch", "12345678901234567890"], "--micro-batch 12345678901234567890: must be at most", None),
    ([*TRAIN, "--steps", "12345678901234567890"], "--steps 12345678901234567890: must be at most 1,000,000,000", None),
    ([*TRAIN, "--micro-batch", "100000", "--max-seq-len", "4096", "--seq-len", "4096"],
     "of memory for one micro-batch's embedding output", None),
    ([*TRAIN, "--nproc", "200"], "--nproc 200: the run needs at least", None),
    (["plan", "--model", "{plan.huge_layers}"], "n_layers=1000000000 must be at most 1,024", None),
    ([*GEN, "{ck.huge_width}", "--prompt-ids", "1"], "d_model=1000000000000 must be at most 131,072", None),
    (["plan", "--model", "small", "--tokens", "1B", "--days", "1e-9"], "--days 1e-09: 1e+09 tokens take at least",
     None),
    (["plan", "--model", "tiny", "--nodes", "100000"], "--nodes 100000: must be at most 65,536", None),
    (["bench", "comm", "--nproc", "2", "--iters", "12345678901234567890"], "--iters 12345678901234567890: must be at "
                                                                           "most 1,000,000", None),
    (["bench", "comm", "--nproc", "100000"], "--nproc 100000: must be at most 1,024", None),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--seed", "12345678901234567890"],
     "--seed 12345678901234567890: must be at most", None),
    ([*TRAIN, "--bucket-mb", "1e-300"], "--bucket-mb 1e-300: must be at least 0.001", None),
    ([*TRAIN, "--lr", "nan"], "--lr nan: must be a number", None),
    # --- flags accepted and ignored: each acts or is refused ---------------------------------------------
    ([*TRAIN, "--loss-scale", "1024"], "--loss-scale 1024.0: only with dtype fp16", None),
    ([*TRAIN, "--dtype", "bf16", "--min-loss-scale", "1"], "--min-loss-scale 1.0: only with dtype fp16", None),
    ([*TRAIN, "--loss-scale-window", "100"], "--loss-scale-window 100: only with dtype fp16", None),
    ([*TRAIN, "--max-restarts", "2"], "--max-restarts 2: only with --nproc 2 or more", None),
    ([*TRAIN, "--allow-async"], "--allow-async: only with --parallel auto", None),
    (["train", "--model", "tiny-gpt2", "--init-from", "{ck.good}", "--steps", "1"],
     "--model tiny-gpt2: the checkpoint of --init-from", None),
    (["train", "--model", "nope", "--init-from", "{ck.good}", "--steps", "1"], "--model nope: unknown preset", None),
    ([*TRAIN, "--config", "{file.both_spellings.toml}"], "'seq-len' and 'seq_len' both set seq_len; keep one", None),
    ([*TRAIN, "--save-every", "1"], "--save-every 1: only with --save DIR", None),
    ([*GEN, "{ck.good}", "--prompt-ids", "1", "--temperature", "0", "--top-p", "0.9"],
     "--top-p 0.9: only with --temperature > 0", None),
    (["plan", "--model", "tiny", "--batch", "8"], "--batch 8: only with --inference", None),
    (["plan", "--model", "tiny", "--inference", "--global-batch", "8"], "--global-batch 8: only without --inference",
     None),
    # --- small ones ----------------------------------------------------------------------------------------
    (["plan", "--model", "tiny", "--inference", "--device", "A800-80G,,V100-32G"], "with no empty name", None),
]
