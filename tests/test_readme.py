"""The README's fine-tuning walk-through runs as written, and what it hands to transformers is the
model strata trained: the same logits, the same greedy text, the tokenizer loaded by AutoTokenizer."""

import os
import re
import subprocess
import sys

import torch
import transformers  # the dev extra's: a missing one fails, not skips

from strata.infer.session import load_for_inference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Fine-tuning a Hugging Face model on your own data"


def walkthrough() -> str:
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index(SECTION):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_fine_tuning_walkthrough_runs_and_transformers_loads_the_result(tmp_path):
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    bin_dir = os.path.dirname(sys.executable)  # the environment's python and strata
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", walkthrough()], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # strata's answer (before convert's "wrote tuned-hf"), then transformers' (after it)
    before, after = run.stdout.split("wrote tuned-hf\n")
    ours_text = before[before.rindex("Shall I compare thee"):]
    assert after == ours_text and len(ours_text) > len("Shall I compare thee") + 5, run.stdout

    ours, _ = load_for_inference(str(tmp_path / "tuned"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned-hf")).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tuned-hf"))
    ids = tokenizer("Shall I compare thee, to a summer's day?", return_tensors="pt").input_ids
    with torch.no_grad():
        ours_logits, theirs_logits = ours(ids), theirs(ids).logits
    assert ((ours_logits - theirs_logits).abs().max() / theirs_logits.abs().max()).item() < 1e-5
    assert theirs.config.model_type == "qwen2" and theirs.config.tie_word_embeddings
    assert tokenizer.eos_token == "<|endoftext|>"
