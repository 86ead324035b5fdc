"""Bad inputs of issue 51 (hardening, second round), checkpoints: rows of tests/test_bad_input.py's table,
each (argv, what its one line must say, extra environment or None). A placeholder '{group.name}'
in argv is a path of tests/bad_input_files.py's fixture."""

from __future__ import annotations

TRAIN = ["train", "--model", "tiny", "--steps", "3", "--no-progress", "--data", "{data.good}", "--seq-len", "16"]
INIT = ["train", "--steps", "3", "--no-progress", "--data", "{data.good}", "--seq-len", "16"]  # the model is the checkpoint's
GEN = ["generate", "--checkpoint"]
TRUNCATED = "not a valid safetensors file (its tensors cover"
HEADER = "not a valid safetensors file (its header length 1000000000000000 does not fit"
OUTSIDE = "is a link to"

CASES: list[tuple[list[str], str, dict | None]] = [
    # --- a damaged shard whose checksum agrees (the manifest rewritten to match it) -----------------
    ([*GEN, "{ck.shard_truncated}", "--prompt-ids", "1"], TRUNCATED, None),
    ([*GEN, "{ck.shard_header_length}", "--prompt-ids", "1"], HEADER, None),
    ([*GEN, "{ck.shard_truncated}", "--prompt-ids", "1", "--tp", "2"], TRUNCATED, None),
    ([*TRAIN, "--resume", "{ck.shard_truncated}"], TRUNCATED, None),
    ([*TRAIN, "--resume", "{ck.shard_header_length}"], HEADER, None),
    ([*TRAIN, "--resume", "{ck.shard_truncated}", "--nproc", "2"], TRUNCATED, None),
    ([*INIT, "--init-from", "{ck.shard_truncated}"], TRUNCATED, None),
    ([*INIT, "--init-from", "{ck.shard_header_length}", "--nproc", "2"], HEADER, None),
    (["convert", "--to-hf", "{ck.shard_truncated}", "--out", "c51a"], TRUNCATED, None),
    (["convert", "--to-hf", "{ck.shard_header_length}", "--out", "c51b"], HEADER, None),
    (["bench", "generate", "--checkpoint", "{ck.shard_truncated}"], TRUNCATED, None),
    (["bench", "generate", "--checkpoint", "{ck.shard_header_length}"], HEADER, None),
    # --- checksums checked before the ranks start ------------------------------------------------------
    ([*TRAIN, "--resume", "{ck.shard_wrong_sha}", "--nproc", "2"], "shard_0.safetensors fails its checksum", None),
    ([*INIT, "--init-from", "{ck.shard_wrong_sha}", "--nproc", "2"], "shard_0.safetensors fails its checksum", None),
    ([*GEN, "{ck.shard_wrong_sha}", "--prompt-ids", "1", "--tp", "2"], "shard_0.safetensors fails its checksum", None),
    # --- links out of the checkpoint ---------------------------------------------------------------------
    ([*GEN, "{ck.tokenizer_link}", "--prompt", "It was"], f"'tokenizer.json' {OUTSIDE}", None),
    ([*TRAIN, "--resume", "{ck.tokenizer_link}"], f"'tokenizer.json' {OUTSIDE}", None),
    ([*GEN, "{ck.shard_link}", "--prompt-ids", "1"], f"'shard_0.safetensors' {OUTSIDE}", None),
    (["convert", "--to-hf", "{ck.shard_link}", "--out", "c51c"], f"'shard_0.safetensors' {OUTSIDE}", None),
    ([*INIT, "--init-from", "{ck.shard_link}", "--nproc", "2"], f"'shard_0.safetensors' {OUTSIDE}", None),
    ([*GEN, "{ck.latest_link}", "--prompt-ids", "1"], f"'step_000009' {OUTSIDE}", None),
    ([*TRAIN, "--resume", "{ck.latest_link}"], f"'step_000009' {OUTSIDE}", None),
    # --- a changed tokenizer on resume (generate and convert refuse it too) ------------------------------
    ([*TRAIN, "--resume", "{ck.tokenizer_tampered}"], "tokenizer.json fails its checksum", None),
    ([*TRAIN, "--resume", "{ck.tokenizer_tampered}", "--nproc", "2"], "tokenizer.json fails its checksum", None),
    # --- a fresh run into another run's save directory -----------------------------------------------------
    ([*TRAIN, "--save", "{ck.save}"], "holds the checkpoints of another run (newest: step 2)", None),
    ([*INIT, "--save", "{ck.save}", "--init-from", "{ck.good}"], "holds the checkpoints of another run", None),
    ([*TRAIN, "--save", "{ck.save}", "--resume", "{ck.copy}"],
     "holds the checkpoints of another run", None),
    # --- disk offload on a file system with no storage ------------------------------------------------------
    (["train", "--model", "tiny", "--steps", "2", "--offload", "disk", "--offload-dir", "/proc/1/offload"],
     "--offload-dir /proc/1/offload:", None),
]
