"""Small documents and a Hugging Face model directory with their tokenizer, for the data and
fine-tuning tests (tests/test_data.py, tests/test_families.py)."""

import json

DOCUMENTS = ["the cat sat on the mat", "a dog ran", "the end of the story"] * 20


def model_tokenizer_dir(root, vocab_size: int = 251, add_bos: bool = True):
    """A Hugging Face model directory as far as data prepare reads it: a word-piece-sized BPE with
    Llama's special tokens (<unk> 0, <s> 1, </s> 2), a post-processor that puts <s> before a text
    (as Llama's and Gemma's do), and config.json's vocabulary and BOS/EOS ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(DOCUMENTS, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"],
                                                                 show_progress=False))
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    root.mkdir()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size, "bos_token_id": 1,
                                                  "eos_token_id": [2, 0]}))
    return root


def write_sources(root, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (root / "docs.jsonl").write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(DOCUMENTS)))
    pq.write_table(pa.table({field: DOCUMENTS}), root / "docs.parquet")
    return [str(root / "docs.jsonl"), str(root / "docs.parquet")]
