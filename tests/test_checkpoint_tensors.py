"""A checkpoint that does not match its model (a tensor missing, or one unexpected) is refused naming the tensors, by
`eval`, by a stage loading it as its parent and by `load_checked`; never loaded with the gap left initialised or on
the meta device."""

from __future__ import annotations

import re

import pytest
from conftest import copy_run


def damaged(runs, tmp_path, drop: str = ".layers.1.", add: dict | None = None):
    import torch
    from safetensors.torch import load_file, save_file

    run = copy_run(runs, "final_only", tmp_path)
    tensors = {name: t for name, t in load_file(str(run / "model.safetensors")).items() if drop not in name}
    tensors.update({name: torch.zeros(2) for name in add or {}})
    save_file(tensors, str(run / "model.safetensors"), metadata={"format": "pt"})
    return run


def test_eval_refuses_a_checkpoint_with_a_layer_deleted(runs, tmp_path, capsys):
    from plugformer.cli import main

    run = damaged(runs, tmp_path)
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(run), "--split", "dev", "--examples", "4"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own load report
    assert re.match(
        r"ValueError: .*: the checkpoint does not match its model \(missing: model\.layers\.1\..*in all\)", last
    )


def test_a_stage_refuses_a_parent_with_unexpected_backbone_tensors(runs, tmp_path):
    from test_training import TINY, TRL

    from plugformer.training import run_stage

    run = damaged(runs, tmp_path, drop="no such tensor", add={"model.layers.9.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.9\.mlp\.up_proj\.weight\)"):
        run_stage("sft", ["--model_name_or_path", str(run), "--output_dir", str(tmp_path / "sft"), *TINY, *TRL])


@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_a_seq2seq_checkpoint_without_its_embedding_is_reported_and_refused(tmp_path, tie_word_embeddings):
    """The decoder shared the encoder's embedding module: transformers then took the encoder's embedding for an
    initialised tie target, so a checkpoint without it loaded unreported, the weight left on the meta device (and
    `load_checked` looked only under `model.`, which the seq2seq head, its own base model, has not)."""
    import torch
    from safetensors.torch import load_file, save_file

    from plugformer import PlugformerConfig, PlugformerForConditionalGeneration
    from plugformer.runtime.loading import load_checked

    config = PlugformerConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        is_encoder_decoder=True,
        is_causal=False,
        pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = PlugformerForConditionalGeneration(config)
    assert model.decoder.embed_tokens.weight is model.encoder.embed_tokens.weight  # one embedding, either way
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    reloaded = load_checked(PlugformerForConditionalGeneration, tmp_path)  # intact: loads, still one embedding
    assert reloaded.decoder.embed_tokens.weight is reloaded.encoder.embed_tokens.weight
    assert torch.equal(reloaded.encoder.embed_tokens.weight, weights["encoder.embed_tokens.weight"])
    del weights["encoder.embed_tokens.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded, info = PlugformerForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert "encoder.embed_tokens.weight" in info["missing_keys"]
    assert reloaded.encoder.embed_tokens.weight.device.type == "cpu"  # initialised, not left on meta
    with pytest.raises(ValueError, match=r"missing: .*encoder\.embed_tokens\.weight"):
        load_checked(PlugformerForConditionalGeneration, tmp_path)
