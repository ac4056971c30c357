"""Dynamic-shape export: `torch.export` with a `Dim` for batch and sequence, and ONNX (dynamo) run by onnxruntime at
a second shape, for every attention_score x position_scheme. The blockwise kernels run as one block while traced
with symbolic sizes (`kernels.symbolic_sizes`): before, their Python loops specialised the graph to the traced
length (torch.export refused; ONNX wrote a fixed-shape graph)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import SCHEMES, SCORES, build, tiny_config
from tolerances import model_tolerance
from torch.export import Dim

from plugformer import ATTENTION_SCORES


class Logits(torch.nn.Module):
    """The exported function: ids and padding mask -> logits, no cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def example_inputs(batch: int, length: int, seed: int, left_padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, :left_padding] = 0
    return ids, mask


DYNAMIC = ({0: Dim("batch", min=1, max=8), 1: Dim("sequence", min=2, max=60)},) * 2
ALL_VARIANTS = [pytest.param(score, scheme, id=f"{score}-{scheme}") for score in SCORES for scheme in SCHEMES]
# the variants whose kernels loop over blocks or chunks (the ones that specialised), one per kernel path
LOOPING = [("scaled_dot", "clamped_bias"), ("additive", "alibi")]


def assert_equal_on_real_tokens(actual, expected, mask, config):
    # a padding query attends to nothing; kernels and runtimes fill that row differently. The exported program and
    # the runtime compute the same model in other kernels: fp32's rounding through it (`model_tolerance`)
    real = mask.bool()
    atol = model_tolerance(config, expected, magnitude=max(expected[real].abs().max().item(), 1.0))
    torch.testing.assert_close(torch.as_tensor(actual)[real], expected[real], atol=atol, rtol=0)


def check_torch_export(score, scheme):
    model = Logits(build(tiny_config(score, scheme), "sdpa" if ATTENTION_SCORES.get(score).dot_product else "eager"))
    program = torch.export.export(model, example_inputs(2, 8, 0), dynamic_shapes=DYNAMIC, strict=False)
    ids, mask = example_inputs(3, 13, 1, left_padding=4)  # another batch and length, left padding
    with torch.no_grad():
        assert_equal_on_real_tokens(program.module()(ids, mask), model(ids, mask), mask, tiny_config(score, scheme))


@pytest.mark.parametrize(("score", "scheme"), LOOPING)
def test_torch_export_with_dynamic_batch_and_sequence(score, scheme):
    check_torch_export(score, scheme)


@pytest.mark.slow
@pytest.mark.parametrize(("score", "scheme"), ALL_VARIANTS)
def test_torch_export_with_dynamic_batch_and_sequence_every_variant(score, scheme):
    check_torch_export(score, scheme)


ONNX = all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript", "onnxruntime"))


@pytest.mark.slow  # 15-25 s a variant on 2 CPU cores
@pytest.mark.skipif(not ONNX, reason="needs the onnx extra (pip install plugformer[onnx])")
@pytest.mark.parametrize(("score", "scheme"), ALL_VARIANTS)
def test_onnx_export_runs_at_another_shape(score, scheme, tmp_path):
    import onnxruntime

    model = Logits(build(tiny_config(score, scheme), "sdpa" if ATTENTION_SCORES.get(score).dot_product else "eager"))
    program = torch.onnx.export(
        model,
        example_inputs(2, 8, 0),
        dynamo=True,
        dynamic_shapes=DYNAMIC,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits"],
    )
    program.save(str(tmp_path / "model.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"))
    ids, mask = example_inputs(3, 13, 1, left_padding=4)
    (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        assert_equal_on_real_tokens(torch.from_numpy(logits), model(ids, mask), mask, tiny_config(score, scheme))
