"""What one transformer block keeps for backward, measured the way every activation-memory test
measures it: saved-tensor hooks counting only while block 0 runs, in one forward of tiny
(b = 2 unless given, s = 64, fp32) set up by the trainer with the given settings."""

from strata.config import train_config
from strata.memory.activations import count_saved_activations
from strata.train import trainer


def saved_bytes_of_first_block(**settings) -> int:
    settings = {"micro_batch": 2, **settings}
    run = trainer.setup(train_config(model="tiny", seq_len=64, global_batch=settings["micro_batch"], progress=False,
                                    peak_flops=1e10, **settings))
    inputs, targets = run.train_data.batch(0)
    with count_saved_activations(run.model) as saved:
        saved.active = False
        block = run.model.blocks["0"]
        block.register_forward_pre_hook(lambda *a: setattr(saved, "active", True))
        block.register_forward_hook(lambda *a: setattr(saved, "active", False))
        run.model(inputs, targets)
    return saved.bytes
