"""BAGEL's upstream code (github.com/ByteDance-Seed/Bagel) as the anchor of our generation engine.

`run_upstream` extracts upstream's `modeling/` and `data/` files (the archive in tests/upstream/, which says
where it comes from; or the HEAD of the git checkout `$BAGEL_UPSTREAM_GIT` names) into a temporary folder
and runs `bagel_upstream_run.py` on it in a subprocess. What is changed to run it here, all in that copy:

- `flash_attn` (CUDA-only) is replaced by `FLASH_ATTN_STANDIN`, a `flash_attn_varlen_func` over torch SDPA:
  the one mock. It keeps flash-attn's semantics: per-sequence cu_seqlens, grouped KV heads, scale
  head_dim**-0.5, and a causal mask aligned to the bottom right (queries are the last keys).
- qwen2_navit.py casts q/k/v (and the gen-mode hidden states) to bfloat16 for flash-attn; those casts are
  rewritten to float32, so the comparison runs in float32 on both sides (the test's tolerance is float32's).
- transformers 5 compatibility, in the runner: `ROPE_INIT_FUNCTIONS["default"]` (transformers 4's default
  rope formula, which upstream looks up and transformers 5 dropped), `pad_token_id = None` and an eager
  `_attn_implementation` on the llm config (transformers 4 defaults; upstream's packed forward uses neither).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["FLASH_ATTN_STANDIN", "UPSTREAM_ARCHIVE", "extract_upstream", "run_upstream"]

UPSTREAM_PATHS = ("modeling", "data/__init__.py", "data/data_utils.py", "data/transforms.py")
UPSTREAM_ARCHIVE = Path(__file__).with_name("upstream") / "bagel-056b5fd.tar.gz"
"""Upstream's UPSTREAM_PATHS (and LICENSE) at one commit: CI cannot reach GitHub (tests/upstream/README.md)."""
RUNNER = Path(__file__).with_name("bagel_upstream_run.py")
UPSTREAM_TIMEOUT_S = 900

FLASH_ATTN_STANDIN = '''\
"""Test-only stand-in for flash-attn's `flash_attn_varlen_func` over torch SDPA (flash-attn is CUDA-only).

Same contract: q (total_q, heads, d), k and v (total_k, kv_heads, d), sequences delimited by cu_seqlens,
query head h reads KV head h // (heads / kv_heads), softmax scale d**-0.5, and causal=True aligned to the bottom
right of each sequence's (q_len, k_len) matrix (query i sees keys up to k_len - q_len + i), as flash-attn >= 2.1.
"""

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, **unused):
    assert dropout_p == 0.0 and softmax_scale is None and not unused, "the stand-in covers inference calls only"
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        qi = q[int(cu_seqlens_q[i]):int(cu_seqlens_q[i + 1])]
        ki = k[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])]
        vi = v[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])]
        groups = qi.shape[1] // ki.shape[1]
        ki, vi = ki.repeat_interleave(groups, dim=1), vi.repeat_interleave(groups, dim=1)
        mask = None
        if causal:
            mask = torch.ones(qi.shape[0], ki.shape[0], dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=ki.shape[0] - qi.shape[0])
        out = F.scaled_dot_product_attention(
            qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None], attn_mask=mask
        )
        outputs.append(out[0].transpose(0, 1))
    # upstream's SigLIP casts q/k/v to bfloat16 for flash-attn and runs under autocast, which would take the
    # bfloat16 output into its float32 out_proj; here the output goes back to float32 instead
    return torch.cat(outputs).float() if q.dtype == torch.bfloat16 else torch.cat(outputs)
'''


def extract_upstream(dest: Path) -> Path:
    """Upstream's files, adapted as the module docstring says, under `dest`; returns `dest`."""
    git = os.environ.get("BAGEL_UPSTREAM_GIT")
    if git:
        archive = subprocess.run(
            ["git", "--git-dir", git, "archive", "HEAD", *UPSTREAM_PATHS], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        subprocess.run(["tar", "-xz", "-C", str(dest), "-f", str(UPSTREAM_ARCHIVE), *UPSTREAM_PATHS], check=True)
    (dest / "flash_attn.py").write_text(FLASH_ATTN_STANDIN)
    navit = dest / "modeling" / "bagel" / "qwen2_navit.py"
    source = navit.read_text()
    casts = source.count("torch.bfloat16")
    # upstream hard-codes bfloat16 for flash-attn; if these casts move, the float32 anchor must be re-checked
    assert casts >= 10, f"upstream qwen2_navit.py has {casts} bfloat16 casts; the float32 rewrite expects them"
    navit.write_text(source.replace("torch.bfloat16", "torch.float32"))
    return dest


def run_upstream(model: Path, inputs: dict[str, Any], work: Path) -> dict[str, Any]:
    """Upstream's contexts, latents and decoded images for `inputs` (the format in bagel_upstream_run.py)."""
    import torch

    (work / "upstream").mkdir()
    upstream = extract_upstream(work / "upstream")
    inputs_file, outputs_file = work / "inputs.pt", work / "outputs.pt"
    torch.save(inputs, inputs_file)
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(upstream), str(model), str(inputs_file), str(outputs_file)],
        capture_output=True,
        text=True,
        timeout=UPSTREAM_TIMEOUT_S,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, f"upstream BAGEL run failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    return torch.load(outputs_file)
