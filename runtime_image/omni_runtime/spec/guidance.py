"""The guidance of a BAGEL image: the request parameters the router bounds and the BAGEL dit stage reads.

Pure pydantic, so the router refuses a value out of bounds (400 naming the field) before any stage works, with
the same bounds the engine (`engines.diffusion.bagel`) applies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ROLES", "BagelGuidance", "Role"]

Role = Literal["primary", "cfg_text", "cfg_img"]
ROLES: tuple[Role, ...] = ("primary", "cfg_text", "cfg_img")
"""The contexts a generation reads: the request's own, the text-free companion, the image-free companion."""


class BagelGuidance(BaseModel):
    """How one BAGEL image is guided and scheduled. Defaults are upstream app.py's text-to-image ones; the
    bounds are the ranges upstream's own app offers (its sliders), except where noted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cfg_text_scale: float = Field(4.0, ge=1.0, le=8.0)
    """Text guidance: v_text + s (v - v_text), v_text from the cfg_text context. 1 turns it off (and runs no
    cfg_text forward). Upstream's app offers 1-8, default 4."""
    cfg_img_scale: float = Field(1.0, ge=1.0, le=4.0)
    """Image guidance (edits): v_img + s (v' - v_img), v_img from the cfg_img context. 1 turns it off; 1 is
    the text-to-image default (there the cfg_img context equals the primary one). Upstream's edit tab: 1-4,
    default 2."""
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    """(lo, hi): guidance applies at timesteps lo < t <= hi (t = 1 is pure noise). 0 <= lo < hi <= 1.
    Upstream: (0.4, 1) for text-to-image, (0, 1) for edits."""
    cfg_renorm_type: Literal["global", "channel", "text_channel"] = "global"
    """How the guided velocity's norm is capped at the unguided one's: `global` over all latent tokens,
    `channel` per token, `text_channel` per token on the text-guided velocity only, before image guidance
    (upstream's edit default)."""
    cfg_renorm_min: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of that renormalisation's scale factor (1 disables the cap; 0, the default, lets it shrink freely)."""
    timestep_shift: float = Field(3.0, ge=1.0, le=10.0)
    """s in t' = s t / (1 + (s - 1) t): above 1 spends more of the steps at high noise. Upstream's app
    offers 1-10 (edits; 1-5 for text-to-image), default 3."""

    @model_validator(mode="after")
    def _interval_in_order(self) -> BagelGuidance:
        lo, hi = self.cfg_interval
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"cfg_interval {[lo, hi]} must satisfy 0 <= lo < hi <= 1, e.g. [0.4, 1.0]")
        return self

    def roles(self) -> tuple[Role, ...]:
        """The contexts this guidance reads: primary, plus each companion whose scale is above 1."""
        out: list[Role] = ["primary"]
        if self.cfg_text_scale > 1.0:
            out.append("cfg_text")
        if self.cfg_img_scale > 1.0:
            out.append("cfg_img")
        return tuple(out)
