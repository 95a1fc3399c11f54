"""Draw docs/benchmarks.png from the ratios recorded in docs/benchmarks.md.

The numbers are copied from that file's tables (each measured with the command shown there; where a
table gives a range over runs, the lower end; for bench/compare-fio.sh, the latest median); update
both together. Usage: python3 bench/plot_benchmarks.py  (needs matplotlib).
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, measured ratio, target ratio)
RESULTS = [
    ("seq write 1M QD16\nvs fio", 0.96, 0.9),
    ("randread 64K QD16\nvs fio", 0.92, 0.9),
    ("randread 4K QD32\nvs fio", 0.96, 0.8),
    ("uring QD32 vs\nportable 1 thread", 5.03, 1.5),
    ("uring QD32 vs\nportable 32 threads", 1.11, 1.5),
    ("store spill 4K\nvs file-per-key", 23.7, 10),
    ("store unspill 4K\nvs file-per-key", 6.71, 10),
    ("store unspill 4K\nwritten back", 32.7, 10),
    ("store spill 64K\nvs file-per-key", 39.7, 5),
    ("store unspill 64K\nvs file-per-key", 3.25, 5),
    ("store unspill 64K\nwritten back", 14.8, 5),
    ("store spill 16M\nvs file-per-key", 1.32, 1.0),
    ("store unspill 16M\nvs file-per-key", 0.74, 1.0),
    ("store unspill 16M\nwritten back", 0.93, 1.0),
    ("python spill 4K\nvs dask", 8.0, 10),
    ("python unspill 4K\nvs dask", 7.0, 5),
    ("python spill 64K\nvs dask", 27.3, 10),
    ("python unspill 64K\nvs dask", 7.3, 5),
    ("python spill 16M\nvs dask", 2.0, 1.5),
    ("python unspill 16M\nvs dask", 1.17, 1.0),
    ("dask cluster wall\ndefault / spillway", 9.7 / 9.2, 1.0),
    ("dask cluster under\nmemory pressure", 52.6 / 41.2, 1.3),
    ("dask move, stock /\nspillway.dask", 6.31 / 3.02, 1.0),
    ("dask big move, stock /\nside channel", 3.69 / 1.15, 1.0),
    ("index bytes/key\n(target / measured)", 100 / 93.2, 1.0),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 5))
    xs = range(len(RESULTS))
    ratios = [r for _, r, _ in RESULTS]
    targets = [t for _, _, t in RESULTS]
    colors = ["tab:green" if r >= t else "tab:red" for _, r, t in RESULTS]
    ax.bar(xs, ratios, color=colors, label="measured")
    ax.scatter(xs, targets, color="black", marker="_", s=600, label="target", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([label for label, _, _ in RESULTS], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("ratio (log scale)")
    ax.axhline(1.0, color="gray", linewidth=0.5)
    ax.set_title("spillway: measured ratios against same-run baselines (2026-12-01, 2 vCPU VM)")
    ax.legend()
    fig.tight_layout()
    fig.savefig("docs/benchmarks.png", dpi=110)


if __name__ == "__main__":
    main()
