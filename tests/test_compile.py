"""--compile: torch.compile of every block gives the eager run's losses and weights (fp32, 1e-5)
on one process with checkpointing and under layouts whose collectives sit inside the blocks
(tensor + sequence parallel) or around them (ZeRO-3's gathers, the pipeline's sends); its time is
reported once in the metrics. (Zero-bubble with --compile is refused: tests/test_bad_input.py.)"""

import json

import pytest
import torch

from strata.config import train_config
from strata.train import trainer

from distributed import run_on_ranks

BASE = dict(model="tiny", seq_len=32, steps=3, micro_batch=2, global_batch=4, progress=False, peak_flops=1e10,
            eval_batches=1, dtype="fp32", seed=3)


def _eager_and_compiled(layout, metrics_dir=None):
    torch._dynamo.reset()  # each rank compiles afresh: the cache from an earlier test is not counted
    out = []
    for compile in (False, True):
        metrics = f"{metrics_dir}/{int(compile)}.jsonl" if metrics_dir else None
        s = trainer.train(train_config(**{**BASE, **layout}, compile=compile, metrics=metrics), keep_state=True)
        out.append((s["losses"], s["state"], s.get("compile_s")))
    return out


def _assert_close(eager, compiled):
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=0)
    # Inductor's fused kernels sum in another order; Adam divides by sqrt(v), so an element whose
    # gradient is near zero moves by a rounding-sized fraction of lr (1e-3) rather than of itself.
    for name, value in eager[1].items():
        torch.testing.assert_close(compiled[1][name], value, rtol=1e-5, atol=2e-5, msg=name)


def test_compiled_blocks_train_as_eager_and_report_the_compile_time_once(tmp_path):
    eager, compiled = _eager_and_compiled(dict(checkpointing="full"), str(tmp_path))
    _assert_close(eager, compiled)
    assert eager[2] is None and compiled[2] > 0
    records = [json.loads(line) for line in open(tmp_path / "1.jsonl")]
    assert [r["compile_s"] for r in records if r["kind"] == "compile"] == [compiled[2]]
    assert not any(r["kind"] == "compile" for r in map(json.loads, open(tmp_path / "0.jsonl")))


@pytest.mark.parametrize("layout", [dict(tp=2, sequence_parallel=True), dict(dp=2, zero=3, global_batch=8),
                                    dict(pp=2, schedule="interleaved", virtual_stages=2, global_batch=8)])
def test_compiled_blocks_train_as_eager_under_layouts(layout):
    for eager, compiled in run_on_ranks(_eager_and_compiled, 2, layout, timeout=400):
        _assert_close(eager, compiled)




def test_compiled_blocks_train_as_eager_under_2d_tensor_parallelism():
    """The grid's collectives (inside every linear layer and norm) stay out of the compiled graphs."""
    for eager, compiled in run_on_ranks(_eager_and_compiled, 4, dict(tp=4, tp_mode="2d"), timeout=400):
        _assert_close(eager, compiled)
