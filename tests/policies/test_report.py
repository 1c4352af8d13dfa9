"""The pipeline report's plain statement at its top, its adaptation scores and its figures."""

from __future__ import annotations

import cv2
import numpy as np

from perception.core.draw import caption_image
from policies.pipeline.report import _bar_plot, adaptation_section, eval_rows, policy_section, verdict


def _dom(successes: int, attempts: int, reasons: dict | None = None) -> dict:
    return {"successes": successes, "attempts": attempts, "rate": successes / attempts if attempts else 0.0,
            "rate_ci95": [0.0, 1.0], "clearance": 0.0, "reasons": reasons or {}}


def test_nothing_grasped_is_said_first_with_why_and_what_next():
    ev = {"policy": {d: _dom(0, 0, {"no grasp reaches the quality threshold 0.30": 5})
                     for d in ("randomized", "canonical", "target", "target_b")}}
    text = "\n".join(verdict(ev, "tiny"))
    assert "Nothing was grasped" in text and "all 4 twin domains" in text
    assert "quality threshold 0.30 (20x)" in text and "budget=small" in text


def test_grasps_and_silent_domains_are_counted():
    ev = {"policy": {"randomized": _dom(3, 10), "canonical": _dom(0, 4), "target": _dom(0, 0, {"too dark": 2})}}
    text = "\n".join(verdict(ev, "small"))
    assert "3 of 14 attempts" in text and "every frame of target (too dark (2x))" in text
    text = "\n".join(verdict({"policy": {"randomized": _dom(0, 6)}}, "small"))
    assert "No grasp succeeded" in text and "6 attempts" in text and "budget=full" in text


def test_the_report_says_which_weights_the_artifact_holds():
    p = {"global_step": 76, "train_time_s": 35.7, "n_train_frames": 14, "n_val_frames": 2,
         "base": {"name": "grasp_base_v1"},
         "kept": {"by": "val/quality_loss", "step": 0, "value": 0.744, "last_step": 76, "last_value": 1.189}}
    text = "\n".join(policy_section(p))
    assert "76 steps in 36 s on 14 frames, from the base `grasp_base_v1`" in text
    assert "the start (the base as it is" in text and "0.744 on 2 held-out sim frames, against 1.189" in text
    text = "\n".join(policy_section({**p, "kept": {**p["kept"], "step": 60, "value": 0.5}}))
    assert "weights of step 60" in text and "base as it is" not in text
    assert "holds the weights" not in "\n".join(policy_section({**p, "kept": None}))
    assert policy_section({}) == []


def test_adaptation_scores_reach_the_report():
    a = {"adaptation": "cyclegan", "generator_name": "fast", "steps": 400, "best_step": 300, "wall_time_s": 61.0,
         "distance": {"sim_real": 41.5, "adapted_real": 20.25, "ratio": 0.488, "adapted_real_last": 21.0},
         "content": {"object_iou": 0.61, "sim_object_iou": 0.8, "instance_recall": 0.9, "sim_instance_recall": 1.0,
                     "mean_iou": None}}
    md = "\n".join(adaptation_section(a))
    assert "| raw sim frames to real | 41.500 |" in md and "| adapted / raw" in md and "0.488" in md
    assert "| object IoU | 0.610 | 0.800 |" in md and "n/a" in md  # a missing score is said, not hidden
    assert adaptation_section({"adaptation": "none"}) == []


def test_the_plot_and_the_panel_caption_are_drawn(tmp_path):
    ev = {"policy": {"randomized": _dom(0, 0)}, "brackets": {"oracle": {**_dom(9, 10), "domain": "randomized"}}}
    path = tmp_path / "success.png"
    _bar_plot(eval_rows(ev), path, "budget=tiny")
    img = cv2.imread(str(path))
    assert img is not None and img.shape[0] > 300
    # The reference bar is grey, the policy's (0%) has none: its 0/0 label stands above the axis.
    assert (np.abs(img.astype(int) - [153, 153, 153]).sum(axis=2) < 10).sum() > 500
    src = np.zeros((60, 200, 3), np.uint8)
    out = caption_image(src, "Rows: 1 sim frames; 2 the view; 3 real frames. Green: fingertip line; red: why not.")
    assert out.shape[1] == 200 and out.shape[0] > 60 + 2 * 12  # wrapped onto more than one line
    assert (out[60:] < 128).any() and (out[:60] == 0).all()


def test_captions_are_tall_enough_to_read_at_full_size():
    """A capital and a descender span at least 15 px (the old captions spanned 11 and 12: too small at 100%)."""
    from perception.core.draw import label_image

    def ink_rows(strip: np.ndarray) -> int:
        rows = np.where((strip < 128).any(axis=(1, 2)))[0]
        return int(rows.max() - rows.min() + 1) if rows.size else 0

    labelled = label_image(np.full((120, 160, 3), 255, np.uint8), "Ag sim #0")
    assert ink_rows(labelled[: labelled.shape[0] - 120]) >= 15
    legend = caption_image(np.full((10, 400, 3), 255, np.uint8), "Ag")
    assert ink_rows(legend[10:]) >= 15
