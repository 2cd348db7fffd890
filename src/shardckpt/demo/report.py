"""The demo's outputs for people: ``loss.png`` (matplotlib, the ``demo`` extra) and the printed summary."""
from __future__ import annotations


def plot_losses(summary: dict, path: str) -> str | None:
    """Plot the loss across the kill and the resume, both marked; returns ``path``, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    crash, resume = summary["crash"], summary["resume"]
    first_ws, resumed_ws = summary["world_sizes"]
    first = summary["losses"]["first"]
    kept = [(s, l) for s, l in first if s < crash["last_committed_step"]]
    lost = [(s, l) for s, l in first if s >= crash["last_committed_step"]]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax.plot(*zip(*kept), color="tab:blue", lw=1.2, label=f"{first_ws} ranks")
    if lost:  # drawn wide beneath: the resumed run retraces it
        ax.plot(*zip(*lost), color="tab:gray", lw=5, alpha=0.35, solid_capstyle="butt",
                label="trained on 2 ranks, then lost to the kill")
    ax.plot(*zip(*summary["losses"]["resumed"]), color="tab:orange", lw=1.2,
            label=f"{resumed_ws} ranks, resumed from the converted checkpoint")
    saves = [c["step"] for c in summary["checkpoints"] if c.get("step") is not None]
    ax.plot(saves, [0.02] * len(saves), "|", color="black", ms=8, transform=ax.get_xaxis_transform(),
            label="committed checkpoints")
    ax.axvline(crash["step"], color="tab:red", ls="--", lw=1)
    ax.axvline(resume["from_step"], color="tab:green", ls=":", lw=1.2)
    ax.set_yscale("log")
    top = ax.get_ylim()[1]
    ax.text(crash["step"], top, f" kill -9 during the save of step {crash['step']}", color="tab:red", va="top", fontsize=8)
    ax.text(resume["from_step"], top / 2, f"resume at step {resume['from_step']}\n{first_ws} -> {resumed_ws} ranks ",
            color="tab:green", va="top", ha="right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (log scale)")
    ax.set_title(f"shardckpt demo: {summary['model']['parameters'] / 1e6:.1f}M-parameter transformer, "
                 f"async checkpoints every {summary['save_every']} steps")
    ax.legend(loc="upper right", bbox_to_anchor=(1, 0.8), fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summary_lines(summary: dict) -> list[str]:
    saves, convert, crash = summary["saves"], summary["convert"], summary["crash"]
    lines = ["", "summary:"]
    for check in summary["checks"]:
        lines.append(f"  [{'ok' if check['ok'] else 'FAILED'}] {check['name']}")
    lines += [
        f"  async saves: {saves['count']}, training blocked {saves['training_blocked_s_median'] * 1e3:.1f} ms per save "
        f"(median; {saves['training_blocked_s_total']:.2f} s in all)",
        f"  crash: step {crash['step']}, {crash['steps_lost']} steps lost, resumed from step {crash['last_committed_step']}",
        f"  convert: {convert['seconds']:.1f} s, peak memory {convert['peak_rss_mib']:.0f} MiB",
        f"  export: {', '.join(summary['export']['files'])} ({summary['export']['bytes'] / 2**20:.1f} MiB, bf16)",
        f"  loss curve: {summary['loss_png'] or 'not drawn (pip install shardckpt[demo] for matplotlib)'}",
        f"  summary: {summary['out']}/summary.json; took {summary['wall_s']:.0f} s",
        f"checksums_equal: {str(summary['checksums_equal']).lower()}",
    ]
    return lines
