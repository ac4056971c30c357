"""Length extrapolation: windowed perplexity against the model's own loss, clean limits for learned positions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from plugformer import POSITION_SCHEMES, PlugformerConfig, PlugformerForCausalLM, train_tokenizer
from plugformer.data.packing import pack
from plugformer.experiments.extrapolation import ExtrapolationArguments, run, token_stream, window_perplexity


CONFIGS = str(Path(__file__).parents[1] / "configs" / "{stage}" / "tiny.yaml")


def test_window_perplexity_equals_the_mean_loss_of_each_window():
    torch.manual_seed(0)
    model = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", position_scheme="alibi")).eval()
    stream = torch.randint(0, model.config.vocab_size, (100,))
    # 100 tokens at length 16: 6 windows (4 tokens left over), each predicting 15 tokens with the model's own loss
    losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in stream[:96].view(6, 16)]
    assert window_perplexity(model, stream, 16, batch_size=4) == pytest.approx(math.exp(sum(losses) / 6), rel=1e-5)


def test_token_stream_concatenates_documents_and_refuses_too_few_tokens():
    tokenizer = train_tokenizer(["1 + 2 = 3", "4 + 5 = 9"] * 20, vocab_size=300)
    stream = token_stream(tokenizer, ["1 + 2 = 3", "4 + 5 = 9"], 6)
    first = tokenizer(tokenizer.bos_token + "1 + 2 = 3" + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert stream.tolist() == first[:6]
    with pytest.raises(ValueError, match="test_examples"):
        token_stream(tokenizer, ["1 + 2 = 3"], 10_000)


def test_schemes_declare_their_longest_length():
    config = PlugformerConfig.from_preset("tiny", max_position_embeddings=48)
    limits = {name: POSITION_SCHEMES.get(name).max_length(config) for name in POSITION_SCHEMES.names()}
    assert limits.pop("learned") == 48
    assert set(limits.values()) == {None}  # every other scheme encodes any length


def test_contiguous_packing_has_no_document_positions():
    tokenizer = train_tokenizer(["1 + 2 = 3", "4 + 5 = 9"] * 20, vocab_size=300)
    examples = {"text": ["1 + 2 = 3", "4 + 5 = 9", "10 + 1 = 11"]}
    per_document = pack(examples, tokenizer, block_size=8, causal=True)
    contiguous = pack(examples, tokenizer, block_size=8, causal=True, document_positions=False)
    assert contiguous["input_ids"].tolist() == per_document["input_ids"].tolist() == contiguous["labels"].tolist()
    assert "position_ids" not in contiguous and per_document["position_ids"][0][0] == 0


def test_extrapolation_study_reports_learned_positions_cleanly(tmp_path):
    args = ExtrapolationArguments(
        output_dir=str(tmp_path),
        position_schemes=["learned", "alibi"],
        train_length=16,
        factors=[0.5, 1, 4],
        stage_configs=CONFIGS,
        test_examples=300,
        eval_windows=2,
        set=[
            "max_steps=4",
            "train_examples=300",
            "eval_strategy=no",
            "save_strategy=no",
            "report_to=none",
            "hidden_size=32",
            "num_hidden_layers=1",
            "vocab_size=300",
        ],
    )
    summary = run(args)
    assert summary["lengths"] == [8, 16, 64]
    learned, alibi = summary["schemes"]["learned"], summary["schemes"]["alibi"]
    assert learned["max_length"] == 16 and learned["perplexity"][64] is None
    assert learned["perplexity"][16]["mean"] > 1 and alibi["max_length"] is None
    assert all(alibi["perplexity"][n]["mean"] > 1 for n in (8, 16, 64))
    table = (tmp_path / "results.md").read_text()
    assert "| learned | " in table and "not supported beyond 16" in table
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["schemes"]["learned"]["perplexity"]["64"] is None
    assert (tmp_path / "results.png").stat().st_size > 10_000
    # the trained models were built at the training length, on contiguous text
    config = json.loads(next(tmp_path.glob("runs/position_scheme=learned-*/seed0/pretrain/config.json")).read_text())
    assert config["max_position_embeddings"] == 16


def test_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="factors"):
        ExtrapolationArguments(factors=[0.0, 1.0])
    with pytest.raises(ValueError, match="train_length"):
        ExtrapolationArguments(train_length=1)
