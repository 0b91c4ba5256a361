"""BAGEL's flow-matching sampler and its classifier-free guidance (upstream `generate_image` / `_forward_flow`).

Timesteps run from 1 (noise) to 0 (image), shifted by `timestep_shift` (t' = s t / (1 + (s - 1) t)); each step
moves the latents against the velocity: x <- x - v(x, t) (t_i - t_{i+1}). Inside `cfg_interval` (lo < t <= hi)
the velocity is guided by the companions' velocities: text guidance with the cfg_text context (the prompt left
out), then image guidance with the cfg_img context (the input image left out), then a renormalisation that caps
the guided velocity's norm at the unguided one's (`cfg_renorm_type`, floor `cfg_renorm_min`). A branch whose
scale is 1 at a step runs no forward at that step.

One choice differs from upstream: upstream skips all guidance, image guidance included, when
cfg_text_scale is 1 (its branch runs the cfg_img forward and drops the result). Here image guidance then
still applies: it is upstream's own formula at text scale 1 (text guidance is the identity there), and a
request that asks for image guidance never silently gets none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from omni_runtime.spec.guidance import ROLES, BagelGuidance, Role

__all__ = [
    "ROLES",
    "BagelGuidance",
    "Role",
    "SampleResult",
    "VelocityFn",
    "guide",
    "sample",
    "timesteps",
]

VelocityFn = Callable[[Role, torch.Tensor, torch.Tensor], torch.Tensor]
"""`fn(role, x_t, t)`: the velocity of latents x_t at timestep t (a 0-d float32 tensor) in that role's context."""


@dataclass(frozen=True)
class SampleResult:
    """The denoised latent tokens and how many velocity forwards each role ran."""

    latents: torch.Tensor
    """(tokens, p*p*z), float32."""
    forwards: dict[Role, int]


def timesteps(steps: int, shift: float) -> torch.Tensor:
    """The `steps + 1` timesteps from 1 to 0 (float32), shifted: upstream's schedule with num_timesteps = steps + 1."""
    if steps < 1:
        raise ValueError(f"steps: {steps} is not allowed; use 1 or more")
    t = torch.linspace(1, 0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def guide(
    v: torch.Tensor,
    v_text: torch.Tensor | None,
    v_img: torch.Tensor | None,
    *,
    text_scale: float,
    img_scale: float,
    renorm_type: str,
    renorm_min: float,
) -> torch.Tensor:
    """The guided velocity from the primary `v` and the companions' (None where that scale is 1)."""
    text_on, img_on = text_scale > 1.0 and v_text is not None, img_scale > 1.0 and v_img is not None
    if not (text_on or img_on):
        return v
    if renorm_type == "text_channel":
        v_text_guided = v
        if text_on:
            assert v_text is not None
            raw = v_text + text_scale * (v - v_text)
            factor = torch.norm(v, dim=-1, keepdim=True) / (torch.norm(raw, dim=-1, keepdim=True) + 1e-8)
            v_text_guided = raw * factor.clamp(min=renorm_min, max=1.0)
        if not img_on:
            return v_text_guided
        assert v_img is not None
        return v_img + img_scale * (v_text_guided - v_img)
    guided = v
    if text_on:
        assert v_text is not None
        guided = v_text + text_scale * (v - v_text)
    if img_on:
        assert v_img is not None
        guided = v_img + img_scale * (guided - v_img)
    if renorm_type == "global":
        norm_v, norm_guided = torch.norm(v), torch.norm(guided)
    elif renorm_type == "channel":
        norm_v, norm_guided = torch.norm(v, dim=-1, keepdim=True), torch.norm(guided, dim=-1, keepdim=True)
    else:
        raise ValueError(f"cfg_renorm_type {renorm_type!r} is not one of global, channel, text_channel")
    return guided * (norm_v / (norm_guided + 1e-8)).clamp(min=renorm_min, max=1.0)


def sample(
    noise: torch.Tensor,
    velocity: VelocityFn,
    guidance: BagelGuidance,
    steps: int,
    on_step: Callable[[int], None] | None = None,
) -> SampleResult:
    """Denoise `noise` (tokens, p*p*z) in `steps` Euler steps; the latents stay float32 whatever the model runs in.
    `on_step(i)` runs after step i (an engine times steps there, and raises there to stop an aborted request)."""
    schedule = timesteps(steps, guidance.timestep_shift)
    lo, hi = guidance.cfg_interval
    forwards: dict[Role, int] = dict.fromkeys(ROLES, 0)

    def run(role: Role, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        forwards[role] += 1
        return velocity(role, x, t)

    x = noise.to(torch.float32).clone()
    for i in range(steps):
        t = schedule[i]
        # compared in float32, as upstream does (its t is a float32 tensor): the edges of the interval match
        inside = bool(t > lo) and bool(t <= hi)
        text_scale = guidance.cfg_text_scale if inside else 1.0
        img_scale = guidance.cfg_img_scale if inside else 1.0
        v = run("primary", x, t)
        v_text = run("cfg_text", x, t) if text_scale > 1.0 else None
        v_img = run("cfg_img", x, t) if img_scale > 1.0 else None
        v = guide(
            v,
            v_text,
            v_img,
            text_scale=text_scale,
            img_scale=img_scale,
            renorm_type=guidance.cfg_renorm_type,
            renorm_min=guidance.cfg_renorm_min,
        )
        x = x - v.to(torch.float32) * (schedule[i] - schedule[i + 1])
        if on_step is not None:
            on_step(i)
    return SampleResult(latents=x, forwards=forwards)
