"""The pipeline's report: ``report.json``, ``report.md``, a bar plot and image panels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from perception.atomic import atomic_write_text
from perception.calibration import Calibration
from perception.draw import SUCCESS_COLOR, draw_grasp, label_image, panel
from perception.overlay import draw_decoded

__all__ = ["write_report", "eval_rows"]

#: Frames per row of the image panel.
PANEL_FRAMES = 4


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['name']}\n{r['domain']}" for r in rows]
    rates = np.array([100 * r["rate"] for r in rows])
    lo = np.array([100 * r["rate_ci95"][0] for r in rows])
    hi = np.array([100 * r["rate_ci95"][1] for r in rows])
    colors = ["#3b7dd8" if r["name"] == "policy" else "#999999" for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 3.6), dpi=110)
    ax.bar(range(len(rows)), rates, color=colors, yerr=[rates - lo, hi - rates], capsize=4)
    for i, r in enumerate(rows):
        ax.text(i, 2, f"{r['successes']}/{r['attempts']}", ha="center", va="bottom", fontsize=8, color="white")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("grasp success, % (Wilson 95% CI)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def _panels(out: Path, sim_dataset: Path, real_dir: Path, translator: Any, calib: Calibration,
            artifact: Path) -> Path | None:
    from adaptation.images import list_real_frames, read_rgb
    from perception.artifact import PolicyRunner
    from perception.decode import decode_grasp
    from policies.evaluate import OnnxPolicy
    from sim_render.dataset import SimFrameDataset
    from sim_render.panel import save_png

    policy = OnnxPolicy(artifact, calib)
    runner = PolicyRunner(artifact, calib)
    ds = SimFrameDataset(sim_dataset, fields=("rgb",))
    n = min(PANEL_FRAMES, len(ds))
    sim_rows, view_rows = [], []
    for i in range(n):
        raw = ds[i]["rgb"]
        sim_rows.append(label_image(draw_decoded(raw, policy(raw), calib), f"sim #{i}"))
        view = runner.preprocess(raw)
        shown = translator(view) if translator is not None else view
        maps = runner.infer_view(shown)
        dec = decode_grasp(maps.quality, maps.width, maps.height, runner.calib, runner.view,
                           runner.meta.quality_threshold, surface=maps.surface, **runner.meta.decode)
        img = np.ascontiguousarray(shown).copy()
        if dec.view_pixel is not None and dec.view_angle is not None:
            draw_grasp(img, dec.view_pixel, dec.view_angle, 0.15 * img.shape[1], SUCCESS_COLOR, 1)
        view_rows.append(label_image(img, "adapted view" if translator is not None else "sim view"))
    real_rows = []
    for path in list_real_frames(real_dir)[:PANEL_FRAMES]:
        raw = read_rgb(path)
        real_rows.append(label_image(draw_decoded(raw, policy(raw), calib), path.name[:24]))
    rows = [r for r in (sim_rows, view_rows, real_rows) if r]
    if not rows:
        return None
    return save_png(out / "report_panels.png", panel(rows))


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
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str) + "\n")

    md = [f"# sim2real-grasp report: budget={report['budget']}, adaptation={report['adaptation']}, "
          f"seed={report['seed']}", "",
          f"Total wall time {report['wall_s']:.0f} s. Artifact: `{report['artifact']}`.", "",
          "## Grasp success in the PyBullet twin (held-out test objects)", "",
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
    a = report.get("adapt") or {}
    if a and a.get("adaptation") != "none":
        md += ["", "## Adaptation", "", "```json", json.dumps({k: v for k, v in a.items()
                                                              if not isinstance(v, dict | list)}, indent=1), "```"]
    md += ["", "## Frames", "", "Rows: sim frames with the policy's grasp; the network's view (adapted when a",
           "translator is used); real frames with the policy's grasp.", "", "![panels](report_panels.png)", ""]
    atomic_write_text(out / "report.md", "\n".join(md))
