"""The pipeline's report: ``report.json``, ``report.md``, a bar plot and image panels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from adaptation.images import list_real_frames, read_rgb
from perception.core.artifact import PolicyRunner
from perception.core.atomic import atomic_write_text
from perception.core.calibration import Calibration
from perception.core.cliutil import format_number
from perception.core.draw import SUCCESS_COLOR, caption_image, draw_grasp, panel
from perception.core.jsonio import write_json
from perception.core.overlay import draw_decoded
from policies.eval_adapters import OnnxPolicy
from sim_render.panel import save_png

__all__ = ["write_report", "eval_rows"]

#: Frames per row of the image panel.
PANEL_FRAMES = 4
POLICY_COLOR, REFERENCE_COLOR = "#3b7dd8", "#999999"
#: The panel's rows, top to bottom, as its caption says them.
PANEL_CAPTION = ("Rows: 1 sim frames with the policy's grasp; 2 what the network sees (adapted when a translator "
                 "is used); 3 real frames with the policy's grasp. Green: fingertip line; yellow cross: grasp "
                 "centre; blue: workspace; red text: why there is no grasp.")


def eval_rows(evaluation: dict) -> list[dict]:
    """Flat rows ``name, domain, successes, attempts, rate, ci, clearance`` of an evaluation."""
    rows = []
    for dom, r in evaluation.get("policy", {}).items():
        rows.append({"name": "policy", "domain": dom, **{k: r[k] for k in ("successes", "attempts", "rate",
                                                                          "rate_ci95", "clearance")}})
    for b, r in evaluation.get("brackets", {}).items():
        rows.append({"name": b, "domain": r.get("domain", ""), **{k: r[k] for k in ("successes", "attempts",
                                                                                   "rate", "rate_ci95", "clearance")}})
    return rows


def _bar_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib  # lazy: matplotlib (only to draw; sim2real-pipeline's checks answer first)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib (after its Agg backend is chosen)
    from matplotlib.patches import Patch  # lazy: matplotlib (only to draw)

    labels = [f"{r['name']}\n{r['domain']}\n{r['successes']}/{r['attempts']}" for r in rows]
    rates = np.array([100 * r["rate"] for r in rows])
    lo = np.array([100 * r["rate_ci95"][0] for r in rows])
    hi = np.array([100 * r["rate_ci95"][1] for r in rows])
    colors = [POLICY_COLOR if r["name"] == "policy" else REFERENCE_COLOR for r in rows]
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 4.5, 4.4), dpi=110)
    yerr = np.clip([rates - lo, hi - rates], 0, None)
    ax.bar(range(len(rows)), rates, color=colors, yerr=yerr, capsize=4, ecolor="#333333")
    # successes/attempts under each bar, so a 0% bar still says whether it is 0/0 or 0/12.
    ax.set_xticks(range(len(rows)), labels, fontsize=9)
    ax.set_ylabel("grasp success, % of attempts", fontsize=10)
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=[Patch(color=POLICY_COLOR, label="the trained policy"),
                       Patch(color=REFERENCE_COLOR, label="reference (oracle: true geometry; random)"),
                       plt.Line2D([], [], color="#333333", marker="_", linestyle="", markersize=12,
                                  label="Wilson 95% interval")],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def _panels(out: Path, sim_dataset: Path, real_dir: Path, translator: Any, calib: Calibration,
            artifact: Path) -> Path | None:
    from sim_render.reader import SimFrameDataset  # lazy: torch via sim_render.reader (only the panels)

    policy = OnnxPolicy(artifact, calib)
    runner = PolicyRunner(artifact, calib)
    ds = SimFrameDataset(sim_dataset, fields=("rgb",))
    n = min(PANEL_FRAMES, len(ds))
    sim_rows, view_rows = [], []
    for i in range(n):
        raw = ds[i]["rgb"]
        sim_rows.append((draw_decoded(raw, policy(raw), calib), f"sim #{i}"))
        view = runner.preprocess(raw)
        shown = translator(view) if translator is not None else view
        _maps, dec = runner.decide_view(shown)  # a translated view image, not a raw frame
        img = np.ascontiguousarray(shown).copy()
        if dec.view_pixel is not None and dec.view_angle is not None:
            draw_grasp(img, dec.view_pixel, dec.view_angle, 0.15 * img.shape[1], SUCCESS_COLOR, 1)
        view_rows.append((img, "adapted view" if translator is not None else "sim view"))
    real_rows = []
    for path in list_real_frames(real_dir)[:PANEL_FRAMES]:
        raw = read_rgb(path)
        real_rows.append((draw_decoded(raw, policy(raw), calib), path.name[:24]))
    rows = [r for r in (sim_rows, view_rows, real_rows) if r]
    if not rows:
        return None
    grid = panel([[im for im, _ in r] for r in rows], labels=[[text for _, text in r] for r in rows])
    return save_png(out / "report_panels.png", caption_image(grid, PANEL_CAPTION))


def write_report(report: dict, out: Path, sim_dataset: Path, real_dir: Path, translator: Any,
                 calib: Calibration) -> None:
    """Write ``report.json``, ``report.md``, ``report_success.png`` and ``report_panels.png``."""
    out = Path(out)
    rows = eval_rows(report["evaluation"])
    plot = out / "report_success.png"
    if rows:
        _bar_plot(rows, plot, f"budget={report['budget']} adaptation={report['adaptation']} seed={report['seed']}")
    panels = _panels(out, sim_dataset, real_dir, translator, calib, Path(report["artifact"]))
    report["figures"] = {"success": plot.name if rows else None, "panels": panels.name if panels else None}
    write_json(out / "report.json", report)

    md = [f"# sim2real-grasp report: budget={report['budget']}, adaptation={report['adaptation']}, "
          f"seed={report['seed']}", "", *verdict(report["evaluation"], report["budget"]), "",
          f"Total wall time {report['wall_s']:.0f} s. Artifact: `{report['artifact']}`.", "",
          "## Grasp success in the PyBullet twin (held-out test objects)", "",
          "Domains: the twin rendered four ways (`randomized`: the training randomization; `canonical`: plain "
          "looks; `target`, `target_b`: two fixed looks the policy never trained on). An attempt is one grasp "
          "executed in the physics engine; clearance is the share of objects lifted out of the bin. These "
          "figures are the twin's: they do not measure transfer to your cell.", "",
          "| policy | domain | successes / attempts | rate | Wilson 95% CI | clearance |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["rate_ci95"]
        md.append(f"| {r['name']} | {r['domain']} | {r['successes']} / {r['attempts']} | {100 * r['rate']:.1f}% | "
                  f"[{100 * lo:.1f}, {100 * hi:.1f}] | {100 * r['clearance']:.0f}% |")
    empty = report["evaluation"].get("empty_bin") or {}
    if empty:
        md += ["", "Frames of the empty bin answered with no grasp (a grasp on a bare floor is worse than none):", "",
               "| domain | no grasp / frames | rate | Wilson 95% CI |", "|---|---|---|---|"]
        for dom, r in empty.items():
            lo, hi = r["rate_ci95"]
            md.append(f"| {dom} | {r['null']} / {r['frames']} | {100 * r['rate']:.0f}% | [{100 * lo:.0f}, {100 * hi:.0f}] |")
    md += ["", "![success](report_success.png)", "", "## Stages", "", "| stage | wall s | reused |", "|---|---|---|"]
    for k, v in report["stages"].items():
        md.append(f"| {k} | {v['wall_s']:.1f} | {v['reused']} |")
    md += policy_section(report.get("policy") or {})
    md += adaptation_section(report.get("adapt") or {})
    md += ["", "## Frames", "", PANEL_CAPTION, "", "![panels](report_panels.png)", ""]
    atomic_write_text(out / "report.md", "\n".join(md))


def policy_section(p: dict) -> list[str]:
    """``report.md``'s policy part: the steps trained and which weights the artifact holds."""
    if not p or p.get("global_step") is None:
        return []
    base = (p.get("base") or {}).get("name")
    line = (f"{p['global_step']} steps in {format_number(p.get('train_time_s'), 0)} s on {p.get('n_train_frames')} "
            f"frames{f', from the base `{base}`' if base else ''}.")
    kept = p.get("kept")
    if kept:
        which = ("the start (the base as it is: training did not improve the held-out frames)"
                 if kept["step"] == 0 and base else f"step {kept['step']}")
        line += (f" The artifact holds the weights of {which}: `{kept['by']}` {format_number(kept['value'])} on "
                 f"{p.get('n_val_frames')} held-out sim frames, against {format_number(kept['last_value'])} for the "
                 f"last (step {kept['last_step']}).")
    return ["", "## Policy", "", line]


def adaptation_section(a: dict) -> list[str]:
    """``report.md``'s adaptation part: the translation's distance to the real frames and
    how much of the scene's content it kept (both on held-out frames)."""
    if not a or a.get("adaptation") == "none":
        return []
    d, c = a.get("distance") or {}, a.get("content") or {}
    md = ["", "## Adaptation", "",
          f"`{a.get('adaptation')}` with the `{a.get('generator_name')}` generator: {a.get('steps')} steps, best at "
          f"step {a.get('best_step')}, {format_number(a.get('wall_time_s'), 0)} s.", "",
          "Distance to the real frames (SWD: the sliced Wasserstein distance of 7x7 Laplacian-pyramid patches, x1000, "
          "on held-out real frames; lower is closer):", "",
          "| | SWD |", "|---|---|",
          f"| raw sim frames to real | {format_number(d.get('sim_real'))} |",
          f"| adapted frames to real (best checkpoint) | {format_number(d.get('adapted_real'))} |",
          f"| adapted / raw (below 1: the translation moved sim toward real) | {format_number(d.get('ratio'))} |",
          f"| adapted frames to real (last step) | {format_number(d.get('adapted_real_last'))} |", "",
          "Content kept (a segmentation probe trained on raw sim, run on the adapted frames, against the sim "
          "labels; the raw-sim column is the probe on the frames it knows, the most to expect):", "",
          "| | adapted | raw sim |", "|---|---|---|",
          f"| object IoU | {format_number(c.get('object_iou'))} | {format_number(c.get('sim_object_iou'))} |",
          f"| objects found (instance recall) | {format_number(c.get('instance_recall'))} | "
          f"{format_number(c.get('sim_instance_recall'))} |",
          f"| mean IoU over classes | {format_number(c.get('mean_iou'))} | |"]
    return md


def verdict(evaluation: dict, budget: str) -> list[str]:
    """The report's first lines: plainly, whether the policy grasped anything in the twin,
    why not when it did not, and what to run next."""
    policy = evaluation.get("policy") or {}
    attempts = sum(int(r.get("attempts", 0)) for r in policy.values())
    successes = sum(int(r.get("successes", 0)) for r in policy.values())
    silent = [d for d, r in policy.items() if int(r.get("attempts", 0)) == 0]
    reasons: dict[str, int] = {}
    for r in policy.values():
        for k, n in (r.get("reasons") or {}).items():
            reasons[k] = reasons.get(k, 0) + int(n)
    why = "; ".join(f"{k} ({n}x)" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
    bigger = {"tiny": "small", "small": "full"}.get(str(budget))
    nxt = (f"`sim2real-pipeline budget={bigger}` trains longer" if bigger else "more training time or data")
    if not policy:
        return ["**No policy evaluation ran** (the `eval` stage was skipped).", ""]
    if attempts == 0:
        return [f"> **Nothing was grasped: the policy answered \"no grasp\" on every frame, in all {len(policy)} "
                f"twin domains.** Why: {why or 'no reason recorded'}.",
                f"> Next: {nxt}; or lower the answer threshold for a look at what it would grasp "
                "(`sim2real-eval artifact=ARTIFACT quality_threshold=0.1`)."]
    lines = []
    if successes == 0:
        lines.append(f"> **No grasp succeeded**: {attempts} attempts in the twin, none lifted an object. Next: {nxt}.")
    else:
        lines.append(f"> The policy lifted an object on **{successes} of {attempts} attempts** in the twin "
                     f"({100 * successes / attempts:.0f}%, all domains together).")
    if silent:
        lines.append(f"> It answered \"no grasp\" on every frame of {', '.join(silent)}"
                     + (f" ({why})" if why else "") + ".")
    return lines
