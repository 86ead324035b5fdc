"""What each rank runs in tests/test_family_parallel.py: a module of its own, so that the ranks
import neither transformers nor the test modules."""

import contextlib
import io

from strata.cli import main as strata_main
from strata.config import train_config
from strata.train.trainer import train

PROMPT_IDS, NEW_TOKENS = "5,17,42", 40


def fp64_losses(checkpoint: str, **layout) -> list[float]:
    settings = dict(init_from=checkpoint, dtype="fp64", steps=6, micro_batch=2, global_batch=4, seq_len=32, lr=3e-3,
                    seed=3, progress=False, eval_batches=1, peak_flops=1e10)
    return train(train_config(**{**settings, **layout}))["losses"]


def greedy_tokens(checkpoint: str, tp: int = 1, pp: int = 1) -> str:
    """What `strata generate` prints on this rank (only the rank that samples prints)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert strata_main(["generate", "--checkpoint", checkpoint, "--prompt-ids", PROMPT_IDS, "--max-new-tokens",
                            str(NEW_TOKENS), "--temperature", "0", "--dtype", "fp64", "--tp", str(tp),
                            "--pp", str(pp)]) == 0
    return out.getvalue()


def on_each_rank(checkpoint: str, layout: dict) -> tuple[list[float], str]:
    losses = fp64_losses(checkpoint, **layout)
    generates = layout.keys() <= {"tp", "pp"}  # generation runs under tp and pp (it ends the process group)
    return losses, greedy_tokens(checkpoint, layout.get("tp", 1), layout.get("pp", 1)) if generates else ""




def deepseek_run(layout: dict, steps: int = 4, **extra) -> tuple[list[float], dict[str, list[float]], list]:
    """tiny-deepseek (V3's routing with the balancing bias) trained in fp64 under `layout`: the
    losses, every expert bias at the end (gathered over the layout), and each step's expert loads."""
    settings = dict(model="tiny-deepseek", dtype="fp64", steps=steps, micro_batch=2, global_batch=8, seq_len=16,
                    lr=3e-3, seed=3, progress=False, eval_batches=1, peak_flops=1e10)
    summary = train(train_config(**{**settings, **layout, **extra}), keep_state=True)
    biases = {name: value.tolist() for name, value in summary["state"].items()
              if name.endswith("e_score_correction_bias")}
    return summary["losses"], biases, [record["expert_load"] for record in summary["records"]]
