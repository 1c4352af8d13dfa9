"""The policies :func:`policies.evaluate.evaluate` runs that look only at pixels: the exported
artifact (:class:`OnnxPolicy`, exactly as the service runs it) and a network in memory
(:class:`TorchPolicy`, the same decode). The reference policies that look at the simulator are
in :mod:`policies.eval_brackets`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from perception.core.artifact import PolicyRunner
from perception.core.calibration import Calibration, project_points
from perception.core.decode import DecodedGrasp, DecodeOptions, decode_grasp
from perception.core.geometry import NetworkView
from perception.core.grasp import Grasp
from perception.core.preprocess import preprocess, to_network_input

__all__ = ["EvalPolicy", "OnnxPolicy", "TorchPolicy", "decoded_at"]


class EvalPolicy(Protocol):
    """A policy under evaluation: ``policy(raw_rgb) -> DecodedGrasp``.

    ``uses_pixels = False`` lets the evaluator skip rendering (the policy is then called
    with ``None``); ``bind(ctx)``, when present, is called before every attempt;
    ``takes_calibration = True`` means ``policy(raw_rgb, calibration=...)`` accepts the
    calibration of the camera that took the frame.
    """

    name: str
    uses_pixels: bool

    def __call__(self, raw_rgb: np.ndarray | None) -> DecodedGrasp: ...


def decoded_at(grasp: Grasp, calib: Calibration) -> DecodedGrasp:
    """``grasp`` as a decode answer, with the raw pixel its centre projects to."""
    px = project_points(np.asarray([grasp.position]), calib)[0]
    return DecodedGrasp(grasp=grasp, view_pixel=None, pixel=(float(px[0]), float(px[1])), reason=None)


class OnnxPolicy:
    """The exported artifact, run exactly as the service runs it.

    Args:
        artifact_dir: the artifact folder.
        calibration: the serving calibration (``None``: the artifact's own).
        threshold: quality threshold (``None``: the artifact's ``quality_threshold``).
        workspace_margin: metres the workspace is shrunk by in the decode.
        intra_op_num_threads: onnxruntime threads.
    """

    uses_pixels = True
    takes_calibration = True

    def __init__(
        self,
        artifact_dir: str | Path,
        calibration: Calibration | str | Path | None = None,
        threshold: float | None = None,
        workspace_margin: float = 0.0,
        intra_op_num_threads: int | None = None,
        precision: str = "auto",
    ) -> None:
        self.runner = PolicyRunner(artifact_dir, calibration, intra_op_num_threads=intra_op_num_threads,
                                   precision=precision)
        self.threshold = float(self.runner.meta.quality_threshold if threshold is None else threshold)
        self.workspace_margin = float(workspace_margin)
        self.options = self.runner.meta.decode_options.replace(threshold=self.threshold,
                                                               workspace_margin=self.workspace_margin)
        self.name = f"onnx:{Path(artifact_dir).name}"

    @property
    def calibration(self) -> Calibration:
        return self.runner.calib

    @property
    def view(self) -> NetworkView:
        return self.runner.view

    @property
    def angle_bins(self) -> int:
        return self.runner.meta.angle_bins

    def __call__(self, raw_rgb: np.ndarray | None, calibration: Calibration | None = None) -> DecodedGrasp:
        """Grasp for one raw frame; ``calibration`` overrides the serving one for this frame."""
        _, dec = self.runner.decide(raw_rgb, self.options, calibration=calibration)
        return dec


class TorchPolicy:
    """A :class:`~policies.networks.GraspNet` (or a module holding one) in memory.

    Args:
        module: the network or :class:`~policies.module.GraspPolicyModule`.
        view, calibration: the network view and nominal calibration; taken from the
            module's hyperparameters when ``None``.
        threshold: quality threshold.
        device: torch device.
    """

    uses_pixels = True
    takes_calibration = True

    def __init__(
        self,
        module: Any,
        view: NetworkView | None = None,
        calibration: Calibration | None = None,
        threshold: float = 0.5,
        workspace_margin: float = 0.0,
        device: str = "cpu",
    ) -> None:
        import torch  # lazy: torch (only for a network in memory)

        from policies.networks import ExportWrapper  # lazy: torch (only for a network in memory)

        hp = getattr(module, "hparams", {}) or {}
        if view is None:
            if not hp.get("view"):
                raise ValueError("TorchPolicy needs a view (the module has none in its hyperparameters)")
            view = NetworkView.from_dict(hp["view"])
        if calibration is None:
            if not hp.get("calibration"):
                raise ValueError("TorchPolicy needs a calibration (the module has none in its hyperparameters)")
            calibration = Calibration.from_dict(hp["calibration"], check_view=False)
        self.net = getattr(module, "net", module).to(device).eval()
        self.view, self.calibration = view, calibration
        self.angle_bins = int(self.net.angle_bins)
        self.threshold = float(threshold)
        self.workspace_margin = float(workspace_margin)
        # The decode options and the exported graph's forward (with its test-time mirror
        # average when configured) the policy was trained with, as its artifact carries them.
        pcfg = (hp.get("config") or {}).get("policy", {})
        # The same check of them as the artifact's and the config's (DecodeOptions.from_dict).
        self.options = DecodeOptions.from_dict(pcfg.get("decode") or {}, threshold=self.threshold,
                                               workspace_margin=self.workspace_margin)
        self.graph = ExportWrapper(self.net, bool(pcfg.get("flip_average", False))).to(device).eval()
        self.device = device
        self._torch = torch
        self.name = "torch"

    def maps(
        self, raw_rgb: np.ndarray, calibration: Calibration | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``quality (A, H, W)``, ``width (H, W)``, ``height (H, W)``, ``surface (H, W)`` of one raw frame."""
        torch = self._torch
        calib = self.calibration if calibration is None else calibration
        x = torch.from_numpy(to_network_input(preprocess(raw_rgb, calib, self.view))).to(self.device)
        with torch.no_grad():
            q, w, h, s = self.graph(x)
        return q[0].cpu().numpy(), w[0, 0].cpu().numpy(), h[0, 0].cpu().numpy(), s[0, 0].cpu().numpy()

    def __call__(self, raw_rgb: np.ndarray | None, calibration: Calibration | None = None) -> DecodedGrasp:
        """Grasp for one raw frame; ``calibration`` overrides the policy's for this frame."""
        calib = self.calibration if calibration is None else calibration
        q, w, h, s = self.maps(raw_rgb, calib)
        return decode_grasp(q, w, h, calib, self.view, self.options, surface=s)
