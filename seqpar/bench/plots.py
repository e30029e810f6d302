"""PNG figures of ``python -m seqpar plan --plot`` and ``python -m seqpar bench --plot`` (matplotlib, the
optional ``plot`` extra; drawn on an Agg canvas without pyplot, so no display and no global state)."""
from __future__ import annotations

from typing import Dict, List

GIB, MIB = 2 ** 30, 2 ** 20


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, 2)


def plot_plan(result: Dict, path: str) -> None:
    """Left: the first stage's memory per GPU for every uniform policy (model state + activations, the
    paper's Figure 7 with the GPU's capacity); right: extra forward FLOPs vs activation memory of every
    (n_none, n_selective, n_full) mix at its peak (``RecomputePlan.peak_bytes``, what the planner fits),
    the cheapest fit per budget, and the planned mix."""
    from seqpar.memory import evaluate_recompute

    args, budget, state = result["args"], result["budget"], result["state_bytes"]
    fig, (left, right) = _figure(13, 5)
    uniform = result["uniform"]
    labels = [label for label, _, _, _ in uniform][::-1]
    acts = [cost.activation_bytes / GIB for _, _, _, cost in uniform][::-1]
    baseline = uniform[0][3].activation_bytes / GIB
    fixed = state / GIB + args.other_gib
    left.barh(labels, [fixed] * len(labels), color="0.75", label="weights, grads, Adam (18 B/param)"
              + (f" + {args.other_gib:g} GiB other" if args.other_gib else ""))
    bars = left.barh(labels, acts, left=fixed, color="tab:blue", label="activations")
    for bar, act in zip(bars, acts):
        left.text(bar.get_x() + bar.get_width(), bar.get_y() + bar.get_height() / 2,
                  f" {act:.1f} GiB ({100 * act / baseline:.0f}%)", va="center", fontsize=8)
    left.axvline(args.gpu_memory, color="tab:red", ls="--", label=f"GPU memory {args.gpu_memory:g} GiB")
    left.set_xlim(0, 1.35 * max(fixed + max(acts), args.gpu_memory))  # room for the labels and legend
    left.set_xlabel("GiB per GPU, first pipeline stage")
    left.set_title("uniform policies (% of tensor parallel alone)")
    left.legend(loc="lower right", fontsize=8)
    left.tick_params(axis="y", labelsize=8)

    sizes, options = result["sizes"], result["options"]
    n = args.layers // args.pp
    mixes = [(n - n_sel - n_full, n_sel, n_full) for n_full in range(n + 1) for n_sel in range(n - n_full + 1)]
    costs = [evaluate_recompute(("full",) * f + ("selective",) * k + ("none",) * z, **sizes,
                                sequence_parallel=args.sp, **options) for z, k, f in mixes]
    points = sorted((c.peak_bytes / GIB, 100 * c.extra_fraction) for c in costs)   # what the planner fits
    right.scatter([x for x, _ in points], [y for _, y in points], s=8, color="0.6", label="every per-layer mix")
    frontier, cheapest = [], float("inf")   # the cheapest mix that fits, as the budget grows
    for x, y in points:
        if y < cheapest:
            cheapest = y
            frontier.append((x, y))
    right.step([x for x, _ in frontier], [y for _, y in frontier], where="post", color="tab:blue",
               label="cheapest mix within that memory")
    if budget > 0:
        right.axvline(budget / GIB, color="tab:red", ls="--", label=f"activation budget {budget / GIB:.1f} GiB")
    best = result["plan"]
    if best is not None:
        c = best.counts
        right.scatter([best.peak_bytes / GIB], [100 * best.extra_fraction], marker="*", s=200,
                      color="tab:orange", zorder=5,
                      label=f"plan: {c['none']} none / {c['selective']} selective / {c['full']} full")
    right.set_xlabel("peak activation GiB per GPU (with a recomputed layer's rebuild or the loss backward's)")
    right.set_ylabel("extra forward FLOPs, % of model FLOPs")
    right.set_title(f"recompute mixes of the {n} layers per stage ({'with' if args.sp else 'without'} SP)")
    right.legend(fontsize=8)
    fig.suptitle(f"seqpar plan: {args.model or 'custom'} {args.arch} model, s={args.seq_len} b={args.micro_batch} "
                 f"h={args.hidden} a={args.heads} L={args.layers} t={args.tp} p={args.pp}")
    fig.savefig(path, dpi=110)


def plot_bench(rows: List[Dict], title: str, path: str, formula: str = "Table 2") -> None:
    """The five layer experiments like the paper's Figure 8. Left: forward, backward and recompute time
    (recompute = the backward time beyond the no-recompute run with the same sequence parallelism);
    right: measured activation bytes vs the formula (``formula`` names it: "Table 2" for the paper's
    layer) with and without 1-byte dropout masks."""
    fig, (left, right) = _figure(13, 5)
    names = [r["experiment"].replace(" + ", " +\n").replace(" recompute", "\nrecompute") for r in rows]
    base = {r["sequence_parallel"]: r["backward_ms"] for r in rows if r["recompute"] == "none"}
    recompute = [max(0.0, r["backward_ms"] - base.get(r["sequence_parallel"], r["backward_ms"])) for r in rows]
    forward = [r["forward_ms"] for r in rows]
    backward = [r["backward_ms"] - x for r, x in zip(rows, recompute)]
    left.bar(names, forward, color="tab:blue", label="forward")
    left.bar(names, backward, bottom=forward, color="tab:green", label="backward")
    left.bar(names, recompute, bottom=[f + b for f, b in zip(forward, backward)], color="tab:red",
             label="recompute (backward beyond no-recompute)")
    for i, r in enumerate(rows):
        left.text(i, r["combined_ms"], "-" if r["recompute"] == "none" and not r["sequence_parallel"]
                  else f"{100 * r['overhead']:+.0f}%", ha="center", va="bottom", fontsize=8)
    left.set_ylabel("ms per layer (median)")
    left.set_title("time: forward + backward (overhead vs no recompute)")
    # below the axes: inside, it covered the tallest bar (full recompute) and its overhead label
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    width, xs = 0.27, range(len(rows))
    right.bar([x - width for x in xs], [r["activation_bytes"] / MIB for r in rows], width, color="tab:blue",
              label="measured (ActivationMeter)")
    right.bar(list(xs), [r["table2_bytes"] / MIB for r in rows], width, color="0.45", label=formula)
    right.bar([x + width for x in xs], [r["table2_bytes_no_masks"] / MIB for r in rows], width, color="0.75",
              label=f"{formula} without masks (seqpar regenerates them)")
    right.set_xticks(list(xs), names)
    right.set_ylabel("MiB per rank")
    right.set_title("activation memory of one layer")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)   # as the left one
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
