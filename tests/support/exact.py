"""transformers' own float32 forward of a ``qwen3_5`` model, as the reference the fused kernels are held to."""

import contextlib

import torch


@contextlib.contextmanager
def exact_float32():
    """No TF32 anywhere, and transformers' pure-torch Gated-DeltaNet: with FLA installed transformers calls its
    Triton kernels, which use TF32 dots on the GPU and cannot take a model on the CPU at all."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    torch_impl = m.torch_chunk_gated_delta_rule
    while hasattr(torch_impl, "__wrapped__"):
        torch_impl = torch_impl.__wrapped__
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        m.torch_chunk_gated_delta_rule,
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    m.torch_chunk_gated_delta_rule = torch_impl
    try:
        yield
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            m.torch_chunk_gated_delta_rule,
        ) = saved
