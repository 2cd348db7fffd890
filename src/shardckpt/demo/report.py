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


def plot_tier_losses(summary: dict, path: str) -> str | None:
    """``demo --tiers``: the loss across the node loss and the resume, with each tier's saves and the tiers the
    resume read from marked; returns ``path``, or None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resume, (first_ws, resumed_ws) = summary["resume"], summary["world_sizes"]
    start = resume["from_step"] if resume["from_step"] is not None else 0
    first = summary["losses"]["first"]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ax.plot(*zip(*[(s, v) for s, v in first if s < start] or [(0, first[0][1])]), color="tab:blue", lw=1.2,
            label=f"{first_ws} ranks on 2 nodes")
    lost = [(s, v) for s, v in first if s >= start]
    if lost:
        ax.plot(*zip(*lost), color="tab:gray", lw=5, alpha=0.35, solid_capstyle="butt", label="trained, then lost")
    ax.plot(*zip(*summary["losses"]["resumed"]), color="tab:orange", lw=1.2,
            label=f"{resumed_ws} ranks on node 0, resumed")
    regrow = summary["regrow"]
    if summary["losses"]["regrown"]:
        ax.plot(*zip(*summary["losses"]["regrown"]), color="tab:cyan", lw=1.2,
                label=f"{regrow['world_size']} ranks again, after a corrupt copy was excluded")
    ax.axvline(regrow["from_step"], color="tab:cyan", ls=":", lw=1.2)
    for tier, y, mark in (("tier0", 0.02, "|"), ("tier2", 0.06, "v")):
        steps = summary["saves"]["steps_by_tier"][tier]
        ax.plot(steps, [y] * len(steps), mark, color="black" if tier == "tier0" else "tab:purple", ms=8,
                transform=ax.get_xaxis_transform(), label=f"{tier} saves" + (" (replicated)" if tier == "tier0" else ""))
    ax.axvline(summary["crash"]["step"], color="tab:red", ls="--", lw=1)
    ax.axvline(start, color="tab:green", ls=":", lw=1.2)
    read = ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in sorted((resume["bytes_by_tier"] or {}).items()) if b)
    ax.set_yscale("log")
    top = ax.get_ylim()[1]
    ax.text(summary["crash"]["step"], top, f" kill -9, node 1 lost (step {summary['crash']['step']})", color="tab:red",
            va="top", fontsize=8)
    ax.text(start, top / 2, f"resume at step {start} from {read}\n(tier 2 alone: step {resume['tier2_newest_step']}) ",
            color="tab:green", va="top", ha="right", fontsize=8)
    again = ", ".join(f"{t}" for t, b in sorted((regrow["bytes_by_tier"] or {}).items()) if b)
    ax.text(regrow["from_step"], top / 4, f"resume at step {regrow['from_step']}: a corrupt copy excluded,\n"
            f"read from {again} ", color="tab:cyan", va="top", ha="right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (log scale)")
    ax.set_title(f"shardckpt demo --tiers: tier 0 every {summary['save_every']} steps, replicated; tier 2 every "
                 f"{summary['persistent_every']}")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 0.08), fontsize=8)  # below the falling curve: empty
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def tier_summary_lines(summary: dict) -> list[str]:
    resume, saves = summary["resume"], summary["saves"]
    lines = ["", "summary:"] + [f"  [{'ok' if c['ok'] else 'FAILED'}] {c['name']}" for c in summary["checks"]]
    lines += [
        f"  tier saves: {saves['count']}, training blocked {(saves['training_blocked_s_median'] or 0) * 1e3:.1f} ms "
        f"per save (median)",
        f"  node lost at step {summary['crash']['step']}; resumed from step {resume['from_step']} in "
        f"{(resume['seconds'] or 0):.2f} s, {resume['steps_saved_over_tier2']} steps newer than tier 2's "
        f"(step {resume['tier2_newest_step']})",
        f"  corrupt copy ({summary['regrow']['corrupted']}) excluded: resumed from step "
        f"{summary['regrow']['from_step']} with bytes by tier {summary['regrow']['bytes_by_tier']}",
        f"  loss curve: {summary['loss_png'] or 'not drawn (pip install shardckpt[demo] for matplotlib)'}",
        f"  summary: {summary['out']}/summary.json; took {summary['wall_s']:.0f} s",
        f"checksums_equal: {str(summary['checksums_equal']).lower()}",
    ]
    return lines
