"""The planner's view of context parallelism: the K/V ring's and Ulysses' bytes against what real
runs on this machine count (rules/context.py's formula, recomputation included), the model states
sharded over dp x cp and the activations of a rank holding 1/cp of every sequence against the
counted ones, the search over cp and its modes, `--explain`, `strata plan --layout cp=..` /
`--json`, and `--parallel auto`'s flags."""

import functools
import json
import math

import pytest

from strata.cli import main as strata_main
from strata.config import train_config
from strata.errors import ConfigError
from strata.model.presets import get_preset
from strata.plan.cost import Cluster, Workload, estimate
from strata.plan.hardware import get_device
from strata.plan.inputs import build_cluster, workload
from strata.plan.memory import loss_logits_bytes
from strata.plan.report import parse_layout
from strata.plan.search import explain, search
from strata.rules.context import attention_traffic
from strata.rules.layout import Layout
from strata.train.trainer import train

from distributed import SharedLaunches

TINY = dict(model="tiny", vocab_size=251, seq_len=32, steps=1, progress=False, peak_flops=1e10, eval_batches=1,
            seed=7, global_batch=4, micro_batch=2, dtype="fp32")
LAYOUTS = [  # (ranks, the run's settings)
    (2, dict(cp=2)), (2, dict(cp=2, cp_mode="ulysses")),
    (2, dict(cp=2, checkpointing="selective")), (2, dict(cp=2, cp_mode="ulysses", checkpointing="selective")),
    (2, dict(cp=2, checkpointing="full")), (2, dict(cp=2, cp_mode="ulysses", checkpointing="full")),
    (4, dict(cp=2, tp=2, zero=1)),
    (4, dict(cp=2, tp=2, cp_mode="ulysses")),  # 1 KV head per tp rank over 2: repeated to one per query head
    (4, dict(cp=2, tp=2, sequence_parallel=True, cp_mode="ulysses", checkpointing="full")),
]
LLAMA_128K = get_preset("llama3-8b").with_overrides(max_seq_len=131072)  # Llama 3.1 8B's context


def _key(settings: dict) -> tuple:
    return tuple(sorted(settings.items()))


def _baseline(settings: dict) -> dict:
    """The same layout without context parallelism, on 1/cp of the ranks (ZeRO needs dp > 1)."""
    return {k: v for k, v in settings.items() if k not in ("cp", "cp_mode", "zero")}


def _text(settings: dict) -> str:
    """The layout as `strata plan --layout` takes it."""
    names = {"cp": "cp", "cp_mode": "cp_mode", "tp": "tp", "zero": "zero", "checkpointing": "ckpt"}
    return ",".join(["mb=2"] + [f"{names[k]}={v}" for k, v in settings.items() if k in names] +
                    (["sp"] if settings.get("sequence_parallel") else []))


def _record(settings):
    record = train(train_config(**{**TINY, **settings}))["records"][-1]
    return {k: record[k] for k in ("model_state_bytes", "peak_activation_bytes", "comm_bytes_by_op")}


# one group of 2 ranks runs the cp 2 layouts and the tp 2 baselines, one of 4 the cp 2 x tp 2 layouts
_RUNS = SharedLaunches(_record, [(2, tuple(_key(s) for w, s in LAYOUTS if w == 2) +
                                  tuple(dict.fromkeys(_key(_baseline(s)) for w, s in LAYOUTS if w == 4))),
                                 (4, tuple(_key(s) for w, s in LAYOUTS if w == 4))], timeout=300)


def _counted(world: int, settings: dict) -> dict:
    return _RUNS(world, _key(settings))[0] if world > 1 else _one_process(_key(settings))


@functools.lru_cache(maxsize=None)
def _one_process(key: tuple) -> dict:
    return _record(dict(key))


def _tiny_estimate(world: int, text: str):
    work = Workload(get_preset("tiny").with_overrides(vocab_size=TINY["vocab_size"]), TINY["global_batch"],
                    TINY["seq_len"], "fp32")
    return estimate(work, Cluster(get_device("A100-80G"), 1, world, 25e9, 25e9), parse_layout(text, work, world))


def _by_group(counted: dict) -> dict[str, float]:
    groups = {}
    for key, nbytes in counted["comm_bytes_by_op"].items():
        groups[key.split("/")[1]] = groups.get(key.split("/")[1], 0) + nbytes
    return groups


@pytest.mark.parametrize("world,settings", LAYOUTS, ids=lambda v: _text(v) if isinstance(v, dict) else str(v))
def test_predicted_traffic_is_what_a_real_run_sends(world, settings):
    """`strata train --model tiny --cp 2 ...` on gloo ranks here, against `strata plan --layout`: the
    ring's sends or Ulysses' all-to-alls to the byte, recomputation's included (the ring's forward
    again under selective and full; of Ulysses' four, q's, k's and v's again under selective, all
    four under full); the gradients averaged over dp x cp; tp's collectives on the rank's tokens."""
    counted, e = _counted(world, settings), _tiny_estimate(world, _text(settings))
    op = "all_to_all/cp" if settings.get("cp_mode") == "ulysses" else "send/cp"
    assert [k for k in counted["comm_bytes_by_op"] if k.endswith("/cp")] == [op]
    assert e.comm_bytes["cp"] == counted["comm_bytes_by_op"][op]
    sent = _by_group(counted)
    assert e.comm_bytes["dp"] == pytest.approx(sent["dp"], rel=0.01, abs=32)  # the loss's and norm's sums aside
    tp = settings.get("tp", 1)
    grad_norm = 2 * (tp - 1) / tp * 8  # one fp64 sum of squares over the tp group
    assert e.comm_bytes["tp"] == pytest.approx(sent.get("tp", 0) - grad_norm, rel=1e-12, abs=1e-9)


def test_the_traffic_is_the_rules_formula_per_layer_and_micro_batch():
    """The ring moves K and V (cp-1)/cp of the way forward and again backward with their fp32
    gradients; Ulysses 1/cp of q, k, v and the output each way (rules/context.py), per layer and
    micro-batch on the micro-batch's whole sequence; full recomputation sends the forward's again."""
    cfg, m = get_preset("tiny"), TINY["global_batch"] // TINY["micro_batch"]
    tokens = TINY["micro_batch"] * TINY["seq_len"]
    for mode in ("ring", "ulysses"):
        forward, backward = attention_traffic(cfg, 2, mode, 1, tokens, 4, 4)
        text = "mb=2,cp=2" + (",cp_mode=ulysses" if mode == "ulysses" else "")
        assert _tiny_estimate(2, text).comm_bytes["cp"] == cfg.n_layers * m * (forward + backward)
        assert _tiny_estimate(2, text + ",ckpt=full").comm_bytes["cp"] == cfg.n_layers * m * (2 * forward + backward)
    assert "cp" not in _tiny_estimate(2, "mb=2").comm_bytes  # no context parallelism, no cp group


@pytest.mark.parametrize("world,settings", LAYOUTS, ids=lambda v: _text(v) if isinstance(v, dict) else str(v))
def test_predicted_model_states_and_activations_match_a_real_run(world, settings):
    """Model states within 1% (exact but for the norms tp keeps whole; ZeRO-1 shards over the
    dp x cp = 2 ranks with dp 1). Activations within 5% where the formula holds one process's to
    5%: on one rank (tp 1) without full recomputation. With full recomputation a rank keeps the
    blocks' inputs only and the last stage's term dominates, which in fp32 counts the logits twice
    (as if the loss copied them to fp32) and leaves out the final norm's and the head's inputs
    (+20% and +30% here); under tp 2 without sequence parallelism Korthikanti's sbh(10 + 24/t) is
    4.5% below what strata's block keeps. Those layouts are held to their baseline, below."""
    counted, e = _counted(world, settings), _tiny_estimate(world, _text(settings))
    mem = e.memory_breakdown
    assert mem["weights"] + mem["gradients"] + mem["optimizer_states"] == \
        pytest.approx(counted["model_state_bytes"], rel=0.01)
    if settings.get("checkpointing") != "full" and "tp" not in settings:
        assert mem["activations"] == pytest.approx(counted["peak_activation_bytes"], rel=0.05)


@pytest.mark.parametrize("world,settings", LAYOUTS, ids=lambda v: _text(v) if isinstance(v, dict) else str(v))
def test_a_cp_rank_keeps_its_baselines_activations_over_cp_and_what_ulysses_adds(world, settings):
    """What the prediction gets wrong for a cp layout is what it gets wrong for the same layout
    without cp (on 1/cp of the ranks) over cp, to within 1% of the total and the rotary tables:
    so the cp terms themselves, 1/cp of every activation and, under Ulysses without
    recomputation, the attention output's head-split copy and K and V as exchanged
    (rules/context.extra_activation_elements: its kernel keeps them, the output projection the
    all-to-all's result), are what the ranks count. The ring keeps its output once, as one process
    does. Without Ulysses' extra the prediction would be 5% off by this measure. Not modelled: the
    cos and sin a rank gathers for its positions (2 x s/cp x head_dim fp32 numbers, which one
    process slices from a buffer: 2 KB here, a few MB at 128K tokens)."""
    base = _baseline(settings)
    counted = _counted(world, settings)["peak_activation_bytes"]
    cp_error = _tiny_estimate(world, _text(settings)).memory_breakdown["activations"] - counted
    baseline_error = _tiny_estimate(world // 2, _text(base)).memory_breakdown["activations"] - \
        _counted(world // 2, base)["peak_activation_bytes"]
    rotary = 2 * (TINY["seq_len"] // 2) * get_preset("tiny").head_dim * 4  # cos and sin of s/cp positions, fp32
    assert cp_error == pytest.approx(baseline_error / 2, abs=0.01 * counted + rotary)


def _llama(text: str, seq_len: int = 131072, nodes: int = 8):
    work = workload(LLAMA_128K, 64, seq_len, "bf16")
    cluster = build_cluster("H100-80G", nodes, 8, "nvlink", "ib-400", nics_per_node=8)
    return estimate(work, cluster, parse_layout(text, work, cluster.world))


def test_activations_and_compute_fall_as_one_over_cp():
    """Llama 3.1 8B at 131,072 tokens, tp 8 with sequence parallelism: a rank holds 1/cp of every
    activation (exactly; Ulysses without recomputation adds its kernel's copies, themselves 1/cp),
    but the loss's one chunk of fp32 logits, the same at every cp here (16,384 tokens or more).
    At the same dp (twice the devices), it computes about half a micro-batch (GEMMs on b·s/cp tokens,
    attention 1/cp of the layer's), and sends half the tensor-parallel bytes and half the pipeline's
    (its message is 1/cp of a sequence's hidden states)."""
    chunk = loss_logits_bytes(1, 131072, math.ceil(LLAMA_128K.vocab_size / 8))
    for ckpt in ("none", "full", "selective"):
        one = _llama(f"tp=8,sp,mb=1,ckpt={ckpt}").memory_breakdown["activations"]
        for cp in (2, 4, 8):
            e = _llama(f"cp={cp},tp=8,sp,mb=1,ckpt={ckpt}")
            assert e.memory_breakdown["activations"] == pytest.approx((one - chunk) / cp + chunk, rel=1e-12)
    cfg = LLAMA_128K
    # every layer's output copy in the head split (4 heads per tp rank), and K and V as exchanged:
    # 1 KV head per tp rank repeated to the 4 query heads' (cp does not divide 1), in bf16
    extra = cfg.n_layers * 131072 * (4 + 2 * (4 - 1)) * cfg.head_dim * 2
    base = _llama("tp=8,sp,mb=1").memory_breakdown["activations"]
    for cp in (2, 4):  # Ulysses needs cp to divide the 4 heads a tp rank holds
        e = _llama(f"cp={cp},cp_mode=ulysses,tp=8,sp,mb=1")
        assert e.memory_breakdown["activations"] == pytest.approx((base - chunk + extra) / cp + chunk, rel=1e-12)
    plain, split = _llama("dp=4,tp=8,sp,mb=1,pp=2"), _llama("dp=4,cp=2,tp=8,sp,mb=1,pp=2", nodes=16)
    assert split.compute_s == pytest.approx(plain.compute_s / 2, rel=0.05)
    assert split.comm_bytes["pp"] == pytest.approx(plain.comm_bytes["pp"] / 2)
    assert split.comm_bytes["tp"] == pytest.approx(plain.comm_bytes["tp"] / 2, rel=1e-3)


def test_the_ring_hides_behind_attention_and_ulysses_does_not():
    """The ring's hops overlap each block's attention, whose work per token grows with the sequence:
    a group across nodes (cp 8, tp 8 apart) hides most of its time at 131,072 tokens and little at
    4,096 (the last dK/dV hop home is always exposed). Ulysses' all-to-alls are all on the critical
    path. The step's parts still add up to it; the gradients are reduced over the dp x cp ranks."""
    long, short = _llama("cp=8,tp=8,mb=1,zero=1,ckpt=full"), _llama("cp=8,tp=8,mb=1,zero=1,ckpt=full", seq_len=4096)
    hidden = [1 - e.exposed_comm_s["cp"] / e.comm_seconds["cp"] for e in (long, short)]
    assert hidden[0] > 0.9 and hidden[1] < 0.2
    ulysses = _llama("cp=8,cp_mode=ulysses,mb=1,zero=1,ckpt=full")
    assert ulysses.exposed_comm_s["cp"] == ulysses.comm_seconds["cp"] > 0
    for e in (long, short, ulysses):
        assert sum(e.shares().values()) == pytest.approx(1.0)
    assert ulysses.comm_bytes["dp"] == pytest.approx(_llama("dp=64,mb=1,zero=1,ckpt=full").comm_bytes["dp"])


@functools.lru_cache(maxsize=None)
def _search(seq_len: int):
    work = workload(LLAMA_128K, 64, seq_len, "bf16")
    cluster = build_cluster("H100-80G", 8, 8, "nvlink", "ib-400", nics_per_node=8)
    return cluster, *search(work, cluster, offload=False)


def test_a_long_sequence_is_split_and_explain_says_why():
    """Llama 3.1 8B, 64 sequences of 131,072 tokens on 8 nodes of 8 H100: the best splits each
    sequence over cp ranks rather than tensor parallelism across more ranks; a layout that keeps a
    sequence on one rank fits only recomputing every block (strata's loss holds one chunk of the
    logits, not their 100 GB), and is slower; --explain says where its group runs, what it hides,
    and what the best layout without it costs, and why."""
    cluster, ranked, rejected = _search(131072)
    best = ranked[0]
    assert best.layout.cp > 1 and best.layout.micro_batch == 1
    whole = [e for e in ranked if e.layout.tp == 1 and e.layout.cp == 1]
    assert whole and all(e.layout.checkpointing == "full" and e.step_time_s > best.step_time_s for e in whole)
    assert {(e.layout.cp, e.layout.cp_mode) for e in ranked + rejected} >= \
        {(c, m) for c in (2, 4, 8) for m in ("ring", "ulysses")}
    assert all(e.layout.micro_batch == 1 and e.layout.tp_mode == "1d" for e in ranked + rejected if e.layout.cp > 1)
    without = next(e for e in ranked if e.layout.cp == 1)
    assert without.step_time_s > best.step_time_s and without.comm_seconds["tp"] > best.comm_seconds["tp"]
    lines = explain(best, ranked, rejected, cluster)
    line = next(x for x in lines if x.startswith("context parallelism:"))
    assert f"cp {best.layout.cp} ({best.layout.cp_mode}) splits each 131,072-token sequence" in line
    assert "hidden behind the attention" in line or "critical path" in line
    why = next(x for x in lines if x.startswith("without context parallelism the best is"))
    assert without.layout.describe() in why and "Why: tensor parallelism" in why and "131,072 tokens" in why


def test_a_short_sequence_is_not_split_and_explain_says_what_cp_would_cost():
    """The same at 4,096 tokens: whole sequences fit, so the best keeps them on one rank, and
    --explain names the best layout with cp and what it costs."""
    cluster, ranked, rejected = _search(4096)
    best = ranked[0]
    assert best.layout.cp == 1
    line = next(x for x in explain(best, ranked, rejected, cluster) if x.startswith("context parallelism:"))
    rival = next(e for e in ranked if e.layout.cp > 1)
    assert f"the best with it, {rival.layout.describe()}, is" in line and "slower" in line


def test_plan_layout_takes_cp_and_json_and_the_table_report_it(capsys):
    work = workload(LLAMA_128K, 64, 131072, "bf16")
    layout = parse_layout("cp=2,cp_mode=ulysses,tp=4,sp,mb=1,zero=1", work, 64)
    assert layout == Layout(dp=8, tp=4, zero=1, micro_batch=1, sequence_parallel=True, cp=2, cp_mode="ulysses")
    assert layout.describe().startswith("dp=8,cp=2,cp_mode=ulysses,tp=4")
    assert strata_main(["plan", "--model", "llama3-8b", "--nodes", "2", "--seq-len", "8192", "--global-batch", "16",
                        "--json", "--layout", "cp=4,tp=2,mb=1,zero=1,ckpt=full"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert (row["cp"], row["cp_mode"], row["dp"]) == (4, "ring", 2)
    assert row["comm_seconds"]["cp"] >= row["exposed_comm_seconds"]["cp"] > 0 and row["comm_bytes"]["cp"] > 0
    assert strata_main(["plan", "--model", "llama3-8b", "--nodes", "2", "--seq-len", "8192", "--global-batch", "16",
                        "--layout", "cp=4,tp=2,mb=1,zero=1,ckpt=full"]) == 0
    out = capsys.readouterr().out
    assert "dp=2,cp=4,tp=2,pp=1" in out and "tp, dp, pp, cp" in out


@pytest.mark.parametrize("model,seq_len,layout,message", [
    ("llama3-8b", 4096, "cp=3,mb=1", "cp x tp x pp = 3 does not divide the cluster's 64 devices"),
    ("llama3-8b", 4096, "cp=2,cp_mode=zigzag,mb=1", "cp_mode=zigzag: valid: ring, ulysses"),
    ("llama3-8b", 4104, "cp=8,tp=2,mb=1", "--seq-len 4104: must be a multiple of 2 x cp = 16"),
    ("llama3-8b", 4096, "cp=8,tp=8,cp_mode=ulysses,mb=1", "cp_mode=ulysses: cp 8 must divide the 4 attention heads "
                                                          "each tensor-parallel rank holds"),
    ("llama3-8b", 4096, "cp=2,tp=4,tp_mode=2d,mb=2", "tp_mode=2d: not with cp 2"),
    ("mixtral-8x7b", 4096, "cp=2,mb=1", "cp=2: not with a mixture of experts"),
    ("llama3-8b", 4096, "cp=0,mb=1", "cp=0: must be >= 1"),
])
def test_plan_refuses_a_context_layout_the_trainer_refuses_in_one_line(model, seq_len, layout, message, capsys):
    assert strata_main(["plan", "--model", model, "--nodes", "8", "--seq-len", str(seq_len), "--global-batch", "64",
                        "--layout", layout]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_parallel_auto_passes_the_chosen_cp_to_the_ranks(monkeypatch):
    """`strata train --parallel auto` on 8 H100 for two 131,072-token sequences a step: the planner's
    layout splits them, and the ranks' spec (the file the launcher hands them) holds cp and its mode."""
    from strata.train import auto
    from strata.train.spec import RunSpec
    monkeypatch.setattr(auto, "local_cluster", lambda n: build_cluster("H100-80G", 1, n, "nvlink", "ib-400"))
    cfg = train_config(model="llama3-8b", seq_len=131072, global_batch=2, dtype="bf16", parallel="auto")
    chosen, reasons = auto.choose(cfg, 8, LLAMA_128K)
    lay = chosen.layout
    assert lay.cp > 1 and lay.cp * lay.dp * lay.tp * lay.pp == 8
    assert reasons[0].startswith(f"--parallel auto chose dp={lay.dp},cp={lay.cp}")
    spec = RunSpec(chosen, LLAMA_128K, 8)
    received = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert (received.config.layout, received.config.parallel) == (lay, "manual")
    with pytest.raises(ConfigError, match="drop --cp"):
        auto.choose(train_config(model="llama3-8b", seq_len=131072, global_batch=8, parallel="auto", cp=2), 8,
                    LLAMA_128K)
