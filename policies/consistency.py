"""Task consistency for the sim->real generator, after RL-CycleGAN (Rao et al. 2020).

A CycleGAN keeps the *look* of the real camera but nothing forces it to keep what the grasp
policy needs (an object edge moved by two pixels is a different grasp). RL-CycleGAN adds a
loss that makes the task network agree on a sim frame and on its translation. Here the
policy is the task network and it is frozen: :func:`consistency_finetune` fine-tunes the
generator ``G`` so that

    L = task(policy(x), policy(G(x))) + anchor_weight * |G(x) - G0(x)|_1

is small, where ``x`` are sim view images, ``policy(x)`` is detached (the target), ``task``
is the mean squared difference of the grasp-quality probabilities plus the L1 difference
of height, surface and width in centimetres, and ``G0`` is a frozen copy of the generator before
fine-tuning (the anchor keeps the adversarially learned appearance: the discriminator is
not part of this cheap step). It is optional and cheap: a few hundred steps on 2 CPU cores.

Typical use (the pipeline's ``consistency`` option): train the policy on adapted frames,
fine-tune the generator with this function, then retranslate and fine-tune the policy.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from perception.core.progress import progress
from policies.networks import GraspNet

__all__ = ["task_disagreement", "consistency_finetune"]

log = logging.getLogger(__name__)


def task_disagreement(policy: GraspNet, a: torch.Tensor, b: torch.Tensor, detach_a: bool = True) -> torch.Tensor:
    """How much the policy's maps on ``a`` and ``b`` differ (both ``(N, 3, H, W)`` in [-1, 1]).

    Returns:
        ``mean (q_a - q_b)^2 + mean |h_a - h_b| + mean |s_a - s_b| + mean |w_a - w_b|`` (heights,
        surfaces and widths in cm).
    """
    ctx = torch.no_grad() if detach_a else torch.enable_grad()
    with ctx:
        oa = policy(a)
    ob = policy(b)
    qa, qb = torch.sigmoid(oa["quality_logits"]), torch.sigmoid(ob["quality_logits"])
    return (
        (qa - qb).pow(2).mean()
        + 100.0 * (oa["height"] - ob["height"]).abs().mean()
        + 100.0 * (oa["surface"] - ob["surface"]).abs().mean()
        + 100.0 * (oa["width"] - ob["width"]).abs().mean()
    )


def _batches(data: Dataset | DataLoader | Iterable, batch_size: int) -> Iterable:
    if isinstance(data, Dataset):
        return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=len(data) >= batch_size)  # type: ignore[arg-type]
    return data


def consistency_finetune(
    generator: nn.Module,
    policy: nn.Module,
    sim_frames: Dataset | DataLoader | Iterable,
    steps: int = 200,
    lr: float = 5e-5,
    batch_size: int = 8,
    anchor_weight: float = 1.0,
    device: str | torch.device = "cpu",
    max_time_s: float | None = None,
) -> dict:
    """Fine-tune ``generator`` in place so that the policy agrees on sim and adapted frames.

    Args:
        generator: sim->real generator, ``(N, 3, H, W)`` in [-1, 1] -> same (adaptation's).
        policy: a :class:`GraspNet` or a module holding one as ``.net`` (frozen here).
        sim_frames: a dataset of ``{"image": (3, H, W)}`` items (e.g. ``PolicyFrames`` without a
            translator) or an iterable of such batches.
        steps: optimisation steps.
        lr: Adam learning rate.
        batch_size: when ``sim_frames`` is a dataset.
        anchor_weight: weight of the L1 anchor to the generator before fine-tuning.
        device: where to run.
        max_time_s: stop early after this long.

    Returns:
        ``steps``, ``time_s``, ``disagreement_before`` and ``disagreement_after`` (mean
        :func:`task_disagreement` over the first and the last 10% of the steps), ``anchor_l1``.
    """
    net = getattr(policy, "net", policy)
    net_mode = net.training
    net.eval().to(device)
    for p in net.parameters():
        p.requires_grad_(False)
    g_mode = generator.training
    generator.to(device).train()
    anchor = copy.deepcopy(generator).eval()
    for p in anchor.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in generator.parameters() if p.requires_grad], lr=lr, betas=(0.5, 0.999))
    t0 = time.perf_counter()
    hist: list[float] = []
    anchor_hist: list[float] = []
    step = 0
    bar = progress(total=int(steps), desc="task consistency", unit="step")
    try:
        while step < steps:
            progressed = False
            for batch in _batches(sim_frames, batch_size):
                x = (batch["image"] if isinstance(batch, dict) else batch).to(device)
                y = generator(x)
                with torch.no_grad():
                    y0 = anchor(x)
                task = task_disagreement(net, x, y)
                anc = F.l1_loss(y, y0)
                loss = task + anchor_weight * anc
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                hist.append(task.item())
                anchor_hist.append(anc.item())
                step += 1
                progressed = True
                bar.update(1)
                if step >= steps or (max_time_s is not None and time.perf_counter() - t0 > max_time_s):
                    steps = step
                    break
            if not progressed:
                raise ValueError("consistency_finetune got no sim frames")
    finally:
        bar.close()
        for p in net.parameters():
            p.requires_grad_(True)
        net.train(net_mode)
        generator.train(g_mode)
    k = max(1, len(hist) // 10)
    out = {
        "steps": len(hist),
        "time_s": time.perf_counter() - t0,
        "disagreement_before": sum(hist[:k]) / k if hist else float("nan"),
        "disagreement_after": sum(hist[-k:]) / k if hist else float("nan"),
        "anchor_l1": sum(anchor_hist[-k:]) / k if anchor_hist else float("nan"),
    }
    log.info("task-consistency fine-tune: %d steps, disagreement %.4f -> %.4f", out["steps"],
             out["disagreement_before"], out["disagreement_after"])
    return out
