"""plugformer inside the Hugging Face ecosystem: Auto classes, pipeline, remote code, Trainer, PEFT, Llama parity."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import build, tiny_config
from tolerances import model_tolerance
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    pipeline,
)

from plugformer import PlugformerConfig, PlugformerForCausalLM, PlugformerModel, train_tokenizer
from plugformer.data.corpus import arithmetic_sentences
from plugformer.data.tokenization import generation_eos_token_ids


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(arithmetic_sentences(2000), vocab_size=300)


@pytest.fixture(scope="module")
def saved_model(tokenizer, tmp_path_factory):
    """A tiny t5_bias + multiplicative model with its tokenizer, saved as a user would."""
    directory = tmp_path_factory.mktemp("saved")
    config = tiny_config(
        "multiplicative",
        "t5_bias",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = build(config)
    model.generation_config.eos_token_id = generation_eos_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model


def test_auto_classes_resolve_to_plugformer(saved_model):
    directory, _ = saved_model
    assert type(AutoModel.from_pretrained(directory)) is PlugformerModel
    assert type(AutoModelForCausalLM.from_pretrained(directory)) is PlugformerForCausalLM
    assert type(AutoModel.from_config(tiny_config())) is PlugformerModel
    assert AutoTokenizer.from_pretrained(directory).pad_token == "<|pad|>"
    saved = json.loads((directory / "config.json").read_text())
    assert saved["model_type"] == "plugformer"
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling.PlugformerForCausalLM"
    assert {"configuration.py", "modeling.py", "scores.py", "positions.py", "kernels.py"} <= {
        p.name for p in directory.iterdir()
    }


def test_text_generation_pipeline(saved_model):
    directory, _ = saved_model
    generator = pipeline("text-generation", model=str(directory))
    assert isinstance(generator.model, PlugformerForCausalLM)
    text = generator("12 plus 7 is", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("12 plus 7 is") and len(text) > len("12 plus 7 is")
    chat = generator([{"role": "user", "content": "2 + 2?"}], max_new_tokens=4, do_sample=False)
    messages = chat[0]["generated_text"]
    assert [m["role"] for m in messages] == ["user", "assistant"]


# Prepended to each subprocess script: any import of plugformer fails, as where it is not installed.
HIDE_PLUGFORMER = textwrap.dedent(
    """
    import sys

    class HidePlugformer:
        def find_spec(self, name, path=None, target=None):
            if name == "plugformer" or name.startswith("plugformer."):
                raise ImportError("plugformer is hidden in this test")

    sys.meta_path.insert(0, HidePlugformer())
    """
)

HIDDEN_PACKAGE_SCRIPT = HIDE_PLUGFORMER + textwrap.dedent(
    """
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    directory, ids_file, out_file = sys.argv[1:]
    try:
        import plugformer  # noqa: F401
        raise SystemExit("plugformer is importable")
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(directory, trust_remote_code=True)
    assert not any(name.split(".")[0] == "plugformer" for name in sys.modules)
    with torch.no_grad():
        logits = model(torch.load(ids_file)).logits
        generated = model.generate(torch.load(ids_file)[:, :4], max_new_tokens=4, do_sample=False)
    torch.save({"logits": logits, "generated": generated, "module": type(model).__module__,
                "base": type(base).__name__}, out_file)
    """
)


def assert_same_without_the_package(model, directory, tokens: torch.Tensor, tmp_path) -> dict:
    """Loads the checkpoint `model` was saved to in `directory` with `trust_remote_code` in a second process where
    plugformer cannot be imported (`HIDDEN_PACKAGE_SCRIPT`), from the code the checkpoint carries: its logits of
    `tokens` and its greedy tokens after their first 4 equal `model`'s. Returns what that process recorded."""
    (tmp_path / "load.py").write_text(HIDDEN_PACKAGE_SCRIPT)
    torch.save(tokens, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    arguments = [str(directory), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")]
    subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), *arguments], check=True, env=env, cwd=tmp_path, timeout=300
    )
    result = torch.load(tmp_path / "out.pt")
    assert result["module"].startswith("transformers_modules.")
    with torch.no_grad():
        # same weights and code; only the thread count of the other process changes the float summation order
        expected = model(tokens).logits  # the other process's threads: `model_tolerance`
        torch.testing.assert_close(result["logits"], expected, atol=model_tolerance(model.config, expected), rtol=0)
        assert torch.equal(result["generated"], model.generate(tokens[:, :4], max_new_tokens=4, do_sample=False))
    return result


def test_trust_remote_code_loads_without_the_package(saved_model, tmp_path, tokens):
    directory, model = saved_model
    assert assert_same_without_the_package(model, directory, tokens, tmp_path)["base"] == "PlugformerModel"


def llama_twin():
    """A random Llama and the plugformer config with the same architecture (the defaults are Llama-like)."""
    llama_config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = PlugformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_score="scaled_dot",
        position_scheme="rope",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config).eval(), config


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_scaled_dot_rope_equals_transformers_llama(kernel, tokens):
    """Llama's checkpoint loads into plugformer unchanged (same names) and gives the same logits."""
    llama, config = llama_twin()
    model = build(config, kernel)
    model.load_state_dict(llama.state_dict(), strict=True)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    llama.set_attn_implementation(kernel)
    with torch.no_grad():
        expected = llama(tokens, attention_mask=mask).logits
        actual = model(tokens, attention_mask=mask).logits
    atol = model_tolerance(model.config, expected)  # two fp32 models: `model_tolerance`
    torch.testing.assert_close(actual[0], expected[0], atol=atol, rtol=0)
    torch.testing.assert_close(actual[1, 3:], expected[1, 3:], atol=atol, rtol=0)


def test_trainer_trains_and_checkpoints_safetensors(tokenizer, tmp_path):
    config = tiny_config("scaled_dot", "alibi", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model = PlugformerForCausalLM(config)
    texts = arithmetic_sentences(64, seed=1)
    dataset = [tokenizer(text) for text in texts]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        logging_steps=5,
        save_steps=30,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.75 * losses[0], losses  # from ≈ ln(300) = 5.7
    checkpoint = tmp_path / "checkpoint-30"
    assert (checkpoint / "model.safetensors").exists() and not list(checkpoint.glob("pytorch_model*.bin"))
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([tokenizer("1 plus 1 is 2.")["input_ids"]])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_peft_lora_trains_only_adapters_and_merges_exactly(tokens):
    from peft import LoraConfig, get_peft_model

    base = build(tiny_config("multiplicative", "clamped_bias"), "sdpa")
    before = copy.deepcopy(base.state_dict())
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(trainable) == 2 * 4 * 2  # A and B for 4 projections in 2 layers
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=tokens).logits
        merged = model.merge_and_unload()
        # W + BA merged against x W + (x A) B: fp32's rounding through the model (`model_tolerance`)
        torch.testing.assert_close(merged(tokens).logits, adapted, atol=model_tolerance(merged.config, adapted), rtol=0)
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(
        k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed
    )


EVERY_HEAD_SCRIPT = HIDE_PLUGFORMER + textwrap.dedent(
    """
    import torch
    import transformers

    jobs, out_file = torch.load(sys.argv[1]), sys.argv[2]
    results = {}
    for auto_name, directory, inputs in jobs:
        model = getattr(transformers, auto_name).from_pretrained(directory, trust_remote_code=True).eval()
        with torch.no_grad():
            results[directory] = (type(model).__name__, model(**inputs).logits)
    assert not any(name.split(".")[0] == "plugformer" for name in sys.modules)
    torch.save(results, out_file)
    """
)


def test_every_head_loads_with_trust_remote_code_without_the_package(tmp_path, tokens):
    from plugformer import (
        DecomposableAttentionConfig,
        DecomposableAttentionForSequenceClassification,
        PlugformerForConditionalGeneration,
        PlugformerForMaskedLM,
        PlugformerForSequenceClassification,
        PlugformerForTokenClassification,
    )

    encoder = tiny_config("additive", "t5_bias", is_causal=False, pad_token_id=0)
    heads = [
        ("AutoModelForMaskedLM", PlugformerForMaskedLM(encoder), {"input_ids": tokens}),
        ("AutoModelForTokenClassification", PlugformerForTokenClassification(encoder), {"input_ids": tokens}),
        (
            "AutoModelForSequenceClassification",
            PlugformerForSequenceClassification(tiny_config(pad_token_id=0)),
            {"input_ids": tokens},
        ),
        (
            "AutoModelForSeq2SeqLM",
            PlugformerForConditionalGeneration(
                tiny_config("multiplicative", "alibi", is_encoder_decoder=True, pad_token_id=0)
            ),
            {"input_ids": tokens, "decoder_input_ids": tokens[:, :4]},
        ),
        (
            "AutoModelForSequenceClassification",
            DecomposableAttentionForSequenceClassification(DecomposableAttentionConfig(vocab_size=128, sep_token_id=2)),
            {"input_ids": torch.cat([tokens[:, :5], torch.full((2, 1), 2), tokens[:, 5:]], dim=1)},
        ),
    ]
    jobs, expected = [], {}
    for index, (auto_name, model, inputs) in enumerate(heads):
        directory = str(tmp_path / f"head{index}")
        model.eval().save_pretrained(directory)
        jobs.append((auto_name, directory, inputs))
        with torch.no_grad():
            expected[directory] = (type(model).__name__, model(**inputs).logits, model.config)
    torch.save(jobs, tmp_path / "jobs.pt")
    (tmp_path / "load.py").write_text(EVERY_HEAD_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(tmp_path / "jobs.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    results = torch.load(tmp_path / "out.pt")
    for directory, (name, logits, config) in expected.items():
        assert results[directory][0] == name
        atol = model_tolerance(config, logits)  # another process's threads
        torch.testing.assert_close(results[directory][1], logits, atol=atol, rtol=0)


BARE_STACK_SCRIPT = HIDE_PLUGFORMER + textwrap.dedent(
    """
    import torch
    import transformers

    directory, out_file = sys.argv[1:]
    names = {}
    for auto_name in ("AutoModel", "AutoModelForCausalLM"):
        model = getattr(transformers, auto_name).from_pretrained(directory, trust_remote_code=True)
        names[auto_name] = type(model).__name__
    assert not any(name.split(".")[0] == "plugformer" for name in sys.modules)
    torch.save(names, out_file)
    """
)


def test_a_bare_stack_checkpoint_carries_the_code_of_every_auto_map_entry(tmp_path):
    """`PlugformerModel` lives in `stack.py`, which imports no head: transformers alone would copy the stack's files
    but not `modeling.py`, which the checkpoint's `auto_map` names for every head."""
    directory = tmp_path / "stack"
    PlugformerModel(tiny_config()).save_pretrained(directory)
    auto_map = json.loads((directory / "config.json").read_text())["auto_map"]
    assert {f"{entry.split('.')[0]}.py" for entry in auto_map.values()} <= {p.name for p in directory.glob("*.py")}
    (tmp_path / "load.py").write_text(BARE_STACK_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(directory), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    loaded = torch.load(tmp_path / "out.pt")
    assert loaded == {"AutoModel": "PlugformerModel", "AutoModelForCausalLM": "PlugformerForCausalLM"}


PEFT_WITHOUT_THE_PACKAGE = """
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert not any(name.split(".")[0] == "plugformer" for name in sys.modules)
peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2))
trainable = sorted({name.split(".")[-4] for name, p in peft_model.named_parameters() if p.requires_grad})
print("TARGETS", ",".join(trainable))
"""


def test_peft_default_targets_with_remote_code_alone(tmp_path):
    """A checkpoint loaded by `trust_remote_code` without plugformer installed registers PEFT's default LoRA targets
    from its own code files: `LoraConfig(task_type="CAUSAL_LM")` without `target_modules` finds them."""
    import os
    import subprocess
    import sys

    from test_hf_integration import HIDE_PLUGFORMER

    from plugformer import LORA_TARGET_MODULES

    build(tiny_config("multiplicative", "alibi")).save_pretrained(tmp_path / "model")
    (tmp_path / "lora_defaults.py").write_text(HIDE_PLUGFORMER + PEFT_WITHOUT_THE_PACKAGE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, str(tmp_path / "lora_defaults.py"), str(tmp_path / "model")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    targets = next(line for line in result.stdout.splitlines() if line.startswith("TARGETS ")).split()[1]
    assert sorted(targets.split(",")) == sorted(LORA_TARGET_MODULES)
