"""Plot training and held-out loss curves from metrics.jsonl files, and print the final losses against the first.

    python benchmarks/plot_loss.py --out benchmarks/loss_curves.png runs/a/metrics.jsonl runs/b/metrics.jsonl

A file's label is its name (loss_<label>.jsonl) or its run directory's name. The first file is the baseline:
the table gives each run's final held-out loss and its difference from the baseline in percent.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label_of(path: pathlib.Path) -> str:
    return path.stem.removeprefix("loss_") if path.name != "metrics.jsonl" else path.parent.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="142M Llama 3, embedded corpus (bytes), 1000 steps")
    args = ap.parse_args()
    runs = {}
    for f in map(pathlib.Path, args.files):
        records = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        runs[label_of(f)] = records
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, recs in runs.items():
        ax1.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, lw=1)
        ev = [r for r in recs if r.get("eval_loss") is not None]
        ax2.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], marker="o", ms=3, label=name)
    for ax, title in ((ax1, "training loss"), (ax2, "held-out loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("nats per byte")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylim(top=min(3.5, ax1.get_ylim()[1]))
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    base_name = next(iter(runs))
    final = {n: [r for r in recs if r.get("eval_loss") is not None][-1] for n, recs in runs.items()}
    base = final[base_name]["eval_loss"]
    w = max(16, *(len(n) + 2 for n in final))  # the label column fits the longest label
    print(f"{'run':<{w}}{'step':>6}{'held-out loss':>15}  vs {base_name}")
    for n, r in final.items():
        print(f"{n:<{w}}{r['step']:>6}{r['eval_loss']:>15.4f}{100 * (r['eval_loss'] / base - 1):>+11.2f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
