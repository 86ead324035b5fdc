"""The command line: every subcommand's flags. The train flags come from TrainConfig's fields and
their help (strata/config.py), so a setting is a flag and a TOML key with one text explaining it.
Nothing here imports torch: parsing and `--help` stay quick."""

from __future__ import annotations

import argparse
from dataclasses import MISSING

from strata.config import LAYOUT_SECTION, default_of, is_layout_setting, setting_fields
from strata.errors import ConfigError
from strata.plan.goodput import FAILURE_RATE, RESTART_MINUTES, STORAGE_BANDWIDTH
from strata.rules.constants import BUCKET_MB, DEFAULT_EFFICIENCY
from strata.rules.dtypes import DTYPES
from strata.rules.schedules import SCHEDULES

DTYPE_NAMES = tuple(DTYPES)
# `strata plan`'s defaults for the flags that only one of its modes reads, filled in once the
# other mode's flags are known not to be given (strata/cli/plan.py refuses those)
PLAN_DEFAULTS = {"network": "ib-200", "nics_per_node": 1, "global_batch": 512, "optimizer": "adamw", "batch": 1}
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "sendrecv")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints the usage too)
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped in `--help` by section as the config file is (the layout's
    fields in their own group, as its own [layout] table)."""
    parser.add_argument("--config", help="TOML file with the same keys as the flags (the layout's under [layout])")
    parser.add_argument("--spec", help=argparse.SUPPRESS)  # the resolved run a launcher hands its ranks
    group = parser
    for name, f in setting_fields().items():
        section = LAYOUT_SECTION if is_layout_setting(name) else f.metadata.get("section")
        if section and (group is parser or group.title != section):
            group = parser.add_argument_group(section)
        flag, text, default = "--" + name.replace("_", "-"), f.metadata["help"], default_of(name)
        if f.type == "bool":  # a flag that flips the default
            on = default is False
            group.add_argument(flag if on else f"--no-{name.replace('_', '-')}", dest=name,
                               action="store_const", const=on, default=None,
                               help=text if on else f"turn off: {text}")
            continue
        kind = {"int": int, "float": float}.get(f.type.split(" ")[0], str)
        shown = "" if default in (None, MISSING) else f" (default: {default})"
        group.add_argument(flag, type=kind, default=None, help=f"{text}{shown}")


def add_generate_flags(gen) -> None:
    gen.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a save directory (its latest)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="text (needs the tokenizer saved with the checkpoint); "
                                                          "repeat for a batch of requests")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids, e.g. 1,2,3; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int,
                     help="answer tokens at most (default: 100, or what the model's context leaves)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens (CTRL's)")
    gen.add_argument("--stop", action="append", default=[], help="stop an answer at this text (repeatable); "
                                                                 "answers also stop at the model's end-of-text (EOS)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--nproc", type=int, help="processes to start (default: tp x pp x ep)")
    gen.add_argument("--tp", type=int, default=1, help="split every layer over N processes (tensor parallel)")
    gen.add_argument("--pp", type=int, default=1, help="place the layers on N processes (pipeline stages)")
    gen.add_argument("--ep", type=int, default=1, help="a mixture of experts: split its experts over N processes "
                                                       "(each runs every request; tokens travel to their experts)")
    gen.add_argument("--micro-batches", type=int, help="with --pp: requests in flight at once, in groups "
                                                       "(default: min(pp, prompts))")
    gen.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    gen.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take")
    gen.add_argument("--timing", action="store_true",
                     help="print to stderr: time to the first token, answer tokens, tokens/s")


def add_bench_generate_flags(bench) -> None:
    weights = bench.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", help="a checkpoint directory (or a save directory)")
    weights.add_argument("--model", help="a preset with random weights (seed 0), e.g. small")
    prompt = bench.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", help="text (repeatable; default: two Shakespeare openings)")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated ids (repeatable; default: 4 and 32 "
                                                              "random ids without a tokenizer)")
    bench.add_argument("--lengths", default="16,32,64,128", help="answer lengths in tokens, comma-separated")
    bench.add_argument("--runs", type=int, default=3, help="runs of each prompt and length")
    bench.add_argument("--batch", default="1", help="batch sizes, comma-separated (the prompt repeated)")
    bench.add_argument("--compare", action="store_true",
                       help="also run transformers' generate on the same weights, alternating run by run")
    bench.add_argument("--plot", help="PNG of latency against answer length, with the fitted lines")
    bench.add_argument("--json", action="store_true", help='print {"rows", "fits", "runs"}')
    bench.add_argument("--dtype", choices=DTYPE_NAMES, help="compute dtype (default: the checkpoint's)")
    bench.add_argument("--device", default="cpu", help="cpu | cuda")
    bench.add_argument("--threads", type=int, help="torch compute threads (default: torch's)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="strata", description="Train large language models across many devices.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_train_flags(sub.add_parser("train", help="train a model"))
    for add in (_data, _generate, _convert, _plan, _bench, _launch, _doctor, _calibrate, _plot, _schedule):
        add(sub)
    return parser


def _data(sub) -> None:
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    prep = data_sub.add_parser("prepare", help="text -> tokenizer + token shards")
    prep.add_argument("--source", nargs="+", default=["shakespeare"],
                      help="'shakespeare', .txt, .jsonl or .parquet files, or directories of .txt files")
    prep.add_argument("--text-field", default="text", help="the text's field (.jsonl) or column (.parquet)")
    prep.add_argument("--tokenizer", default="bpe:8192",
                      help="bpe:N to train one, a tokenizer.json, or a Hugging Face model directory (its "
                           "tokenizer.json, BOS and EOS)")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--val-fraction", type=float, default=0.05)


def _generate(sub) -> None:
    add_generate_flags(sub.add_parser("generate", help="sample from a checkpoint: one process, --tp N, --pp N"))


def _convert(sub) -> None:
    conv = sub.add_parser("convert", help="Hugging Face <-> strata checkpoints (Llama, Qwen2/3, Mistral, Gemma, "
                                          "GPT-2, BLOOM)")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="a local Hugging Face model (config.json + safetensors)")
    direction.add_argument("--to-hf", metavar="CKPT", help="a strata checkpoint (or save directory), any layout")
    conv.add_argument("--out", required=True, help="the strata checkpoint directory, or the Hugging Face one")


def _plan(sub) -> None:
    plan = sub.add_parser("plan", help="choose the layout for a model on a cluster: memory, communication, time")
    plan.add_argument("--model", required=True, help="a preset, a strata checkpoint, or a Hugging Face config.json")
    plan.add_argument("--device", default="A100-80G", help="A100-80G, H100-80G, V100-32G, ... or cpu-local (calibrated)")
    plan.add_argument("--nodes", type=int, help="nodes of --gpus-per-node devices (default: 1, or with --days the "
                                                "fewest that finish in time)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (cpu-local: processes)")
    plan.add_argument("--intra", help="link inside a node: nvlink | pcie | GB/s (default: nvlink if the device has it)")
    plan.add_argument("--network", help=f"between nodes: 10gbe | 100gbe | ib-200 | ib-400 | GB/s (default: "
                                         f"{PLAN_DEFAULTS['network']})")
    plan.add_argument("--nics-per-node", type=int, help="network links per node (8 on a DGX A100; default: 1)")
    plan.add_argument("--global-batch", type=int, help=f"sequences per optimizer step (default: "
                                                       f"{PLAN_DEFAULTS['global_batch']})")
    plan.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context)")
    plan.add_argument("--precision", default="bf16", help="bf16 | fp16 (mixed precision, 16 bytes/parameter) | fp32")
    plan.add_argument("--optimizer", help="adamw (two fp32 moments; the default) | sgd (with momentum: one) | lion "
                                           "(one momentum) | adafactor (factored second moment: rows + columns "
                                           "per matrix) | adafactor-momentum (and a first moment)")
    plan.add_argument("--fp8", action="store_true", help="price the blocks' matmuls at the device's FP8 peak "
                      "(Transformer Engine's recipe: bf16 between layers, fp32 masters; planned only, "
                      "`strata train` computes in 16 bits)")
    plan.add_argument("--power-cap", type=float, help="watts per device (nvidia-smi -pl): its compute clock as "
                      "the cube root of the cap over the highest limit; memory-bound work unchanged")
    plan.add_argument("--bucket-mb", type=float, help=f"gradient bucket size (MB) of data parallelism and ZeRO-1/2, as "
                                                      f"`strata train --bucket-mb`: one collective each (default: "
                                                      f"{BUCKET_MB:g})")
    plan.add_argument("--framework", help="price the run as this code base runs it (fused attention, gradient-"
                                          "accumulation fusion, TP overlap, its buckets): strata (default), "
                                          "megatron-lm, megatron-core, megatron-deepspeed, deepspeed, torchtitan")
    plan.add_argument("--layout", help="evaluate one layout instead of searching, e.g. dp=8,tp=8,pp=16,zero=1,mb=1,ckpt=full")
    plan.add_argument("--top", type=int, default=10, help="layouts to show")
    plan.add_argument("--json", action="store_true", help='print {"layouts": [...]}, best first')
    plan.add_argument("--explain", action="store_true", help="why the best layout wins and the others lose")
    plan.add_argument("--chart", help="PNG of the memory breakdown of the layouts shown")
    plan.add_argument("--no-offload", action="store_true", help="leave optimizer offload out of the search")
    plan.add_argument("--allow-async", action="store_true", help="also consider the asynchronous pipeline schedules "
                      "(2bw, pipedream): no bubble, but stale weights change the optimisation")
    plan.add_argument("--profile", help="calibration profile for cpu-local (default: the one `strata calibrate` wrote)")
    plan.add_argument("--inference", action="store_true",
                      help="serving instead of training: weights + KV cache, and the time per output token, per tp x pp")
    plan.add_argument("--batch", type=int, help="--inference: sequences decoded together (default: 1)")
    plan.add_argument("--context", type=int, help="--inference: tokens per sequence so far, prompt + answer "
                                                  "(default: the model's context)")
    plan.add_argument("--serving-stack", help="--inference: whose decode loop sets the fixed cost per layer and step: "
                                              "strata (default: calibrated, else its estimate) | hf-transformers | vllm")
    plan.add_argument("--per-layer-us", type=float, help="--inference: fixed cost per layer and decode step "
                                                         "(default: calibrated, else the stack's: strata 220)")
    plan.add_argument("--per-token-us", type=float, help="--inference: fixed cost once per decode step "
                                                         "(default: calibrated, else the stack's: strata 150)")
    plan.add_argument("--efficiency", type=float, help="every FLOP at this fraction of peak, instead of timing the "
                                                       "work's GEMMs, attention and elementwise kernels on the "
                                                       f"device's curves (--inference: default {DEFAULT_EFFICIENCY})")
    plan.add_argument("--tokens", help="training tokens, e.g. 2T or 300B: adds days, device-hours (and price) per layout")
    plan.add_argument("--price-per-device-hour", type=float, help="with --tokens: the price of the run per layout")
    plan.add_argument("--days", type=float, help="with --tokens, without --nodes: the fewest nodes that train them "
                                                 "within this many days")
    _plan_goodput(plan)


def _plan_goodput(plan) -> None:
    """With --tokens: what the expected run adds to the ideal one (strata/plan/goodput.py)."""
    plan.add_argument("--save-every", help="with --tokens: steps between checkpoint saves, or a time of training "
                                           "(30m, 2h) (default: Young's interval, sqrt(2 x save x time between "
                                           "interruptions))")
    plan.add_argument("--eval-every", type=int, help=f"with --tokens: evaluate every N steps, as `strata train "
                                                     f"--eval-every` (default: {default_of('eval_every')}, at the start "
                                                     f"and the end only)")
    plan.add_argument("--eval-batches", type=int, help=f"with --tokens: global batches each evaluation, as `strata "
                                                       f"train --eval-batches` (default: {default_of('eval_batches')})")
    plan.add_argument("--storage-bandwidth", type=float, help=f"with --tokens: GB/s a node writes and reads "
                                                              f"checkpoints at (default: {STORAGE_BANDWIDTH:g}, "
                                                              f"Llama 3's 2 TB/s over 2,048 nodes)")
    plan.add_argument("--failure-rate", type=float, help=f"with --tokens: interruptions per device-hour (default: "
                                                         f"{FAILURE_RATE:.3g}, Llama 3's 466 in 54 days on 16,384 "
                                                         f"H100s)")
    plan.add_argument("--restart-minutes", type=float, help=f"with --tokens: minutes from an interruption to "
                                                            f"training again, before reading the checkpoint "
                                                            f"(default: {RESTART_MINUTES:g})")


def _bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: collectives, generation latency")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    bc = bench_sub.add_parser("comm", help="collective bandwidth per operation and size, like nccl-tests")
    bc.add_argument("--nproc", type=int, default=2, help="start N local ranks (not under torchrun)")
    bc.add_argument("--ops", default=",".join(COMM_OPS), help="comma-separated operations")
    bc.add_argument("--min-bytes", default="1K", help="smallest message, e.g. 1K")
    bc.add_argument("--max-bytes", default="64M", help="largest message, e.g. 64M")
    bc.add_argument("--factor", type=int, default=4, help="size step between messages")
    bc.add_argument("--iters", type=int, default=10, help="calls timed per size")
    bc.add_argument("--dim", help="run on one mesh dimension's groups: dp | tp | pp (with --tp/--pp)")
    bc.add_argument("--tp", type=int, default=1)
    bc.add_argument("--pp", type=int, default=1)
    bc.add_argument("--device", default="auto", help="auto | cpu | cuda")
    bc.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take")
    bc.add_argument("--json", action="store_true", help='print {"rows": [...]}')

    add_bench_generate_flags(bench_sub.add_parser("generate", help="generation latency against answer length "
                                                                   "(TTFT, TPOT, a fit, a plot; --compare with transformers)"))


def _launch(sub) -> None:
    launch = sub.add_parser("launch", help="start this node's ranks of a multi-node job from a hostfile, "
                                           "or write an sbatch script for Slurm")
    launch.add_argument("--hostfile", help="DeepSpeed-style: one 'HOST slots=N' per line; the first is the master")
    launch.add_argument("--slurm-script", metavar="FILE", help="write an sbatch script for the command instead "
                                                               "(one srun task per rank)")
    launch.add_argument("--nodes", type=int, help="with --slurm-script: nodes of the job")
    launch.add_argument("--gpus-per-node", type=int, help="with --slurm-script: GPUs (ranks) per node")
    launch.add_argument("--socket-ifname", help="with --slurm-script: the network interface for gloo and NCCL "
                                                "(default: the one holding the master's address, found in the job)")
    launch.add_argument("--master-port", type=int, default=29500)
    launch.add_argument("--node-rank", type=int, help="this node's rank (default: found from its addresses)")
    launch.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    launch.add_argument("strata_args", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the strata command to run, e.g. -- train --model small")


def _doctor(sub) -> None:
    doc = sub.add_parser("doctor", help="check this node (and a hostfile's) for what breaks multi-node training")
    doc.add_argument("--hostfile", help="check every host: resolves, not loopback, reachable; and the socket interface")
    doc.add_argument("--bandwidth", action="store_true",
                     help="(launched on every node) measure the inter-node bandwidth and check the planned layout")
    doc.add_argument("--bandwidth-bytes", default="16M", help="all-reduce size for --bandwidth")
    doc.add_argument("--model", help="with --bandwidth: the model the job will train (preset, checkpoint, config.json)")
    doc.add_argument("--layout", help="with --bandwidth: the planned layout, e.g. dp=2 (default: data parallel)")
    doc.add_argument("--device", default="A100-80G", help="the planned job's device (from the planner's table)")
    doc.add_argument("--global-batch", type=int, default=8)
    doc.add_argument("--seq-len", type=int)
    doc.add_argument("--precision", default="bf16")
    doc.add_argument("--flight-recorder", metavar="DIR",
                     help="read a hung job's flight-recorder dumps (one file per rank, e.g. the directory `strata "
                          "launch` names in its last line) and name the collective it hung in")


def _calibrate(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine for the planner's cpu-local device")
    cal.add_argument("--nproc", type=int, default=4, help="measure groups of 1, 2, 4, ... up to N processes")
    cal.add_argument("--model", default="small", help="the preset whose GEMMs and training steps calibrate the kernels")
    cal.add_argument("--out", help="profile file (default: ~/.cache/strata/calibration.json)")
    cal.add_argument("--rounds", type=int,
                     help="measure every process count and the tp steps this many times, spread over the calibration, "
                          "and keep each number's median (default 2, 1 with --quick: quicker, at the mercy of one slow or "
                          "fast spell)")
    cal.add_argument("--quick", action="store_true",
                     help="a rough profile in about a minute: shorter timings, fewer repeats of each collective, "
                          "a 256 MiB disk test, one round, one process measured once")
    cal.add_argument("--disk-dir", help="where to measure the disk: the --offload-dir you will train with "
                                        "(default: the temp directory's strata-offload)")
    cal.add_argument("--inference", action="store_true",
                     help="measure what `plan --inference` needs instead: memory bandwidth and decode overheads")
    cal.add_argument("--device", default="cpu", help="with --inference: cpu | cuda | auto")
    cal.add_argument("--worker", help=argparse.SUPPRESS)
    cal.add_argument("--worker-effort", help=argparse.SUPPRESS)  # the parent's Effort, as JSON


def _plot(sub) -> None:
    plot = sub.add_parser("plot", help="draw the loss curve of a metrics file, or a pipeline trace")
    plot.add_argument("metrics", help="metrics JSONL (--metrics) or pipeline trace JSON (--trace)")
    plot.add_argument("--out", required=True, help="PNG file")


def _schedule(sub) -> None:
    sched = sub.add_parser("schedule", help="simulate a pipeline schedule: bubble per rank, and a picture")
    sched.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    sched.add_argument("--pp", type=int, default=4, help="pipeline stages")
    sched.add_argument("--micro-batches", type=int, default=8)
    sched.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    sched.add_argument("--out", help="PNG file")
