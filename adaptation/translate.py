"""Applying a trained sim->real generator: in Python, in a DataLoader, or from the shell.

- :func:`load_generator` reads ``generator.pt`` (a plain state_dict, loaded with
  ``weights_only=True``) + ``generator.json`` from a training ``output_dir``, the files
  themselves, or a Lightning checkpoint of :class:`~adaptation.module.CycleGANModule`
  (its EMA generator).
- :func:`translate` maps network-view frames ``(H, W, 3)`` or ``(N, H, W, 3)`` uint8 RGB to
  adapted frames of the same shape, dtype and range.
- :class:`Translator` is a small picklable callable for a policy's data loader: it holds the
  weights, builds the network lazily in each worker (one CPU thread by default) and can
  start from raw camera frames (``preprocess`` first).
- ``sim2real-translate generator=DIR input=DIR output_dir=DIR`` writes adapted PNG frames.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from torch import nn

from adaptation.images import IMAGE_SUFFIXES, RealFramesError, read_rgb
from adaptation.networks import build
from perception.core.atomic import atomic_write
from perception.core.calibration import load_calibration
from perception.core.cli import compose_config, config_number
from perception.core.geometry import NetworkView, network_view
from perception.core.jsonio import write_json
from perception.core.preprocess import preprocess

__all__ = ["GeneratorError", "load_generator", "save_generator", "generator_view", "translate", "Translator", "main"]


class GeneratorError(ValueError):
    """A generator file is missing, malformed or not one of ours."""


def _from_checkpoint(path: Path) -> tuple[dict, dict]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise GeneratorError(f"{path} is not a readable checkpoint: {exc}") from exc
    try:
        config = ckpt["hyper_parameters"]["config"]
        prefix = "G_sim2real_ema."
        state = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    except (KeyError, TypeError) as exc:
        raise GeneratorError(f"{path} is not a sim2real-adapt checkpoint (no config or EMA generator)") from exc
    if not state:
        raise GeneratorError(f"{path} holds no EMA generator weights")
    a = config["adaptation"]
    meta = {
        "format": "sim2real-grasp/generator",
        "version": 1,
        "generator": dict(a["generator"]),
        "image_size": list(a["image_size"]),
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "source": str(path),
    }
    return state, meta


def _read(path: str | Path) -> tuple[dict, dict]:
    p = Path(path)
    if p.is_dir():
        p = p / "generator.pt"
    if not p.exists():
        raise GeneratorError(f"generator {p} does not exist; train one with sim2real-adapt output_dir=DIR")
    if p.suffix == ".ckpt":
        return _from_checkpoint(p)
    meta_path = p.with_suffix(".json")
    if not meta_path.is_file():
        raise GeneratorError(f"{meta_path} (the generator's config) is missing beside {p}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GeneratorError(f"{meta_path} is not valid JSON: {exc}") from exc
    if meta.get("format") != "sim2real-grasp/generator":
        raise GeneratorError(f"{meta_path} is not a sim2real-grasp generator config")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise GeneratorError(f"{p} is not a readable state_dict: {exc}") from exc
    return state, meta


def save_generator(state: dict, meta: dict, out_dir: str | Path) -> Path:
    """Write ``generator.pt`` (a plain state_dict, tensors on the CPU) and ``generator.json``
    into ``out_dir``, each atomically; what :func:`load_generator` reads."""

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().clone() for k, v in state.items()}
    atomic_write(d / "generator.pt", lambda fh: torch.save(weights, fh))
    write_json(d / "generator.json", meta, indent=2)
    return d / "generator.pt"


def _build(state: dict, meta: dict, device: torch.device | str) -> nn.Module:
    spec = dict(meta["generator"])
    name = spec.pop("name")
    net = build("generator", name, **spec)
    net.load_state_dict(state)
    net.eval().requires_grad_(False)
    net.to(device)
    net.meta = meta  # type: ignore[attr-defined]
    return net


def load_generator(ckpt_or_dir: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Load the sim->real generator for inference.

    Args:
        ckpt_or_dir: a training ``output_dir`` (its ``generator.pt`` is the best EMA generator),
            a ``generator.pt`` (with ``generator.json`` beside it) or a ``.ckpt`` checkpoint.
        device: where the network goes.

    Returns:
        The generator in eval mode; ``generator.meta`` holds its ``generator.json`` content
        (``image_size`` ``[W, H]`` it was trained at, the network config, metrics).

    Raises:
        GeneratorError: missing or malformed files.
    """
    state, meta = _read(ckpt_or_dir)
    return _build(state, meta, device)


def generator_view(meta: dict, calib: Any, size: tuple[int, int]) -> Any:
    """The network view a generator was trained in, for frames of ``calib``'s camera.

    A table view is fixed in base coordinates and is taken as it was trained; a camera
    view (and a generator from before views were recorded) is rebuilt on ``calib``.
    """

    v = meta.get("view") if meta else None
    if v and v.get("kind") == "table":
        return NetworkView.from_dict(v)
    return network_view(calib, size)


def _trained_size(generator: nn.Module) -> tuple[int, int] | None:
    meta = getattr(generator, "meta", None) or {}
    size = meta.get("image_size")
    return (int(size[0]), int(size[1])) if size else None


@torch.no_grad()
def translate(
    frames: np.ndarray,
    generator: nn.Module,
    device: torch.device | str | None = None,
    batch_size: int = 32,
    resize: bool = True,
) -> np.ndarray:
    """Translate network-view frames from sim to real.

    Args:
        frames: ``(H, W, 3)`` or ``(N, H, W, 3)`` uint8 RGB, already in the network view
            (:func:`perception.core.preprocess.preprocess`).
        generator: from :func:`load_generator`.
        device: where to run (default: the generator's device).
        batch_size: frames per forward pass.
        resize: frames of another size than the generator was trained at are resized to it
            and back (the view is the same camera, so only the resolution changes); with
            ``False`` the network runs at the frames' size (sides must be multiples of 4).

    Returns:
        Adapted frames, same shape and dtype (uint8, 0-255) as ``frames``.
    """
    arr = np.asarray(frames)
    if arr.dtype != np.uint8 or arr.ndim not in (3, 4) or arr.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (H, W, 3) or (N, H, W, 3) RGB, got {arr.dtype} {arr.shape}")
    single = arr.ndim == 3
    batch = arr[None] if single else arr
    if device is None:
        p = next(generator.parameters(), None)
        device = p.device if p is not None else "cpu"
    n, h, w = batch.shape[:3]
    size = _trained_size(generator)
    work = batch
    if resize and size is not None and (w, h) != size:
        interp = cv2.INTER_AREA if w > size[0] else cv2.INTER_LINEAR
        work = np.stack([cv2.resize(f, size, interpolation=interp) for f in batch])
    elif work.shape[1] % 4 or work.shape[2] % 4:
        raise ValueError(f"frames of {w}x{h}: sides must be multiples of 4 (or use resize=True)")
    out = np.empty_like(work)
    for i in range(0, n, batch_size):
        x = torch.from_numpy(np.ascontiguousarray(work[i : i + batch_size])).to(device)
        x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        y = generator(x)
        out[i : i + batch_size] = ((y + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    if work is not batch:
        interp = cv2.INTER_LINEAR if w > size[0] else cv2.INTER_AREA
        out = np.stack([cv2.resize(f, (w, h), interpolation=interp) for f in out])
    return out[0] if single else out


class Translator:
    """A picklable sim->real translator for data loaders (CPU by default).

    Args:
        generator: a path for :func:`load_generator`, or a loaded generator.
        device: where to run; in DataLoader workers keep ``"cpu"``.
        p: probability of translating a frame (``1.0``: always; below 1 mixes raw sim frames in).
        num_threads: torch threads set in the process on first use (``None``, the default,
            leaves them: the translator usually runs inside a trainer's process, whose
            threads it must not take away; set 1 in DataLoader worker processes).
        resize: see :func:`translate`.

    Example::

        tr = Translator("outputs/adapt")         # picklable: hand it to a Dataset
        adapted = tr(view_rgb)                   # (H, W, 3) uint8 -> same
        adapted = tr.from_raw(raw_rgb, calib, view)  # preprocess first
    """

    def __init__(
        self,
        generator: str | Path | nn.Module,
        device: str = "cpu",
        p: float = 1.0,
        num_threads: int | None = None,
        resize: bool = True,
    ) -> None:
        if isinstance(generator, nn.Module):
            meta = getattr(generator, "meta", None)
            if meta is None:
                raise GeneratorError("a generator module given to Translator needs .meta (use load_generator)")
            self._state = {k: v.detach().cpu().clone() for k, v in generator.state_dict().items()}
            self.meta = dict(meta)
        else:
            self._state, self.meta = _read(generator)
        self.device = device
        self.p = float(p)
        self.num_threads = num_threads
        self.resize = resize
        self._net: nn.Module | None = None

    @property
    def image_size(self) -> tuple[int, int]:
        """``(W, H)`` the generator was trained at (the network view's size)."""
        return int(self.meta["image_size"][0]), int(self.meta["image_size"][1])

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_net"] = None  # rebuilt in the worker
        return d

    @property
    def net(self) -> nn.Module:
        if self._net is None:
            if self.num_threads:
                torch.set_num_threads(int(self.num_threads))
            self._net = _build(self._state, self.meta, self.device)
        return self._net

    def __call__(self, frames: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Translate view frames (``(H, W, 3)`` or ``(N, H, W, 3)`` uint8); see :func:`translate`."""
        if self.p < 1.0:
            r = (rng or np.random.default_rng()).random()
            if r >= self.p:
                return np.asarray(frames)
        return translate(frames, self.net, self.device, resize=self.resize)

    def from_raw(self, raw_rgb: np.ndarray, calib: Any, view: Any = None) -> np.ndarray:
        """Preprocess a raw frame into the view (default: the generator's) and translate it."""

        view = view if view is not None else generator_view(self.meta, calib, self.image_size)
        return self(preprocess(raw_rgb, calib, view))


# --------------------------------------------------------------------------- CLI
def run(args) -> dict[str, Any]:
    """The CLI's work: translate every frame of ``args['input']`` into ``args['output_dir']``.

    ``args``: ``conf/translate.yaml``'s keys (a mapping).
    """

    for key in ("generator", "input", "output_dir"):
        if not args.get(key):
            raise ValueError(f"{key}= is required; see sim2real-translate --help")
    device = str(args.get("device") or "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    bs = config_number(args, "batch_size", int, lo=1)
    raw = args.get("raw", True)
    if not isinstance(raw, bool):
        raise ValueError(f"raw must be true or false, got {raw!r}")
    gen = load_generator(args["generator"], device)
    size = _trained_size(gen)
    inp = Path(args["input"])
    out = Path(args["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    calib = load_calibration(args.get("calibration"))
    frames: list[np.ndarray] = []
    if (inp / "manifest.json").is_file():
        from adaptation.data import open_sim_dataset  # lazy: lightning via adaptation.data

        ds = open_sim_dataset(inp)
        view = generator_view(getattr(gen, "meta", {}), ds.calibration, size)
        frames = [preprocess(ds[i]["rgb"], ds[i]["camera"] if view.is_table else ds.calibration, view)
                  for i in range(len(ds))]
    elif inp.is_dir():
        files = sorted(p for p in inp.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"input folder {inp} holds no *.png or *.jpg frames")
        view = generator_view(getattr(gen, "meta", {}), calib, size)
        for f in files:
            img = read_rgb(f)
            frames.append(preprocess(img, calib, view) if raw else img)
    else:
        raise ValueError(f"input {inp} is not a folder")
    n = 0
    for i in range(0, len(frames), bs):
        chunk = frames[i : i + bs]
        sizes = {f.shape for f in chunk}
        adapted = translate(np.stack(chunk), gen, device) if len(sizes) == 1 else [translate(f, gen, device) for f in chunk]
        for img in adapted:
            cv2.imwrite(str(out / f"adapted_{n:05d}.png"), np.ascontiguousarray(img[:, :, ::-1]))
            n += 1
    info = {
        "frames": n, "generator": str(args["generator"]), "input": str(inp), "output_dir": str(out),
        "image_size": list(size or ()),
    }
    write_json(out / "translate.json", info, indent=2)
    return info


def main(argv: Sequence[str] | None = None) -> None:
    prog = "sim2real-translate"
    cfg = compose_config("translate", list(sys.argv[1:] if argv is None else argv), prog, __doc__ or "")
    try:
        info = run(cfg)
    except (GeneratorError, RealFramesError, ValueError, OSError) as exc:
        print(f"sim2real-translate: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"sim2real-translate: wrote {info['frames']} adapted frames to {info['output_dir']}")


if __name__ == "__main__":
    main()
