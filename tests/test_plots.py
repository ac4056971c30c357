"""Attention heatmaps and plots: the numbers drawn equal an eager forward, the paper formulas and the Trainer's logs;
a text or a figure too large to draw is refused before anything is drawn."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_config
from PIL import Image
from safetensors.torch import load_file
from tolerances import model_length, model_steps, tolerance
from transformers import AutoConfig

from plugformer import POSITION_SCHEMES, PlugformerForConditionalGeneration, PlugformerForMaskedLM, train_tokenizer
from plugformer.cli import main as cli_main
from plugformer.data.corpus import arithmetic_sentences
from plugformer.evaluation import attention_maps, plots
from plugformer.evaluation.attention_maps import EXAMPLE_TEXT, attention_weights, default_figsize, save_attention_maps
from plugformer.positions import t5_relative_position_bucket


ROOT = Path(__file__).resolve().parents[1]


def weights_tolerance(config, tokens: int) -> float:
    """`atol` of attention weights (each at most 1) read from a model two ways in fp32: a weight p_j moves by
    p_j (δs_j − Σ_k p_k δs_k), at most twice the scores' error, which carries the layers' rounding of unit-sized
    hidden states (`model_tolerance`'s steps and lengths, magnitude 1)."""
    return 2 * tolerance(torch.float32, length=model_length(config, tokens), steps=model_steps(config))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([*arithmetic_sentences(300), EXAMPLE_TEXT], vocab_size=300)


def causal_lm(tokenizer, scheme="alibi", kernel="sdpa", **overrides):
    return build(tiny_config("scaled_dot", scheme, vocab_size=len(tokenizer), **overrides), kernel)


def masked_lm(tokenizer, scheme="t5_bias", **overrides):
    config = tiny_config("multiplicative", scheme, is_causal=False, vocab_size=len(tokenizer), **overrides)
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return PlugformerForMaskedLM(config).eval()


def language_model(tokenizer, scheme, causal, **overrides):
    """A causal LM, or a masked LM over a bidirectional encoder."""
    return causal_lm(tokenizer, scheme, **overrides) if causal else masked_lm(tokenizer, scheme, **overrides)


def seq2seq(tokenizer, scheme="t5_bias", **overrides):
    special = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = tiny_config(
        "scaled_dot", scheme, is_encoder_decoder=True, vocab_size=len(tokenizer), **special, **overrides
    )
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return PlugformerForConditionalGeneration(config).eval()


def eager_copy(model):
    reference = copy.deepcopy(model)  # copies the config too: switching it leaves `model` on sdpa
    reference.set_attn_implementation("eager")
    return reference


def ids(tokenizer, text, bos=True):
    return tokenizer((tokenizer.bos_token if bos else "") + text, add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]


# --- attention weights -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["causal", "masked"])
def test_weights_equal_an_eager_forward_and_the_kernel_is_restored(tokenizer, head):
    model = causal_lm(tokenizer) if head == "causal" else masked_lm(tokenizer)
    maps = attention_weights(model, tokenizer, EXAMPLE_TEXT, layers=[1, 0], heads=[3, 0, 2])
    assert list(maps) == ["self"] and model.config._attn_implementation == "sdpa"
    attention = maps["self"]
    with torch.no_grad():
        expected = eager_copy(model)(ids(tokenizer, EXAMPLE_TEXT), output_attentions=True).attentions
    tokens = len(attention.query_tokens)
    assert attention.weights.shape == (2, 3, tokens, tokens) and attention.weights.dtype == torch.float32
    atol = weights_tolerance(model.config, tokens)
    for row, layer in enumerate([1, 0]):
        torch.testing.assert_close(attention.weights[row], expected[layer][0, [3, 0, 2]], atol=atol, rtol=0)
    # fp32's exp and division, then a sum of `tokens` weights of total 1
    atol = tolerance(torch.float32, length=tokens, steps=2)
    torch.testing.assert_close(attention.weights.sum(-1), torch.ones(2, 3, tokens), atol=atol, rtol=0)
    above_diagonal = attention.weights.triu(1)
    if head == "causal":
        assert above_diagonal.abs().max() == 0
    else:
        assert above_diagonal.min() >= 0 and above_diagonal.max() > 0.01  # an encoder attends forward
    # tokens: the bos token, then the text decoded one id at a time
    assert attention.query_tokens[0] == tokenizer.bos_token and "".join(attention.query_tokens[1:]) == EXAMPLE_TEXT
    assert attention.key_tokens == attention.query_tokens and (attention.layers, attention.heads) == ([1, 0], [3, 0, 2])


def test_defaults_take_every_layer_and_head_and_training_mode_is_kept(tokenizer):
    model = causal_lm(tokenizer, "rope", kernel="eager").train()
    attention = attention_weights(model, tokenizer, "1 plus 2 is 3.", bos=False)["self"]
    assert (attention.layers, attention.heads) == ([0, 1], [0, 1, 2, 3]) and model.training
    assert len(attention.query_tokens) == ids(tokenizer, "1 plus 2 is 3.", bos=False).shape[1]
    assert model.config._attn_implementation == "eager"


def test_bad_indices_and_inputs_raise_naming_the_field(tokenizer):
    model = causal_lm(tokenizer)
    with pytest.raises(ValueError, match=r"layers=\[0, 2\]: 2 is out of range; the model has 2 layers \(0..1\)"):
        attention_weights(model, tokenizer, EXAMPLE_TEXT, layers=[0, 2])
    with pytest.raises(ValueError, match=r"heads=\[-1\]: -1 is out of range; the model has 4 heads \(0..3\)"):
        attention_weights(model, tokenizer, EXAMPLE_TEXT, heads=[-1])
    with pytest.raises(ValueError, match=r"heads=\[\]"):
        attention_weights(model, tokenizer, EXAMPLE_TEXT, heads=[])
    with pytest.raises(ValueError, match="target_text='x': only a seq2seq"):
        attention_weights(model, tokenizer, EXAMPLE_TEXT, target_text="x")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="target_text=None: a seq2seq model needs"):
        attention_weights(seq2seq(tokenizer), tokenizer, EXAMPLE_TEXT)


def test_seq2seq_cross_attention_equals_an_eager_forward(tokenizer):
    model = seq2seq(tokenizer, num_decoder_layers=3)
    target_text = "it was too tired"
    maps = attention_weights(model, tokenizer, EXAMPLE_TEXT, target_text=target_text, heads=[1, 2])
    assert list(maps) == ["encoder", "decoder", "cross"] and model.config._attn_implementation == "sdpa"
    # the source as the seq2seq stage encodes it: its tokens, then end of text
    source = torch.cat([ids(tokenizer, EXAMPLE_TEXT, bos=False), torch.tensor([[tokenizer.eos_token_id]])], 1)
    target = torch.cat([torch.tensor([[model.decoder_start_token_id]]), ids(tokenizer, target_text, bos=False)], 1)
    with torch.no_grad():
        expected = eager_copy(model)(source, decoder_input_ids=target, use_cache=False, output_attentions=True)
    cross = maps["cross"]
    assert cross.layers == [0, 1, 2] and maps["encoder"].layers == [0, 1]  # each stack's own layer count
    assert cross.weights.shape == (3, 2, target.shape[1], source.shape[1])
    assert cross.query_tokens == maps["decoder"].query_tokens and cross.key_tokens == maps["encoder"].key_tokens
    for kind, reference in [
        ("encoder", expected.encoder_attentions),
        ("decoder", expected.decoder_attentions),
        ("cross", expected.cross_attentions),
    ]:
        for row, layer in enumerate(maps[kind].layers):
            atol = weights_tolerance(model.config, max(source.shape[1], target.shape[1]))
            torch.testing.assert_close(maps[kind].weights[row], reference[layer][0, [1, 2]], atol=atol, rtol=0)
    assert maps["decoder"].weights.triu(1).abs().max() == 0
    with pytest.raises(ValueError, match=r"layers=\[2\]: 2 is out of range; the encoder has 2 layers"):
        attention_weights(model, tokenizer, EXAMPLE_TEXT, target_text=target_text, layers=[2])


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size  # (width, height)


def test_png_has_figure_size_times_dpi_and_numbers_reload(tokenizer, tmp_path):
    maps = attention_weights(causal_lm(tokenizer), tokenizer, EXAMPLE_TEXT, layers=[1], heads=[0, 3])
    written = save_attention_maps(
        maps, tmp_path / "maps" / "attention.png", dpi=50, figsize=(6.0, 4.0), metadata={"text": EXAMPLE_TEXT}
    )
    png, numbers, tokens = (tmp_path / "maps" / f"attention.{suffix}" for suffix in ("png", "safetensors", "json"))
    assert written == [png, numbers, tokens]
    assert png_size(png) == (300, 200)
    reloaded = load_file(str(numbers))
    assert list(reloaded) == ["self.layer1"]
    torch.testing.assert_close(reloaded["self.layer1"], maps["self"].weights[0], atol=0, rtol=0)
    described = json.loads(tokens.read_text())
    assert described["text"] == EXAMPLE_TEXT
    assert described["maps"]["self"] == {
        "layers": [1],
        "heads": [0, 3],
        "query_tokens": maps["self"].query_tokens,
        "key_tokens": maps["self"].key_tokens,
    }
    # default size: a cell per heatmap
    save_attention_maps(maps, tmp_path / "default.png", dpi=40)
    width, height = default_figsize(maps["self"].weights)
    assert png_size(tmp_path / "default.png") == (round(width * 40), round(height * 40))


# --- position bias ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_is_minus_slope_times_distance(tokenizer, causal):
    model = language_model(tokenizer, "alibi", causal, num_attention_heads=8, num_key_value_heads=8)
    distances, bias = plots.position_bias_by_distance(model, 6)
    assert distances.tolist() == list(range(-6, 7)) and bias.shape == (8, 13)
    slopes = torch.tensor([2 ** (-8 * i / 8) for i in range(1, 9)])  # Press et al. 2022: 1/2, 1/4, ... 1/256
    expected = -slopes[:, None] * distances.abs().float()[None]
    past = distances <= 0
    atol = tolerance(torch.float32, magnitude=expected.abs().max().item())  # one product, rounded once
    torch.testing.assert_close(bias[:, past], expected[:, past], atol=atol, rtol=0)
    if causal:  # future keys are masked: nothing to draw
        assert bias[:, ~past].isnan().all()
    else:
        torch.testing.assert_close(bias[:, ~past], expected[:, ~past], atol=atol, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_clamped_bias_is_constant_beyond_the_clamp(tokenizer, causal):
    model = language_model(tokenizer, "clamped_bias", causal, max_relative_distance=3)
    table = model.model.positions.relative_attention_bias.weight.detach()  # (distances, H)
    distances, bias = plots.position_bias_by_distance(model, 7)
    for column, distance in enumerate(distances.tolist()):
        if causal and distance > 0:
            assert bias[:, column].isnan().all()
            continue
        clamped = max(-3, min(3, distance))
        index = clamped + 3 if not causal else -clamped  # encoders: -3..3 -> 0..6; decoders: 0..3 back
        torch.testing.assert_close(bias[:, column], table[index], atol=0, rtol=0)
    torch.testing.assert_close(bias[:, 0], bias[:, 4], atol=0, rtol=0)  # -7 and -3 share the edge value


@pytest.mark.parametrize("causal", [True, False])
def test_t5_bias_reads_the_bucket_rows(tokenizer, causal):
    model = language_model(tokenizer, "t5_bias", causal)
    table = model.model.positions.relative_attention_bias.weight.detach()  # (buckets, H)
    distances, bias = plots.position_bias_by_distance(model, 20)
    buckets = t5_relative_position_bucket(distances, bidirectional=not causal, num_buckets=8, max_distance=16)
    past = distances <= 0 if causal else torch.ones_like(distances, dtype=torch.bool)
    torch.testing.assert_close(bias[:, past], table[buckets[past]].T, atol=0, rtol=0)
    assert bias[:, ~past].isnan().all()


def test_seq2seq_stacks_and_configs_and_schemes_without_a_bias(tokenizer, tmp_path):
    model = seq2seq(tokenizer, "alibi")
    _, encoder = plots.position_bias_by_distance(model, 4, stack="encoder")
    _, decoder = plots.position_bias_by_distance(model, 4, stack="decoder")
    assert not encoder.isnan().any() and decoder[:, 5:].isnan().all()
    _, from_config = plots.position_bias_by_distance(model.config, 4)  # a config: the encoder, bidirectional
    torch.testing.assert_close(from_config, encoder, atol=0, rtol=0)
    with_bias = re.escape(str([name for name in POSITION_SCHEMES if POSITION_SCHEMES.get(name).has_bias]))
    for scheme in ("rope", "none", "sinusoidal"):
        with pytest.raises(ValueError, match=rf"position_scheme='{scheme}'.*{with_bias}"):
            plots.position_bias_by_distance(tiny_config("scaled_dot", scheme), 4)
    with pytest.raises(ValueError, match="max_distance=0"):
        plots.position_bias_by_distance(model, 0)
    _, bias = plots.plot_position_bias(model, tmp_path / "alibi.png", 4, dpi=50, figsize=(4, 3))
    assert png_size(tmp_path / "alibi.png") == (200, 150) and bias.shape == (4, 9)


# --- sinusoidal ------------------------------------------------------------------------------------------------


def test_sinusoidal_plot_draws_the_paper_formula(tmp_path):
    drawn = plots.plot_sinusoidal(50, 16, tmp_path / "sinusoidal.png", dpi=50, figsize=(4, 3))
    assert drawn.shape == (50, 16) and png_size(tmp_path / "sinusoidal.png") == (200, 150)
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) with d = 16
    assert drawn[3, 4] == pytest.approx(math.sin(3 / 10000 ** (4 / 16)), abs=1e-6)  # 2i = 4
    assert drawn[7, 9] == pytest.approx(math.cos(7 / 100), abs=1e-6)  # 2i = 8: 10000^(1/2) = 100
    assert drawn[0].tolist() == [0.0, 1.0] * 8
    with pytest.raises(ValueError, match="dim=15"):
        plots.sinusoidal_matrix(4, 15)


# --- training curves -------------------------------------------------------------------------------------------


def write_state(directory: Path, history: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return directory


HISTORY = [
    {"loss": 3.0, "grad_norm": 1.0, "step": 1}, {"loss": 2.5, "step": 2}, {"eval_loss": 2.6, "step": 2},
    {"loss": 2.0, "step": 3}, {"train_loss": 2.5, "step": 3},
]  # fmt: skip


def test_curves_from_trainer_state_files(tmp_path):
    first = write_state(tmp_path / "a" / "run", HISTORY)
    second = write_state(tmp_path / "b" / "run" / "checkpoint-5", [{"loss": 1.0, "step": 5}])  # no eval logged
    curves = plots.plot_training_curves([first, second.parent], tmp_path / "curves.png", dpi=50, figsize=(4, 3))
    assert png_size(tmp_path / "curves.png") == (200, 150)
    labels = list(curves)
    assert labels[0] == "run" and labels[1] == str(second.parent)  # same name: the path tells them apart
    assert curves["run"] == {"loss": ([1, 2, 3], [3.0, 2.5, 2.0]), "eval_loss": ([2], [2.6])}
    assert curves[labels[1]] == {"loss": ([5], [1.0])}
    with pytest.raises(ValueError, match=r"metrics=\['accuracy'\]: none was logged; the runs logged \[.*'loss'"):
        plots.plot_training_curves([first], tmp_path / "none.png", metrics=["accuracy"])
    with pytest.raises(ValueError, match="has no training log"):
        plots.log_history(tmp_path / "a")


def test_curves_of_a_pretrain_stage_from_tensorboard_then_its_checkpoint(tmp_path):
    from plugformer.training import run_stage

    run = tmp_path / "pretrain"
    run_stage(
        "pretrain",
        [
            "--output_dir",
            str(run),
            "--preset",
            "tiny",
            "--vocab_size",
            "300",
            "--block_size",
            "32",
            "--max_position_embeddings",
            "128",
            "--train_examples",
            "48",
            "--dev_examples",
            "8",
            "--test_examples",
            "8",
            "--exact_match_examples",
            "0",
            "--per_device_train_batch_size",
            "4",
            "--per_device_eval_batch_size",
            "8",
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--save_strategy",
            "steps",
            "--save_steps",
            "2",
            "--report_to",
            "tensorboard",
            "--disable_tqdm",
            "true",
            "--dataloader_pin_memory",
            "false",
        ],
    )
    final = json.loads((run / "trainer_state.json").read_text())["log_history"]  # written by every stage
    assert plots.log_history(run) == (final, run / "trainer_state.json")
    assert "eval_loss" in final[-1] and "train_loss" in final[-2]  # the evaluation after training is included
    (run / "trainer_state.json").unlink()  # e.g. a run killed before its end: tensorboard, then the checkpoint
    checkpoint = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    history, source = plots.log_history(run)
    assert source == run / "runs"
    for metric in ("loss", "eval_loss", "grad_norm"):
        steps, values = plots.metric_series(history, metric)
        expected_steps, expected = plots.metric_series(checkpoint, metric)
        assert steps == expected_steps == ([1, 2, 3, 4] if metric != "eval_loss" else [2, 4])
        assert values == pytest.approx(expected, rel=1e-6)  # tensorboard stores float32
    assert "train_loss" in history[-1]  # the end-of-training summary, logged after the last checkpoint
    curves = plots.plot_training_curves([run], tmp_path / "curves.png")
    assert curves["pretrain"]["eval_loss"][0] == [2, 4] and (tmp_path / "curves.png").stat().st_size > 0
    for events in (run / "runs").rglob("events.out.tfevents.*"):
        events.unlink()
    assert plots.log_history(run) == (checkpoint, run / "checkpoint-4" / "trainer_state.json")


# --- command line and example ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_models(tokenizer, tmp_path_factory):
    directories = {}
    for name, model in [("causal", causal_lm(tokenizer, "t5_bias")), ("seq2seq", seq2seq(tokenizer))]:
        directories[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(directories[name])
        tokenizer.save_pretrained(directories[name])
    return directories


def test_attention_map_command(saved_models, tmp_path, capsys):
    output = tmp_path / "causal.png"
    cli_main(
        [
            "attention-map",
            "--model",
            str(saved_models["causal"]),
            "--layers",
            "1",
            "--heads",
            "0",
            "2",
            "--output",
            str(output),
            "--dpi",
            "30",
        ]
    )
    assert f"wrote {output}" in capsys.readouterr().out
    described = json.loads(output.with_suffix(".json").read_text())
    assert described["text"] == EXAMPLE_TEXT and described["maps"]["self"]["heads"] == [0, 2]
    assert list(load_file(str(output.with_suffix(".safetensors")))) == ["self.layer1"]
    seq2seq_model = str(saved_models["seq2seq"])
    written = attention_maps.main(
        [
            "--model",
            seq2seq_model,
            "--text",
            "1 plus 2 is 3.",
            "--target_text",
            "3",
            "--output",
            str(tmp_path / "s2s.png"),
            "--dpi",
            "30",
        ]
    )
    names = ["s2s_encoder.png", "s2s_decoder.png", "s2s_cross.png", "s2s.safetensors", "s2s.json"]
    assert [p.name for p in written] == names
    assert all(p.exists() for p in written)
    with pytest.raises(ValueError, match="unknown arguments"):
        attention_maps.main(["--model", str(saved_models["causal"]), "--colour", "red", "--output", str(output)])


def test_plot_commands(saved_models, tmp_path):
    bias = plots.main(
        [
            "positions",
            "--model",
            str(saved_models["causal"]),
            "--max_distance",
            "8",
            "--output",
            str(tmp_path / "bias.png"),
            "--dpi",
            "30",
        ]
    )
    assert png_size(bias) == (240, 135)  # (8, 4.5) inches at 30 dpi
    cli_main(
        [
            "plot",
            "positions",
            "--model",
            str(saved_models["seq2seq"]),
            "--stack",
            "decoder",
            "--output",
            str(tmp_path / "decoder.png"),
        ]
    )
    assert (tmp_path / "decoder.png").exists()
    sinusoidal = plots.main(["sinusoidal", "--positions", "16", "--dim", "8", "--output", str(tmp_path / "s.png")])
    assert png_size(sinusoidal) == (800, 500)
    run = write_state(tmp_path / "run", HISTORY)
    curves = plots.main(["curves", str(run), "--metrics", "loss", "--output", str(tmp_path / "c.png"), "--dpi", "20"])
    assert png_size(curves) == (160, 90)
    with pytest.raises(SystemExit):
        plots.main(["histogram"])


def test_example_script_runs_in_seconds(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("attention_heatmaps", ROOT / "examples" / "attention_heatmaps.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    written = example.main(
        [
            "--output_dir",
            str(tmp_path),
            "--steps",
            "3",
            "--sentences",
            "100",
            "--batch_size",
            "4",
            "--hidden_size",
            "32",
            "--vocab_size",
            "300",
            "--dpi",
            "20",
        ]
    )
    names = {path.name for path in written}
    assert names == {
        "attention.png",
        "attention.safetensors",
        "attention.json",
        "sinusoidal.png",
        "bias_alibi.png",
        "bias_t5_bias.png",
    }
    assert all(path.exists() for path in written) and (tmp_path / "model" / "model.safetensors").exists()
    described = json.loads((tmp_path / "attention.json").read_text())
    assert described["maps"]["self"]["layers"] == [0, 1] and described["maps"]["self"]["heads"] == [0, 1]
    # reusing the trained model gives the same weights
    again = example.main(["--output_dir", str(tmp_path / "again"), "--model", str(tmp_path / "model"), "--dpi", "20"])
    assert again[1].name == "attention.safetensors"
    first, second = load_file(str(tmp_path / "attention.safetensors")), load_file(str(again[1]))
    assert first.keys() == second.keys()
    config = AutoConfig.from_pretrained(tmp_path / "model")
    for key in first:  # the saved model reloaded: its weights read two ways (`weights_tolerance`)
        atol = weights_tolerance(config, first[key].shape[-1])
        torch.testing.assert_close(second[key], first[key], atol=atol, rtol=0)


def test_attention_map_refuses_a_text_too_long_to_draw(runs, capsys):
    from plugformer.cli import main

    with pytest.raises(SystemExit):
        main(["attention-map", "--model", str(runs / "final_only"), "--text", "12 plus 7 is 19. " * 180])
    assert re.search(r"ValueError: the text is \d+ tokens; attention-map draws at most 512", capsys.readouterr().err)


def test_an_attention_figure_too_large_is_refused_before_it_is_drawn(tmp_path):
    import torch

    from plugformer.evaluation.attention_maps import AttentionMap, plot_attention_map

    tokens = [f"t{i}" for i in range(100)]
    big = AttentionMap("self", torch.rand(4, 4, 100, 100), [0, 1, 2, 3], [0, 1, 2, 3], tokens, tokens)
    with pytest.raises(ValueError, match=r"would be \d+ x \d+ pixels \(4 layers x 4 heads of 100 x 100 tokens"):
        plot_attention_map(big, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()
