"""Which layouts strata runs for a model: the one check that `strata train`, `strata plan` (its
search and `--layout`), `--parallel auto` and generation all call, so the planner never offers a
layout the trainer refuses, nor the other way round.

Errors name the layout's field (`tp`, `pp_split`, ...) and its value; each command renders the
field as its own flag (`--tp 3` for train, `tp=3` inside plan's `--layout`)."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field

from strata.errors import ConfigError
from strata.model.config import ModelConfig
from strata.rules.checkpointing import parse as parse_checkpointing
from strata.rules.compression import COMPRESSIONS
from strata.rules.context import check_context
from strata.rules.experts import check_experts
from strata.rules.layout_text import describe
from strata.rules.limits import check_ceiling
from strata.rules.pipeline_cut import PipelineLayout, make_layout
from strata.rules.schedules import SCHEDULES
from strata.rules.tensor_modes import TensorGrid, check_grid, grid_of

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_TARGETS = ("none", "disk", "cpu")  # where the optimizer's states live and its step runs
PARAM_OFFLOAD_TARGETS = ("none", "cpu", "disk")  # where ZeRO-3's shards and gradients live (ZeRO-Infinity)
ACTIVATION_OFFLOAD_TARGETS = ("none", "cpu")  # checkpointed block inputs: host memory (a file on a CPU device)
# What data-parallel traffic travels in: "fp32", the master tensors' own dtype (fp64 in an fp64
# run), or bf16, half the bytes. reduce: the gradients; gather: the parameters ZeRO-1/2 gather
# after the step and ZeRO-3 before each use, which the layers then compute with.
TRANSFER_DTYPES = ("fp32", "bf16")


def setting(default, help: str, key: str | None = None, auto: str = "kept", show: str = "changed",
            bare: tuple = ()):
    """A layout field: its default (the planner's; a run's config has its own, strata/config.py),
    the one text that explains it (the flag's help, docs/config.md), and how the generic code
    treats it: `key`, its name inside a `--layout` string (default: the field's name; "" keeps it
    out of that grammar); `auto`, "planned" when `--parallel auto` chooses it (giving it then is
    refused) or "kept" when the user's value goes into the chosen layout; `show`, when
    `describe()` writes it: "always", "changed" (differs from the default) or "pipeline" (pp > 1);
    `bare`, values written (and read) without their key."""
    return dataclass_field(default=default,
                           metadata={"help": help, "key": key, "auto": auto, "show": show, "bare": bare})


@dataclass(frozen=True)
class Layout:
    """Every degree and choice of a run's layout, the one place they are named: the `[layout]`
    section of a run's config and its flags, `strata plan --layout`, a checkpoint's metadata and
    `--parallel auto`'s choice are all generated from these fields (strata/rules/layout_text.py).
    A field added here is a flag, a TOML key, a `--layout` key and a checkpoint entry at once."""
    dp: int | None = setting(1, "data-parallel degree (default: world / (cp x tp x pp))", auto="planned",
                             show="always")
    cp: int = setting(1, "context-parallel degree: each sequence split over this many ranks (2 x cp chunks, rank r "
                         "holding chunks r and 2cp-1-r), for long sequences", auto="planned")
    cp_mode: str = setting("ring", "how context parallelism attends: ring (K and V passed around the cp ranks, "
                                   "overlapped with attention) | ulysses (all-to-all to a split of the heads; cp must "
                                   "divide heads / tp)", auto="planned")
    ep: int = setting(1, "expert-parallel degree: a mixture's experts split over this many of the data-parallel "
                         "ranks", auto="planned")
    tp: int = setting(1, "tensor-parallel degree", auto="planned", show="always")
    tp_mode: str = setting("1d", "how --tp cuts the matrices: 1d (Megatron) | 2d (q x q grid, SUMMA) | 2.5d (q x q x "
                                 "--tp-depth, Tesseract) | 3d (q x q x q); 2d/2.5d/3d split activations too",
                           auto="planned")
    tp_depth: int = setting(1, "with --tp-mode 2.5d: the grid's depth d (--tp = q x q x d)", auto="planned")
    pp: int = setting(1, "pipeline-parallel degree (stages)", auto="planned", show="always")
    virtual_stages: int = setting(1, "with --schedule interleaved: model chunks per pipeline rank", key="v",
                                  auto="planned")
    zero: int = setting(0, "ZeRO stage 0-3", auto="planned", show="always")
    dp_shard: int | None = setting(None, "hybrid sharding (FSDP's HSDP): ZeRO-1/2/3 shard states over this many "
                                         "adjacent data-parallel ranks (a node's, so that ZeRO's traffic stays on "
                                         "it) and keep dp / dp_shard replicas of them; gradients are "
                                         "reduce-scattered within a shard group and all-reduced across replicas "
                                         "(default: every dp rank, flat ZeRO)", key="shard")
    dp_replicate: int | None = setting(None, "hybrid sharding: the replicas instead (dp / dp_replicate ranks shard "
                                             "each)", key="replicate")
    hpz_partition_size: int = setting(1, "ZeRO++'s hpZ (DeepSpeed's zero_hpz_partition_size) with zero 3: after "
                                         "the forward each rank keeps 1/K of every unit gathered, and the backward "
                                         "gathers it from those K adjacent dp ranks (a node's) alone; K divides dp, "
                                         "1 < K < dp (default 1: off)", key="hpz", auto="planned")
    micro_batch: int = setting(1, "sequences per forward/backward on one rank", key="mb", auto="replaced",
                               show="always")
    schedule: str = setting("1f1b", "pipeline schedule: gpipe | 1f1b | interleaved | zb (zero-bubble ZB-H1) | "
                                    "2bw (PipeDream-2BW) | pipedream | pipedream-vs (vertical sync); the last three "
                                    "asynchronous: stale weights, no flush", auto="planned", show="pipeline",
                              bare=tuple(SCHEDULES))
    sequence_parallel: bool = setting(False, "with --tp: split norms and residuals along the sequence too", key="sp",
                                      auto="planned")
    checkpointing: str = setting("none", "activation checkpointing: none | full | selective | every:K (first K "
                                         "blocks of each chunk)", key="ckpt", auto="planned")
    offload: str = setting("none", "none | cpu | disk: optimizer step in host memory (cpu), or Adam's moments in a "
                                   "file (disk)")
    offload_params: str = setting("none", "none | cpu | disk: ZeRO-Infinity: ZeRO-3's parameter shards and their "
                                          "gradients in host memory or in files under --offload-dir, read in a unit "
                                          "at a time (ZeRO-3: implied by the default --zero 0, on one process too)",
                                  auto="planned")
    offload_activations: str = setting("none", "none | cpu: with --checkpointing full or every:K (not with --pp), the "
                                               "block inputs kept for backward go to host memory (on a GPU) or to a "
                                               "file under --offload-dir (on a CPU device)", auto="planned")
    reduce_dtype: str = setting("fp32", "dtype of the data-parallel gradient reduction: fp32 (the master "
                                        "gradients') or bf16 (half the bytes)", key="reduce")
    gather_dtype: str = setting("fp32", "with ZeRO-1/2/3: dtype the parameters are all-gathered in: fp32 (the "
                                        "masters) or, with --dtype bf16, bf16 (half the bytes; the layers then compute "
                                        "with bf16 weights, as DeepSpeed's bf16 mode and FSDP2's param_dtype do)",
                                key="gather")
    reshard_after_forward: bool = setting(True, "with zero 3 and pp > 1 (FSDP's reshard_after_forward): each unit is "
                                                "gathered for every micro-batch's forward and backward and its "
                                                "gradient reduce-scattered after each backward (least memory, m x the "
                                                "traffic); off: a stage's units stay gathered through its "
                                                "micro-batches, gradients accumulated whole, one gather and one "
                                                "reduce-scatter a step (torchtitan's choice with a pipeline)",
                                          key="reshard", auto="planned")
    pp_split: str | None = setting(None, "blocks per pipeline chunk, e.g. 3,5 (default: balanced by FLOPs)", key="",
                                   auto="planned")  # its commas are the --layout grammar's separator
    capacity_factor: float | None = setting(None, "mixture of experts: each expert takes at most factor x tokens x k "
                                                  "/ n_experts of a micro-batch's tokens, the rest dropped (default: "
                                                  "dropless)")
    compress: str = setting("none", "gradient compression for slow networks (zero 0, onebit and zeroone also zero 1; "
                                    "beside data parallelism, and a synchronous pipeline's stages each compress "
                                    "their own): none | powersgd (each "
                                    "gradient matrix all-reduced as two rank --compress-rank factors, with error "
                                    "feedback and a warm start; Vogels et al. 2019) | onebit (1-bit Adam: after "
                                    "--compress-after steps of AdamW, v frozen and the momentum averaged as one sign "
                                    "bit per element, with error feedback; Tang et al. 2021) | zeroone (0/1 Adam: v "
                                    "updated, on the gradient all-reduced whole, at steps ever further apart "
                                    "(--var-update-scaler); between them the gradient averaged 1-bit; Lu et al. 2022)")
    compress_rank: int = setting(4, "with --compress powersgd: the rank r of the factors (a matrix n x m is "
                                    "compressed where 2r(n + m) < nm)", key="crank")
    compress_after: int = setting(0, "with --compress: steps all-reduced uncompressed first (PyTorch's "
                                     "start_powerSGD_iter, about a tenth of the run; 1-bit Adam's warm-up, after which v "
                                     "is frozen: 1 or more, DeepSpeed suggests 15 to 25 per cent of the run)",
                                  key="cafter")
    var_update_scaler: int = setting(16, "with --compress zeroone: kappa, v's updates at each spacing before it "
                                         "doubles (DeepSpeed's var_update_scaler)", key="kappa")

    @property
    def grid(self) -> TensorGrid:
        return grid_of(self.tp_mode, self.tp, self.tp_depth)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shards(self) -> int:
        """The ranks ZeRO shards the states over: all of the replicas, or with hybrid sharding a
        group of dp_shard (dp / dp_replicate) of them."""
        if self.dp_shard:
            return self.dp_shard
        return self.replicas // self.dp_replicate if self.dp_replicate else self.replicas

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are averaged (and ZeRO shards):
        the data-parallel ranks and, within each, the context-parallel ones."""
        return self.dp * self.cp

    def describe(self) -> str:
        """The layout as `strata plan --layout` reads it back (strata/rules/layout_text.py)."""
        return describe(self)


def data_parallel_degree(world_size: int, cp: int = 1, tp: int = 1, pp: int = 1) -> int:
    """The data-parallel degree that fills the world once cp, tp and pp are set (the degrees
    multiply to the world size: check_layout refuses a product that does not divide it)."""
    return world_size // (cp * tp * pp)


def check_transfer_dtypes(reduce_dtype: str, gather_dtype: str, precision: str) -> None:
    """What data-parallel traffic travels in, against the run's dtype (a strata/rules/dtypes.py
    name): no bf16 traffic in an fp64 run, and bf16 gathers only under bf16 compute (the layers
    compute with the gathered weights; fp32 or fp16 compute would meet bf16 weights)."""
    for field, value in (("reduce_dtype", reduce_dtype), ("gather_dtype", gather_dtype)):
        if value not in TRANSFER_DTYPES:
            raise ConfigError(f"valid: {', '.join(TRANSFER_DTYPES)}", field, value)
        if value != "fp32" and precision == "fp64":
            raise ConfigError("not with dtype fp64", field, value)
    if gather_dtype != "fp32" and precision != "bf16":
        raise ConfigError(f"only with dtype bf16 (the layers compute with the gathered weights; dtype is {precision})",
                          "gather_dtype", gather_dtype)


def check_workload(model: ModelConfig, seq_len: int, global_batch: int) -> None:
    """The sequence fits the model's context, and a step has at least one sequence."""
    if not 1 <= seq_len <= model.max_seq_len:
        raise ConfigError(f"must be between 1 and the model's max_seq_len {model.max_seq_len}", "seq_len", seq_len)
    if global_batch < 1:
        raise ConfigError("must be >= 1", "global_batch", global_batch)
    check_ceiling("global_batch", global_batch)


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Can a model of this shape be split over tp ranks? (training and generation)"""
    if tp < 1:
        raise ConfigError("must be >= 1", "tp", tp)
    if model.n_heads % tp:
        raise ConfigError(f"must divide the model's {model.n_heads} attention heads", "tp", tp)
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ConfigError(f"must divide the model's {model.kv_heads} KV heads or be a multiple of them", "tp", tp)
    if model.d_ff % tp:
        raise ConfigError(f"must divide the model's d_ff {model.d_ff}", "tp", tp)
    for name, width in (("expert width", model.expert_width if model.moe else 0), ("shared expert's width",
                                                                                    model.shared_d_ff)):
        if width % tp:
            raise ConfigError(f"must divide the model's {name} {width}", "tp", tp)


def check_schedule(layout: Layout) -> None:
    """The schedule's name, and virtual stages where (and only where) it runs several chunks per rank."""
    if layout.schedule not in SCHEDULES:
        raise ConfigError(f"valid: {', '.join(SCHEDULES)}", "schedule", layout.schedule)
    spec = SCHEDULES[layout.schedule]
    if layout.virtual_stages < 1:
        raise ConfigError("must be >= 1", "virtual_stages", layout.virtual_stages)
    if spec.virtual_stages and layout.pp > 1 and layout.virtual_stages < 2:
        raise ConfigError(f"needs virtual_stages 2 or more (got {layout.virtual_stages})", "schedule", layout.schedule)
    if layout.virtual_stages != 1 and not (spec.virtual_stages and layout.pp > 1):
        raise ConfigError(f"only with pp 2 or more and a schedule that runs several chunks per rank "
                          f"({', '.join(n for n, s in SCHEDULES.items() if s.virtual_stages)})",
                          "virtual_stages", layout.virtual_stages)


def check_pipeline(model: ModelConfig, layout: Layout, seq_len: int) -> PipelineLayout | None:
    """The schedule and the cut into pp x virtual-stages chunks; the cut, when pp > 1. ZeRO-2 under a
    pipeline reduce-scatters once a step, after the schedule; ZeRO-3 gathers per micro-batch or keeps
    a stage's units gathered through the step (reshard_after_forward)."""
    check_schedule(layout)
    if not layout.reshard_after_forward and not (layout.zero == 3 and layout.pp > 1):
        raise ConfigError(f"only with zero 3 and pp 2 or more (zero is {layout.zero}, pp {layout.pp}): it keeps "
                          f"a pipeline stage's units gathered through its micro-batches", "reshard_after_forward",
                          False)
    if layout.pp == 1:
        if layout.pp_split:
            raise ConfigError("only with pp 2 or more", "pp_split", layout.pp_split)
        return None
    if layout.zero == 3 and SCHEDULES[layout.schedule].splits_backward:
        raise ConfigError(f"not with zero 3: ZeRO-3 gathers a unit for its backward and reduce-scatters its gradient "
                          f"when backward completes it, and {layout.schedule} computes the weight gradients later "
                          f"(W); use 1f1b, gpipe or interleaved, or zero 1 or 2", "schedule", layout.schedule)
    return make_layout(model, layout.pp, layout.virtual_stages, seq_len, layout.pp_split)


def check_layout(model: ModelConfig, layout: Layout, world_size: int, seq_len: int,
                 global_batch: int) -> PipelineLayout | None:
    """Raise ConfigError (naming the field) unless strata runs `layout` for this model, world
    size, sequence length and global batch. Returns the pipeline cut (None without a pipeline)."""
    for field in ("dp", "cp", "tp", "pp", "micro_batch"):
        if getattr(layout, field) < 1:
            raise ConfigError("must be >= 1", field, getattr(layout, field))
    check_ceiling("micro_batch", layout.micro_batch)
    if layout.world_size != world_size:
        sizes = ("dp", "cp", "tp", "pp") if layout.cp > 1 else ("dp", "tp", "pp")
        raise ConfigError(f"{' x '.join(sizes)} = {' x '.join(str(getattr(layout, n)) for n in sizes)} = "
                          f"{layout.world_size}, but the world size is {world_size}; the product must equal it",
                          "dp", layout.dp)
    check_workload(model, seq_len, global_batch)
    if layout.zero not in ZERO_STAGES:
        raise ConfigError(f"valid: {', '.join(map(str, ZERO_STAGES))}", "zero", layout.zero)
    check_offload(layout)
    if layout.zero and layout.replicas == 1 and not (layout.zero == 3 and layout.offload_params != "none"):
        raise ConfigError("ZeRO shards states across data-parallel ranks, and dp is 1; use zero 0, or more "
                          "processes with dp > 1 (or offload_params cpu|disk: ZeRO-Infinity on one process)",
                          "zero", layout.zero)
    grid_of(layout.tp_mode, layout.tp, layout.tp_depth)  # sizes the mode takes (a depth only with 2.5d)
    if layout.tp_mode == "1d":
        check_tensor_parallel(model, layout.tp)
    else:
        check_grid(model, layout.grid, layout.micro_batch)
        check_grid_layout(layout)
    if layout.sequence_parallel and layout.tp == 1:
        raise ConfigError("needs tp 2 or more", "sequence_parallel", True)
    if layout.sequence_parallel and seq_len % layout.tp:
        raise ConfigError(f"must be a multiple of tp {layout.tp} with sequence parallelism", "seq_len", seq_len)
    parse_checkpointing(layout.checkpointing)
    if layout.reduce_dtype != "fp32" and layout.replicas == 1:
        raise ConfigError("sets the dtype of data-parallel reductions, and dp is 1", "reduce_dtype", layout.reduce_dtype)
    if layout.gather_dtype != "fp32" and layout.zero == 0:
        raise ConfigError("sets the dtype ZeRO-1/2/3 gather parameters in (the weights the layers compute with), "
                          "and zero is 0", "gather_dtype", layout.gather_dtype)
    if global_batch % (layout.micro_batch * layout.dp):
        raise ConfigError(f"must be a multiple of micro_batch {layout.micro_batch} x dp {layout.dp} = "
                          f"{layout.micro_batch * layout.dp}", "global_batch", global_batch)
    check_experts(model, layout.ep, layout.dp, layout.zero, layout.tp_mode, layout.sequence_parallel,
                  layout.capacity_factor, layout.offload_params)
    check_context(model, layout.cp, layout.cp_mode, layout.tp, layout.tp_mode, layout.sequence_parallel, seq_len)
    check_asynchronous(model, layout, global_batch)
    check_compression(layout)
    check_hybrid_sharding(layout)
    check_hpz(layout)
    return check_pipeline(model, layout, seq_len)


def check_hpz(layout: Layout) -> None:
    """--hpz-partition-size K: ZeRO-3 with a secondary copy over K adjacent dp ranks (dp and tp alone)."""
    k = layout.hpz_partition_size
    if k == 1:
        return
    refusals = [(k < 1 or layout.dp % k or not 1 < k < layout.dp, f"must divide dp {layout.dp} and lie between 2 and "
                 f"dp - 1 (1: off)"), (layout.zero != 3, f"keeps a copy of ZeRO-3's parameters; zero is {layout.zero}"),
                (layout.cp > 1 or layout.pp > 1 or layout.ep > 1, "runs with data and tensor parallelism for now "
                 "(cp, pp and ep 1)"), (layout.offload_params != "none", "not with offload_params"),
                (layout.shards < layout.replicas, "not with hybrid sharding (its shard group is a node's already)")]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(reason, "hpz_partition_size", k)


def check_hybrid_sharding(layout: Layout) -> None:
    """--dp-shard N / --dp-replicate M: N x M = dp, ZeRO's states over the N adjacent ranks, at each
    (pp, tp) place: beside a pipeline each stage shards its own parameters over its shard groups."""
    shard, replicate = layout.dp_shard, layout.dp_replicate
    if shard is None and replicate is None:
        return
    field, value = ("dp_shard", shard) if shard is not None else ("dp_replicate", replicate)
    for name, given in (("dp_shard", shard), ("dp_replicate", replicate)):
        if given is not None and (given < 1 or layout.dp % given):
            raise ConfigError(f"must divide dp {layout.dp}", name, given)
    if shard is not None and replicate is not None and shard * replicate != layout.dp:
        raise ConfigError(f"x dp_replicate {replicate} must equal dp {layout.dp}", "dp_shard", shard)
    if layout.shards < 2:
        raise ConfigError(f"leaves {layout.shards} rank to shard over; ZeRO needs 2 or more (or zero 0)", field, value)
    refusals = [(layout.zero == 0, "shards ZeRO's states, and zero is 0 (use zero 1, 2 or 3)"),
                (layout.cp > 1 or layout.ep > 1,
                 "runs with data, tensor and pipeline parallelism for now (cp and ep 1)"),
                (layout.offload_params != "none", "not with offload_params (ZeRO-Infinity shards over every rank)")]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(reason, field, value)


def check_compression(layout: Layout) -> None:
    """PowerSGD (strata/parallel/powersgd.py) replaces ZeRO-0's all-reduce of fp32 gradients;
    1-bit and 0/1 Adam (strata/parallel/onebit_adam.py) ZeRO-0's or ZeRO-1's reduction."""
    if layout.compress not in COMPRESSIONS:
        raise ConfigError(f"valid: {', '.join(COMPRESSIONS)}", "compress", layout.compress)
    if layout.compress != "powersgd" and layout.compress_rank != 4:
        raise ConfigError("only with --compress powersgd", "compress_rank", layout.compress_rank)
    if layout.compress != "zeroone" and layout.var_update_scaler != 16:
        raise ConfigError("only with --compress zeroone", "var_update_scaler", layout.var_update_scaler)
    if layout.compress in ("none", "zeroone") and layout.compress_after != 0:  # 0/1 Adam has no warm-up
        raise ConfigError("only with --compress powersgd or onebit", "compress_after", layout.compress_after)
    if layout.compress == "none":
        return
    if layout.compress == "onebit" and layout.compress_after < 1:
        raise ConfigError("1-bit Adam freezes Adam's second moment after a warm-up of plain AdamW: 1 step or more "
                          "(DeepSpeed's freeze_step; its tutorial suggests 15 to 25 per cent of the run)", "compress_after",
                          layout.compress_after)
    check_ceiling("compress_rank", layout.compress_rank)
    check_ceiling("compress_after", layout.compress_after)
    check_ceiling("var_update_scaler", layout.var_update_scaler)
    for name in ("compress_rank", "var_update_scaler"):
        if getattr(layout, name) < 1:
            raise ConfigError("must be >= 1", name, getattr(layout, name))
    if layout.compress_after < 0:
        raise ConfigError("must be >= 0", "compress_after", layout.compress_after)
    onebit = layout.compress in ("onebit", "zeroone")
    refusals = [(layout.replicas == 1, "compresses the data-parallel reduction, and dp is 1"),
                (layout.zero != 0 and not onebit, f"replaces ZeRO-0's all-reduce; zero is {layout.zero} (use zero 0)"),
                # the 1-bit rules compress the whole momentum or gradient: ZeRO-1 shards the update
                # after them, ZeRO-2/3 keep no whole gradient
                (layout.zero > 1, f"replaces ZeRO-0's or ZeRO-1's reduction; zero is {layout.zero} (use zero 0 or 1)"),
                (layout.gather_dtype != "fp32", "averages fp32 momenta and gradients; leave --gather-dtype at fp32"),
                (layout.dp_shard is not None or layout.dp_replicate is not None,
                 "not with hybrid sharding (--dp-shard, --dp-replicate): it compresses over every dp rank"),
                (layout.reduce_dtype != "fp32", "compresses fp32 gradients; leave --reduce-dtype at fp32"),
                (layout.ep > 1, "not with expert parallelism (the experts' reduction is apart)"),
                # each rank would factor its own slice (tp) or a partial gradient of its chunks (cp):
                # rules not built nor tested yet. Beside a pipeline each stage compresses its own
                # parameters over its dp group (PowerSGD per matrix, seeded by name; 1-bit and 0/1
                # Adam over the stage's flat buffer), a tied embedding's copies alike: pp is built
                (layout.tp > 1 or layout.cp > 1, "runs with data parallelism alone for now (tp and cp 1; "
                                                 "beside a pipeline too)"),
                (layout.pp > 1 and SCHEDULES[layout.schedule].asynchronous,
                 f"not with schedule {layout.schedule} (the weight versions it stashes are not built for it)")]
    if onebit:  # an optimizer of its own, holding the moments on the device
        refusals += [(layout.offload != "none", f"runs its own optimizer on the device; not with offload "
                                                f"{layout.offload}"),
                     (SCHEDULES[layout.schedule].asynchronous, f"not with schedule {layout.schedule} (the "
                                                               f"weight versions it stashes are not built for it)")]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(reason, "compress", layout.compress)


def check_grid_layout(layout: Layout) -> None:
    """What multi-dimensional tensor parallelism composes with (the model's side: check_grid)."""
    mode = f"with tp_mode {layout.tp_mode}"
    if layout.sequence_parallel:
        raise ConfigError(f"not {mode}: it splits the activations between layers already", "sequence_parallel", True)
    if layout.offload_params != "none":  # before zero: parameter offload alone sets zero 3
        raise ConfigError(f"not {mode} (it needs ZeRO-3)", "offload_params", layout.offload_params)
    if layout.zero == 3:
        raise ConfigError(f"not {mode}: its layers gather their weight blocks themselves; valid: zero 0, 1, 2",
                          "zero", 3)
    if SCHEDULES[layout.schedule].asynchronous and layout.pp > 1:
        raise ConfigError(f"not {mode}: the asynchronous schedules run with tp_mode 1d", "schedule", layout.schedule)


def check_offload(layout: Layout) -> None:
    """Where states and activations may go: the optimizer's (any stage), ZeRO-3's shards (ZeRO-
    Infinity: with zero 3, not with pipeline stages, whose schedules interleave micro-batches), checkpointed
    activations (there must be checkpointing)."""
    for field, valid in (("offload", OFFLOAD_TARGETS), ("offload_params", PARAM_OFFLOAD_TARGETS),
                         ("offload_activations", ACTIVATION_OFFLOAD_TARGETS)):
        if getattr(layout, field) not in valid:
            raise ConfigError(f"valid: {', '.join(valid)}", field, getattr(layout, field))
    if layout.offload_params != "none":
        if layout.zero != 3:
            raise ConfigError(f"streams ZeRO-3's parameter shards: needs zero 3 (zero is {layout.zero}; leave it "
                              f"at 0 and offload_params implies 3)", "offload_params", layout.offload_params)
        if layout.pp > 1:
            raise ConfigError(f"not with pp {layout.pp}: it streams ZeRO-3's shards a unit at a time for one "
                              f"micro-batch, and a pipeline's schedule interleaves them", "offload_params",
                              layout.offload_params)
    if layout.offload_activations != "none":
        if layout.checkpointing in ("none", "selective"):
            raise ConfigError(f"moves the block inputs that activation checkpointing keeps; needs checkpointing full "
                              f"or every:K (checkpointing is {layout.checkpointing})", "offload_activations",
                              layout.offload_activations)
        if layout.pp > 1:  # a pipeline holds several micro-batches' inputs, and 2bw/pipedream never drain
            raise ConfigError(f"not with pp {layout.pp}: the tier is sized for one micro-batch at a time",
                              "offload_activations", layout.offload_activations)


def check_asynchronous(model: ModelConfig, layout: Layout, global_batch: int) -> None:
    """What the asynchronous schedules (2bw, pipedream) run with; their weight stashing points the
    parameters at other storage between a forward and its backward."""
    spec = SCHEDULES.get(layout.schedule)
    if spec is None or not spec.asynchronous:
        return
    if model.moe:
        raise ConfigError("not with a mixture of experts: the router's auxiliary loss is scaled per synchronous "
                          "step", "schedule", layout.schedule)
    if layout.zero > 1:
        raise ConfigError(f"not with --schedule {layout.schedule}: ZeRO-2/3 reduce (and ZeRO-3 gathers) the "
                          f"parameters the stashed weight versions stand in for; use zero 0 or 1", "zero", layout.zero)
    if layout.offload != "none":
        raise ConfigError(f"not with --schedule {layout.schedule} (the optimizer updates the newest weights on the "
                          f"device while stashed versions compute); use offload none", "offload", layout.offload)
    if spec.update_per_micro_batch and global_batch != layout.micro_batch * layout.dp:
        raise ConfigError(f"--schedule {layout.schedule} updates the weights after every micro-batch: the global "
                          f"batch must be micro_batch x dp = {layout.micro_batch * layout.dp}", "global_batch",
                          global_batch)
    apart = spec.tied_apart(layout.pp)
    if apart and model.tie_embeddings:
        raise ConfigError(f"not with a tied embedding: its two copies, on the first and the last stage, would "
                          f"compute with versions {apart} updates apart, which no single process can reproduce; "
                          f"use --schedule 2bw or pipedream-vs", "schedule", layout.schedule)
