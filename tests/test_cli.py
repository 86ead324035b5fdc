"""What a user types: the `strata` command end to end, in subprocesses."""

import json
import os
import subprocess
import sys

import pytest

STRATA = [sys.executable, "-m", "strata"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def strata(*args, cwd=None, timeout=300):
    return subprocess.run([*STRATA, *map(str, args)], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("text,needle", [
    ('model = "tiny"\nlearning_rat = 0.1\n', "unknown key 'learning_rat'"),
    ('steps = "ten"\n', "steps = 'ten' is not of type int"),
    ('progress = 1\n', "progress = 1 is not of type bool"),
    ('steps = [\n', "not valid TOML"),
])
def test_bad_toml_config_is_one_line_and_exit_code_2(tmp_path, text, needle):
    (tmp_path / "c.toml").write_text(text)
    result = strata("train", "--config", tmp_path / "c.toml")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert needle in result.stderr


def test_prepare_train_generate_plot_end_to_end(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("It was the best of times, it was the worst of times.\n" * 300)
    assert strata("data", "prepare", "--source", text, "--tokenizer", "bpe:300", "--out", tmp_path / "d").returncode == 0
    config = tmp_path / "run.toml"
    config.write_text('model = "tiny"\nseq-len = 32\nsteps = 4\nmicro_batch = 2\nglobal_batch = 4\n'
                      'peak_flops = 1e10\nprogress = false\n')
    result = strata("train", "--config", config, "--data", tmp_path / "d", "--metrics", tmp_path / "m.jsonl",
                    "--save", tmp_path / "ck", "--nproc", 2, "--zero", 3)
    assert result.returncode == 0, result.stderr
    assert "validation loss:" in result.stdout
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert all(r["comm_bytes"] > 0 for r in records if r["kind"] == "train")  # 2 ranks talked
    assert "all_gather/dp" in records[-2]["comm_bytes_by_op"]  # ZeRO-3 gathers parameters
    assert (tmp_path / "ck" / "step_000004" / "tokenizer.json").is_file()

    result = strata("generate", "--checkpoint", tmp_path / "ck", "--prompt", "It was", "--max-new-tokens", 5,
                    "--temperature", 0)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("It was") and len(result.stdout) > len("It was\n")

    result = strata("plot", tmp_path / "m.jsonl", "--out", tmp_path / "loss.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_prompt_text_without_a_tokenizer_is_refused(tmp_path):
    assert strata("train", "--steps", 1, "--global-batch", 2, "--micro-batch", 2, "--seq-len", 16,
                  "--peak-flops", 1e10, "--no-progress", "--save", tmp_path / "ck").returncode == 0
    result = strata("generate", "--checkpoint", tmp_path / "ck", "--prompt", "hi")
    assert result.returncode == 2 and "use --prompt-ids" in result.stderr
    result = strata("generate", "--checkpoint", tmp_path / "ck", "--prompt-ids", "1,2", "--max-new-tokens", 3,
                    "--temperature", 0)
    assert result.returncode == 0 and len(result.stdout.split()) == 5


def test_generate_checks_the_tp_degree_before_starting_processes(tmp_path):
    assert strata("train", "--steps", 1, "--global-batch", 2, "--micro-batch", 2, "--seq-len", 16,
                  "--peak-flops", 1e10, "--no-progress", "--save", tmp_path / "ck").returncode == 0
    result = strata("generate", "--checkpoint", tmp_path / "ck", "--prompt-ids", "1", "--tp", 3)
    assert result.returncode == 2 and result.stderr.strip() == \
        "strata: error: --tp 3: must divide the model's 4 attention heads"


def test_pipeline_trace_and_schedule_pictures(tmp_path):
    result = strata("train", "--nproc", "2", "--pp", "2", "--schedule", "zb", "--steps", "2", "--global-batch", "16",
                    "--micro-batch", "4", "--no-progress", "--trace", tmp_path / "trace.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = strata("plot", tmp_path / "trace.json", "--out", tmp_path / "trace.png")
    assert result.returncode == 0 and (tmp_path / "trace.png").stat().st_size > 10_000, result.stderr
    result = strata("schedule", "--schedule", "1f1b", "--pp", "4", "--micro-batches", "8", "--out", tmp_path / "s.png")
    assert result.returncode == 0 and "idle per rank 0.273, 0.273, 0.273, 0.273" in result.stdout, result.stdout
