"""FP8 matmuls of a diffusion stage's denoiser (engine arg `quantization: fp8`): `Fp8Linear`, `to_fp8`.

Weights are quantized once per output row at load, activations per token at each call, and each Linear of
the repeated blocks becomes one `torch._scaled_mm` (Hopper's FP8 tensor cores) with bf16 output.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["Fp8Linear", "to_fp8"]


class Fp8Linear:
    """Builds FP8 replacements for `torch.nn.Linear`: weights quantized once per output row, activations per
    token at each call, one `torch._scaled_mm` (Hopper's FP8 tensor cores) with bf16 output."""

    FP8_MAX = 448.0  # largest finite float8_e4m3fn

    @staticmethod
    def convertible(linear: Any) -> bool:
        """`_scaled_mm` needs both matrix dimensions to be multiples of 16."""
        return linear.in_features % 16 == 0 and linear.out_features % 16 == 0

    @staticmethod
    def build(linear: Any) -> Any:
        """The FP8 module replacing `linear` (its weights are quantized here, once)."""
        return _fp8_module_class()(linear)


@functools.cache
def _fp8_module_class() -> Any:
    """One class for every FP8 layer, made once: torch.compile guards on a module's class, so a class per
    layer would compile each block anew (torch is imported only when a stage asks for fp8)."""
    import torch

    fp8_max = Fp8Linear.FP8_MAX

    class Fp8LinearModule(torch.nn.Module):
        def __init__(self, src: torch.nn.Linear) -> None:
            super().__init__()
            w = src.weight.detach()
            scale = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / fp8_max
            # (out, in) row-major, so .t() below is the column-major operand _scaled_mm wants.
            self.register_buffer("weight_fp8", (w.float() / scale).to(torch.float8_e4m3fn))
            self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
            self.bias = None if src.bias is None else torch.nn.Parameter(src.bias.detach(), requires_grad=False)
            self.in_features, self.out_features = src.in_features, src.out_features

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            x_scale = flat.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / fp8_max
            xq = (flat.float() / x_scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
            # use_fast_accum: Hopper's FP8 MMA accumulates without the periodic FP32 promotion (faster; the
            # error stays within the bench's latents bound, as torchao does for forward matmuls).
            out = torch._scaled_mm(
                xq,
                self.weight_fp8.t(),
                scale_a=x_scale,
                scale_b=self.weight_scale,
                out_dtype=x.dtype,
                use_fast_accum=xq.is_cuda,
            )
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)

    return Fp8LinearModule


def to_fp8(blocks: list[Any]) -> int:
    """Every convertible Linear layer of `blocks` replaced by its FP8 module (`Fp8Linear`); returns how many."""
    import torch

    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and Fp8Linear.convertible(child):
                    setattr(parent, child_name, Fp8Linear.build(child))
                    count += 1
    return count
