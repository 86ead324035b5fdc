"""GPT-J (Wang & Komatsuzaki 2021), for planning only: the `gpt-j-6b` preset's shape (LayerNorm,
RoPE, GELU, biases, untied head) in strata's sequential block. The released model runs attention
and the MLP on the same input in parallel and rotates only 64 features per head, interleaved,
which strata's model does not compute, so it has no Hugging Face conversion. Its modules are
GPT-2's, and so is their split."""

from __future__ import annotations

from strata.model.families.base import Family
from strata.model.families.gpt2 import BLOCK_TENSOR_PARALLEL

NAME = "gptj"

FAMILY = Family(NAME, (), {"embed": "vocabulary", "head": "vocabulary", "final_norm": "input_norm",
                           **BLOCK_TENSOR_PARALLEL})
