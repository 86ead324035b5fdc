"""Loss curves from a metrics JSONL file, drawn with matplotlib."""

from __future__ import annotations

import json

from strata.errors import ConfigError


def read_metrics(path: str) -> list[dict]:
    try:
        with open(path, "rb") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise ConfigError(f"metrics file {path}: no such file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"metrics file {path}: not a metrics file of JSON lines ({e})") from None
    if not all(isinstance(r, dict) for r in records):
        raise ConfigError(f"metrics file {path}: not a metrics file (a line is not a JSON object)")
    return records


def plot_losses(metrics_path: str, out_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    for r in records:
        wanted = {"train": ("step", "loss"), "eval": ("step", "val_loss")}.get(r.get("kind"), ())
        if any(not isinstance(r.get(key), (int, float)) for key in wanted):
            raise ConfigError(f"metrics file {metrics_path}: a {r['kind']} record without a number for each of "
                              f"{', '.join(wanted)}")
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    if not train and not val:
        raise ConfigError(f"metrics file {metrics_path}: holds no train or eval records")
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
