"""vLLM's Transformers backend on every attention_score × position_scheme: greedy tokens identical to transformers'
`generate`, or the load refused with plugformer's ValueError naming the variant — never silently different tokens;
likewise scaled_dot + rope with each attention modifier's each value (`variants.ATTENTION_MODIFIERS`).

Runs only where vLLM is installed (its own environment: `vllm-cpu` pins transformers<5.20); skipped elsewhere. vLLM
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where importing plugformer registered it with the Auto
classes; the checkpoint also carries its code (`trust_remote_code`). The table of outcomes and times is written to
`$PLUGFORMER_VLLM_TABLE` when set.

plugformer's vLLM plugin (`plugformer.integrations.vllm_plugin`): greedy tokens and log-probabilities equal to transformers' with
vLLM compiling the stack, ALiBi included (vLLM's attention with plugformer's slopes), the rest still refused; and the
GRPO stage with TRL's `use_vllm=True, vllm_mode="colocate"` on it.
"""

from __future__ import annotations

import gc
import json
import os
import time

import pytest
import torch


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
vllm = pytest.importorskip("vllm")

import plugformer  # noqa: E402
from plugformer import PlugformerConfig, PlugformerForCausalLM  # noqa: E402
from plugformer.runtime.variants import ATTENTION_MODIFIERS, modifier_fields  # noqa: E402


VARIANTS = [(score, scheme) for score in plugformer.ATTENTION_SCORES for scheme in plugformer.POSITION_SCHEMES]
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 12, 100, 3, 64, 21, 9, 15, 80]]
NEW_TOKENS = 12
TABLE: dict[str, dict] = {}
# head_dim 64: vLLM's CPU attention takes a fixed set of head sizes
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


# Each attention modifier's each value (`variants.ATTENTION_MODIFIERS`, as the bench rows and the kernel table), on
# scaled_dot + rope: vLLM generates what transformers generates, or the load is refused naming the field.
MODIFIERS = [(name, value) for name, values in ATTENTION_MODIFIERS.items() for value in values]
MODIFIER_INIT = 0.1  # at 0.02 the tokens hardly depend on the modifier (see `reference`)
# SIZES but the tiny preset's GQA (2 key/value heads) left to the projection: the latent one drops it
MODIFIER_SIZES = {name: size for name, size in SIZES.items() if name != "num_key_value_heads"}


def greedy(model) -> list[list[int]]:
    """transformers' greedy continuations of `PROMPTS`."""
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
            )[0, len(prompt) :].tolist()
            for prompt in PROMPTS
        ]


def save_model(score: str, scheme: str, directory, **fields) -> list[list[int]]:
    """Saves a tiny random model (`SIZES`, or `fields`); returns transformers' greedy continuations of `PROMPTS`."""
    torch.manual_seed(0)
    config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **(fields or SIZES))
    model = PlugformerForCausalLM(config).eval()
    model.save_pretrained(directory)
    return greedy(model)


def modifier_fields_of(name: str, value) -> dict:
    layers = PlugformerConfig.from_preset("tiny").num_hidden_layers
    return {**MODIFIER_SIZES, **modifier_fields(name, value, layers), "initializer_range": MODIFIER_INIT}


def vllm_greedy(directory) -> list[list[int]]:
    llm = vllm.LLM(
        model=str(directory),
        model_impl="transformers",
        trust_remote_code=True,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
    )
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        prompts = [vllm.TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        del llm
        gc.collect()


def refusal_of(error: BaseException) -> str | None:
    """plugformer's kernel-table refusal in `error` or its causes, naming the variant's field."""
    while error is not None:
        message = str(error)
        if isinstance(error, ValueError) and "attn_implementation='vllm" in message:  # 'vllm' or 'vllm_alibi'
            return message
        error = error.__cause__ or error.__context__
    return None


# plugformer's vLLM plugin (`plugformer.integrations.vllm_plugin`, entry point `vllm.general_plugins`): the architecture resolves to
# plugformer's own vLLM model, ALiBi computed by vLLM's attention from plugformer's slopes. These run first: the
# Transformers-backend tests below make vLLM decorate `PlugformerModel` in place; the plugin builds a private subclass.
PLUGIN_VARIANTS = [("scaled_dot", "rope"), ("scaled_dot", "alibi"), ("multiplicative", "alibi")]
PLUGIN_REFUSED = [("scaled_dot", "t5_bias"), ("additive", "alibi")]


def reference(score: str, scheme: str, directory) -> dict:
    """A tiny model saved with init 0.1 (at 0.02 every variant repeats one token); its greedy tokens and their
    log-probabilities in transformers, and the tokens of the same weights with the scheme's bias dropped."""
    torch.manual_seed(0)
    config = PlugformerConfig.from_preset(
        "tiny", attention_score=score, position_scheme=scheme, initializer_range=0.1, **SIZES
    )
    model = PlugformerForCausalLM(config).eval()
    model.save_pretrained(directory)
    without_bias = PlugformerForCausalLM(
        PlugformerConfig.from_preset(
            "tiny", attention_score=score, position_scheme="none", initializer_range=0.1, **SIZES
        )
    ).eval()
    # ALiBi has no parameters, RoPE's are buffers; a T5 bias table is left out
    assert not without_bias.load_state_dict(model.state_dict(), strict=False).missing_keys
    tokens, logprobs, tokens_without_bias = [], [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
            new = greedy[0, len(prompt) :]
            logits = model(greedy).logits[0, len(prompt) - 1 : -1].float()
            tokens.append(new.tolist())
            logprobs.append(torch.log_softmax(logits, -1).gather(-1, new[:, None])[:, 0])
            tokens_without_bias.append(
                without_bias.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)[
                    0, len(prompt) :
                ].tolist()
            )
    return {"directory": directory, "tokens": tokens, "logprobs": logprobs, "without_bias": tokens_without_bias}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> dict:
    from plugformer.integrations import vllm_plugin

    vllm_plugin.register()  # what vLLM's plugin loader calls where plugformer is installed with its entry points
    saved = {}
    for score, scheme in PLUGIN_VARIANTS + PLUGIN_REFUSED:
        saved[score, scheme] = reference(score, scheme, tmp_path_factory.mktemp(f"plugin-{score}-{scheme}"))
    return saved


@pytest.mark.parametrize("score,scheme", PLUGIN_VARIANTS)
def test_plugin_generates_what_transformers_generates_alibi_included(score, scheme, plugin):
    """No `model_impl`: vLLM picks the registered architecture. `enforce_eager` off: vLLM compiles the stack."""
    expected = plugin[score, scheme]
    start = time.perf_counter()
    llm = vllm.LLM(
        model=str(expected["directory"]),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
    )
    try:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        assert type(model).__name__ == "PlugformerForCausalLMvLLM"
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False, logprobs=0
        )
        outputs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    logprobs = [
        torch.tensor([step[token].logprob for step, token in zip(o.outputs[0].logprobs, tokens[i], strict=True)])
        for i, o in enumerate(outputs)
    ]
    gap = max((got - want).abs().max().item() for got, want in zip(logprobs, expected["logprobs"], strict=True))
    TABLE[f"plugin:{score}+{scheme}"] = {
        "outcome": "identical" if tokens == expected["tokens"] else "DIFFERENT",
        "seconds": time.perf_counter() - start,
        "max_logprob_gap": gap,
    }
    assert tokens == expected["tokens"], f"vLLM generated {tokens}, transformers {expected['tokens']}"
    assert gap < 1e-4
    # the check can fail: the same weights without the scheme's bias/rotation generate other tokens
    assert expected["without_bias"] != expected["tokens"]
    assert "TorchCompileWithNoGuardsWrapper" not in [base.__name__ for base in plugformer.PlugformerModel.__mro__]


@pytest.mark.parametrize("score,scheme", PLUGIN_REFUSED)
def test_plugin_still_refuses_what_vllm_cannot_compute(score, scheme, plugin):
    with pytest.raises(Exception) as caught:  # vLLM may wrap plugformer's ValueError: read the chain
        vllm.LLM(
            model=str(plugin[score, scheme]["directory"]),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            max_num_seqs=4,
            seed=0,
        )
    reason = refusal_of(caught.value)
    assert reason is not None, repr(caught.value)
    assert f"attention_score={score!r}" in reason or f"position_scheme={scheme!r}" in reason
    gc.collect()


def test_plugin_generates_with_per_layer_sliding_windows(tmp_path, checkpoints):
    """`layer_types` mixing sliding and full layers (a window shorter than the prompts): vLLM's backend windows the
    layers it marks, and greedy tokens equal transformers' (formerly refused: vLLM reads the window per layer).
    `checkpoints` is requested so the other variants are saved first: this test's vLLM run decorates the model
    classes, after which they no longer build outside vLLM."""
    from plugformer.integrations import vllm_plugin

    vllm_plugin.register()
    fields = dict(
        sliding_window=3,
        num_hidden_layers=3,
        initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    torch.manual_seed(0)
    model = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", **fields, **SIZES)).eval()
    model.save_pretrained(tmp_path)
    full = PlugformerForCausalLM(
        PlugformerConfig.from_preset("tiny", **{**fields, "layer_types": None, "sliding_window": None}, **SIZES)
    ).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected, without_window = (
            [
                m.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)[
                    0, len(p) :
                ].tolist()
                for p in PROMPTS
            ]
            for m in (model, full)
        )
    assert expected != without_window  # the windows decide the tokens
    assert vllm_greedy(tmp_path) == expected


GRPO_RUN = r"""
import json, sys
from plugformer.integrations import vllm_plugin
vllm_plugin.register()
from plugformer.training import run_stage
import plugformer
root = sys.argv[1]
tiny = ["--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1", "--save_strategy", "no",
        "--per_device_train_batch_size", "4", "--max_steps", "3", "--train_examples", "48", "--dev_examples", "8",
        "--test_examples", "8", "--exact_match_examples", "4", "--max_new_tokens", "8",
        "--dataloader_pin_memory", "false", "--learning_rate", "1e-3"]
trl = ["--bf16", "false", "--gradient_checkpointing", "false"]
run_stage("pretrain", ["--output_dir", f"{root}/pretrain", *tiny, "--preset", "tiny", "--vocab_size", "300",
                       "--block_size", "32", "--max_position_embeddings", "128", "--config_overrides",
                       "hidden_size=128,intermediate_size=256,num_attention_heads=2,num_key_value_heads=1"])
run_stage("sft", ["--output_dir", f"{root}/sft", *tiny, *trl, "--max_length", "64",
                  "--model_name_or_path", f"{root}/pretrain"])
run_stage("grpo", ["--output_dir", f"{root}/grpo", *tiny, *trl, "--num_generations", "4",
                   "--max_completion_length", "8", "--model_name_or_path", f"{root}/sft",
                   "--reward_functions", "exact_match", "format", "--use_vllm", "true", "--vllm_mode", "colocate",
                   "--vllm_max_model_length", "128"])
print("UNTOUCHED", "TorchCompileWithNoGuardsWrapper" not in [b.__name__ for b in plugformer.PlugformerModel.__mro__])
"""


def test_grpo_stage_generates_with_vllm_colocated(tmp_path):
    """plugformer's GRPO stage with TRL's `use_vllm=True, vllm_mode="colocate"` (vLLM in the trainer's process,
    the plugin's model, TRL's default `vllm_model_impl="vllm"`), 3 steps. Each step TRL scores vLLM's sampled
    tokens with the policy after syncing its weights into vLLM; `sampling/sampling_logp_difference/max` is the
    largest |log p_vLLM − log p_policy| over them. vLLM computes in bfloat16 here (its `dtype="auto"` downcasts a
    float32 checkpoint; TRL passes no dtype), hence the bound. Run in a fresh process (with transformers 5.19, so
    `--gradient_checkpointing` is the flag's name)."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", GRPO_RUN, str(tmp_path)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "UNTOUCHED True" in done.stdout
    history = json.loads((tmp_path / "grpo/trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "sampling/sampling_logp_difference/max" in entry]
    assert [entry["step"] for entry in steps] == [1, 2, 3]
    # measured here: mean 1.0e-3, max 4.9e-3 (an untrained model: near-uniform, so bf16 moves it little)
    assert all(entry["sampling/sampling_logp_difference/mean"] < 0.01 for entry in steps), steps
    assert all(entry["sampling/sampling_logp_difference/max"] < 0.1 for entry in steps), steps
    assert all("rewards/exact_match_reward/mean" in entry for entry in steps)
    before, after = load_file(tmp_path / "sft/model.safetensors"), load_file(tmp_path / "grpo/model.safetensors")
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Every variant saved, with transformers' tokens, before vLLM runs: vLLM decorates the model classes in place
    (`support_torch_compile` on `PlugformerModel`), after which they no longer build outside vLLM."""
    saved = {}
    for score, scheme in VARIANTS:
        directory = tmp_path_factory.mktemp(f"{score}-{scheme}")
        saved[score, scheme] = directory, save_model(score, scheme, directory)
    for name, value in MODIFIERS:
        directory = tmp_path_factory.mktemp(f"modifier-{name}")
        fields = modifier_fields_of(name, value)
        saved[name, repr(value)] = directory, save_model("scaled_dot", "rope", directory, **fields)
        if name == "value_residual":  # the same weights without the mix: other tokens, so the check can fail
            without = PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", **{**fields, name: None}))
            state = PlugformerForCausalLM.from_pretrained(directory).state_dict()
            assert {key.rsplit(".", 1)[-1] for key in without.load_state_dict(state, strict=False).unexpected_keys} <= {
                "value_lambdas"
            }
            saved[name, repr(value), "without"] = greedy(without.eval())
    return saved


@pytest.mark.parametrize("score,scheme", VARIANTS)
def test_vllm_generates_what_transformers_generates_or_refuses(score, scheme, checkpoints):
    directory, expected = checkpoints[score, scheme]
    start = time.perf_counter()
    try:
        tokens = vllm_greedy(directory)
    except Exception as error:  # which exception is the point of the test
        reason = refusal_of(error)
        TABLE[f"{score}+{scheme}"] = {
            "outcome": "refused" if reason else "error",
            "seconds": time.perf_counter() - start,
            "message": (reason or repr(error))[:300],
        }
        if reason is None:
            raise
        assert f"attention_score={score!r}" in reason or f"position_scheme={scheme!r}" in reason
        # refused exactly where the kernel table says vLLM's kernel (no record: a plain dot product without a bias)
        # cannot compute the variant
        config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **SIZES)
        assert plugformer.capabilities.unsupported_reason(config, "vllm") is not None
        return
    identical = tokens == expected
    TABLE[f"{score}+{scheme}"] = {
        "outcome": "identical" if identical else "DIFFERENT",
        "seconds": time.perf_counter() - start,
    }
    assert identical, f"vLLM generated {tokens}, transformers {expected}"


@pytest.mark.parametrize("name,value", MODIFIERS, ids=[f"{name}={value!r}" for name, value in MODIFIERS])
def test_vllm_generates_what_transformers_generates_or_refuses_each_modifier(name, value, checkpoints):
    """Gated attention and value residuals run in plugformer's modules around vLLM's attention: identical tokens.
    Latent attention (vLLM sizes its KV cache for `num_key_value_heads` heads of `head_dim`), softcapping and sinks
    are refused naming the field, where the kernel table says vLLM's kernel cannot compute them."""
    directory, expected = checkpoints[name, repr(value)]
    fields = modifier_fields_of(name, value)
    start = time.perf_counter()
    try:
        tokens = vllm_greedy(directory)
    except Exception as error:  # which exception is the point of the test
        reason = refusal_of(error)
        TABLE[f"scaled_dot+rope, {name}={value!r}"] = {
            "outcome": "refused" if reason else "error",
            "seconds": time.perf_counter() - start,
            "message": (reason or repr(error))[:300],
        }
        if reason is None:
            raise
        assert f"{name}=" in reason
        assert plugformer.capabilities.unsupported_reason(PlugformerConfig.from_preset("tiny", **fields), "vllm")
        return
    TABLE[f"scaled_dot+rope, {name}={value!r}"] = {
        "outcome": "identical" if tokens == expected else "DIFFERENT",
        "seconds": time.perf_counter() - start,
    }
    assert tokens == expected, f"vLLM generated {tokens}, transformers {expected}"
    if name == "value_residual":
        assert checkpoints[name, repr(value), "without"] != expected


def teardown_module(module):
    path = os.environ.get("PLUGFORMER_VLLM_TABLE")
    if path:
        with open(path, "w") as handle:
            json.dump(TABLE, handle, indent=1)
