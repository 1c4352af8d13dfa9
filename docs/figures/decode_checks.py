"""Regenerate docs/images/fingers_clear.png or jaws_on_part.png: one of the decode's re-ranking checks, off and on.

    .venv/bin/python docs/figures/decode_checks.py --check fingers_clear|jaws_on_part --artifact ART \
        --calibration CELL/calibration.json --frames F1.png F2.png [--share SHARE] [--out docs/images/CHECK.png]

Per frame: the camera frame with the grasp the artifact answers without the check (red)
and with it (green), every other decode option as the artifact has it; then the policy's
top-down view with what stands in the rebuilt surface (parts, walls) shaded, each grasp's
centre, its two fingers' footprints as they come down and the line across the closing
direction, as deep as the fingers, that ``jaws_on_part`` asks to lie on a part.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import cv2
import numpy as np
from omegaconf import OmegaConf

from perception.core.artifact import PolicyRunner
from perception.core.calibration import project_points
from perception.core.decode import decode_grasp
from perception.core.draw import FAILURE_COLOR, SUCCESS_COLOR, label_image, panel
from perception.core.frames import GRIPPER_FINGER_HALF_DEPTH, GRIPPER_FINGER_HALF_THICKNESS
from perception.core.imageio import read_image, write_image
from perception.core.rule import DEFAULT_RULE, object_cells

SCALE = 3  # the top-down view is drawn this many times its size
CHECKS = ("fingers_clear", "jaws_on_part")


def _fingers(img: np.ndarray, dec, px_m: float, color: tuple[int, int, int]) -> None:
    """The two finger footprints of a decoded grasp, in place, on the upscaled top-down view."""
    if dec.view_pixel is None:
        return
    u, v = dec.view_pixel
    a = dec.view_angle
    reach = (dec.grasp.width / 2 + GRIPPER_FINGER_HALF_THICKNESS) / px_m
    size = (2 * GRIPPER_FINGER_HALF_THICKNESS / px_m * SCALE, 2 * GRIPPER_FINGER_HALF_DEPTH / px_m * SCALE)
    for sign in (1, -1):
        c = ((u + sign * reach * math.cos(a) + 0.5) * SCALE, (v + sign * reach * math.sin(a) + 0.5) * SCALE)
        box = cv2.boxPoints((c, size, math.degrees(a))).astype(np.int32)
        cv2.polylines(img, [box], True, color, 1)
    cv2.circle(img, (int((u + 0.5) * SCALE), int((v + 0.5) * SCALE)), 3, color, -1)
    depth = GRIPPER_FINGER_HALF_DEPTH / px_m
    ends = [(int((u - sign * depth * math.sin(a) + 0.5) * SCALE), int((v + sign * depth * math.cos(a) + 0.5) * SCALE))
            for sign in (1, -1)]
    cv2.line(img, ends[0], ends[1], color, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--frames", nargs="+", required=True)
    ap.add_argument("--check", choices=CHECKS, default="fingers_clear")
    ap.add_argument("--share", type=float, default=None,
                    help="the check's share (default: the artifact's, else conf/policy/default.yaml's)")
    ap.add_argument("--out", default=None, help="default: docs/images/CHECK.png")
    args = ap.parse_args()
    out = args.out or f"docs/images/{args.check}.png"

    runner = PolicyRunner(args.artifact, args.calibration)
    if not runner.view.is_table:
        raise SystemExit("the artifact's view is not a top-down (table) view")
    share = args.share if args.share is not None else runner.meta.decode.get(args.check)
    if share is None:
        conf = Path(__file__).resolve().parents[2] / "conf" / "policy" / "default.yaml"
        share = OmegaConf.load(conf).decode.get(args.check)
    if share is None:
        raise SystemExit(f"no share for {args.check}: the artifact and conf/policy/default.yaml have none; pass --share")
    plain = runner.meta.decode_options.replace(**{args.check: None})
    checked = plain.replace(**{args.check: float(share)})
    px_m = 1.0 / float(np.linalg.norm(runner.view.K[0, :2]))
    rows = []
    for path in args.frames:
        raw = read_image(path, expected_size=runner.calib.image_size)
        maps = runner.infer(raw, keep_view=True)
        # One frame's maps decoded twice (without the check, with it): decode_grasp on them.
        decs = [decode_grasp(maps.quality, maps.width, maps.height, runner.calib, runner.view, opts,
                             surface=maps.surface)
                for opts in (plain, checked)]
        frame = raw.copy()
        for dec, color in zip(decs, (FAILURE_COLOR, SUCCESS_COLOR)):
            if dec.grasp is not None:  # the fingertip line, as the robot is asked to close it
                a, b = (tuple(int(round(c)) for c in p) for p in project_points(dec.grasp.fingertips(), runner.calib))
                cv2.line(frame, a, b, color, 2, cv2.LINE_AA)
                for p in (a, b):
                    cv2.circle(frame, p, 4, color, -1, cv2.LINE_AA)
        standing = object_cells(maps.surface, None, float(DEFAULT_RULE["object_height"]),
                                int(DEFAULT_RULE["min_object_px"]))
        top = maps.view_rgb.copy()
        top[standing] = (0.55 * top[standing] + 0.45 * np.array([255, 255, 255])).astype(np.uint8)
        top = cv2.resize(top, None, fx=SCALE, fy=SCALE, interpolation=cv2.INTER_NEAREST)
        for dec, color in zip(decs, (FAILURE_COLOR, SUCCESS_COLOR)):
            _fingers(top, dec, px_m, color)
        h = top.shape[0]
        frame = cv2.resize(frame, (int(frame.shape[1] * h / frame.shape[0]), h), interpolation=cv2.INTER_AREA)
        rows.append([label_image(frame, f"camera: without (red), with {args.check} (green)"),
                     label_image(top, "top-down: standing shaded, fingers, jaws' depth")])
    write_image(out, panel(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
