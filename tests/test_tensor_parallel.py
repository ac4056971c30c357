"""Tensor parallelism: `from_pretrained(..., tp_plan="auto")` across 2 CPU processes equals the one-process model, for
every attention score, every position scheme and every head class (the whole causal score x scheme product with
`-m slow`).

One `torchrun --nproc_per_node 2` launch (gloo, one thread per rank) runs every case in `tests/tp_worker.py`, which
loads each checkpoint saved here both ways and records logits, greedy tokens, losses, gradients and the shapes of the
sharded parameters; the tests below assert on those records. The plan and hook contracts are checked in-process.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import takes
from transformers.distributed import DistributedConfig

import plugformer
from plugformer import ATTENTION_SCORES, POSITION_SCHEMES, PlugformerConfig
from plugformer.compat import TENSOR_PARALLEL_VERIFIED
from plugformer.configuration import VARIANT_REGISTRIES


try:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
except ImportError:  # transformers 5.19 has it in `distributed.tensor_parallel` (compat.py)
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard


pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with the gloo backend",
    ),
    pytest.mark.skipif(
        not TENSOR_PARALLEL_VERIFIED,
        reason=f"transformers {transformers.__version__}: tensor parallelism is refused there (compat.py)",
    ),
]

TP_SIZE = 2
SCORES, SCHEMES = ATTENTION_SCORES.names(), POSITION_SCHEMES.names()


def pairs(**overrides) -> list[tuple[str, str]]:
    """Every score that takes the config fields `overrides` (`conftest.takes`: a `causal_only` score has no encoder)
    and every position scheme, each at least once: for the head classes that do not run the full product."""
    scores = [score for score in SCORES if takes(score, **overrides)]
    return [(scores[i % len(scores)], SCHEMES[i % len(SCHEMES)]) for i in range(max(len(scores), len(SCHEMES)))]


PAIRS = pairs()
EAGER_PAIRS = [(score, scheme) for score, scheme in PAIRS if POSITION_SCHEMES.get(scheme).has_bias]
SEQ2SEQ = {"is_encoder_decoder": True, "pad_token_id": 0, "eos_token_id": 1}
HEAD_CONFIGS = {  # head class -> config overrides
    "PlugformerForCausalLM": {},
    "PlugformerForMaskedLM": {"is_causal": False},
    "PlugformerForSequenceClassification": {},
    "PlugformerForTokenClassification": {"is_causal": False},
    "PlugformerForConditionalGeneration": SEQ2SEQ,
}
HEAD_PAIRS = {head: pairs(**overrides) for head, overrides in HEAD_CONFIGS.items()}
GENERATES = {"PlugformerForCausalLM", "PlugformerForConditionalGeneration"}


MODIFIERS = {
    "gated-attention": {"use_gated_attention": True},
    "value-residual-fixed": {"value_residual": "fixed"},
    "layer-types": {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
}


def tiny(score: str = "scaled_dot", scheme: str = "rope", **overrides) -> PlugformerConfig:
    """hidden 32, 2 layers, 4 query heads over 2 key/value heads (GQA: one key/value head per rank)."""
    return PlugformerConfig.from_preset("tiny", attention_score=score, position_scheme=scheme, **overrides)


def case(name, head, config, kernel=None, generate=False, train=False) -> dict:
    return {"name": name, "head": head, "config": config, "kernel": kernel, "generate": generate, "train": train}


# the causal cases run by default: each score and scheme at least once (`PAIRS`), and a per-head score weight beside
# a bias table (the sharded shapes `test_every_score_and_position_scheme_matches_one_process` reads); `-m slow` runs the
# rest of the score x scheme product
CAUSAL_DEFAULT = {*PAIRS, ("multiplicative", "t5_bias")}


def causal_cases(product: bool) -> list[dict]:
    """The causal LM over the score x scheme pairs: `CAUSAL_DEFAULT`'s, or (`product`) the rest of the product; each
    generates, and trains where it is one of `PAIRS` (each score and scheme's gradients once)."""
    causal = "PlugformerForCausalLM"
    chosen = [(s, p) for s in SCORES for p in SCHEMES if ((s, p) in CAUSAL_DEFAULT) != product]
    return [case(f"{causal}-{s}-{p}", causal, tiny(s, p), generate=True, train=(s, p) in PAIRS) for s, p in chosen]


def cases() -> list[dict]:
    """The default tier's cases: `causal_cases`' default pairs, every head class, the eager kernel, multi-head
    additive attention, the modifiers and the refusals."""
    causal = "PlugformerForCausalLM"
    heads = [  # (their own layers are replicated: only the seq2seq one adds sharded layers to train through)
        case(f"{head}-{s}-{p}", head, tiny(s, p, **overrides), generate=head in GENERATES, train=head in GENERATES)
        for head, overrides in HEAD_CONFIGS.items()
        if head != causal
        for s, p in HEAD_PAIRS[head]
    ]
    # The default kernel is sdpa for the dot-product scores; plugformer's eager kernel adds a bias its own way
    eager = [case(f"eager-{s}-{p}", causal, tiny(s, p), kernel="eager") for s, p in EAGER_PAIRS]
    multi_head = [
        case("multi-head-additive-t5_bias", causal, tiny("additive", "t5_bias", num_key_value_heads=4), train=True)
    ]
    refused = [case("mqa", causal, tiny(num_key_value_heads=1))]
    # attention modifiers that change the sharded projections or mix heads' values: gated attention's q_proj (each
    # head's query then its gate, split by columns), value residuals (each rank mixes its own key/value heads),
    # per-layer sliding windows; the learned value-residual lambdas are refused
    modifiers = [case(name, causal, tiny(**fields), generate=True, train=True) for name, fields in MODIFIERS.items()]
    refused.append(case("value-residual-learned", causal, tiny(value_residual="learned")))
    return causal_cases(product=False) + heads + eager + multi_head + modifiers + refused


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(entries: list[dict], root: Path) -> dict[str, tuple[dict, list[dict]]]:
    """`name -> (case, [rank 0 record, rank 1 record])`, from one torchrun launch over `entries`, saved under `root`."""
    manifest = []
    for entry in entries:
        torch.manual_seed(0)
        model = getattr(plugformer, entry["head"])(copy.deepcopy(entry["config"]))
        path = root / entry["name"]
        model.save_pretrained(path)
        entry["parameters"] = {name: list(param.shape) for name, param in model.named_parameters()}
        variants = {"score": entry["config"].attention_score, "scheme": entry["config"].position_scheme}
        manifest.append({**{k: v for k, v in entry.items() if k != "config"}, **variants, "path": str(path)})
    (root / "manifest.json").write_text(json.dumps(manifest))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={TP_SIZE}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(Path(__file__).with_name("tp_worker.py")),
        str(root / "manifest.json"),
        str(root),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.fail(f"torchrun exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    ranks = [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(TP_SIZE)]
    return {entry["name"]: (entry, [records[entry["name"]] for records in ranks]) for entry in manifest}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """The records of the default tier's `cases()`."""
    return launch(cases(), tmp_path_factory.mktemp("tensor_parallel"))


@pytest.fixture(scope="module")
def measured_product(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """The records of the rest of the causal score x scheme product (`-m slow`)."""
    return launch(causal_cases(product=True), tmp_path_factory.mktemp("tensor_parallel_product"))


def sharded_dim(name: str) -> int | None:
    """The dim the plan splits into heads, for the parameters this feature added to the plan."""
    if ".score." in name:  # every score parameter is (H or H_kv, ...)
        return 0
    if "positions.relative_attention_bias" in name:  # (distances or buckets, H)
        return 1
    if ".forget_proj." in name:  # forgetting attention's gates: (H, hidden) and (H,), split as q_proj's rows
        return 0
    if ".cross_attn." in name:
        return 1 if ".o_proj." in name else 0
    return None


def assert_equal_to_one_process(entry: dict, records: list[dict]) -> None:
    """Equal to the one-process model on every rank; a score or scheme that declares `tensor_parallel = False` must
    instead be refused at load on every rank with a ValueError naming it."""
    for registry, name in ((ATTENTION_SCORES, entry["score"]), (POSITION_SCHEMES, entry["scheme"])):
        if not registry.get(name).tensor_parallel:
            for record in records:
                assert record.get("error") == "ValueError" and f"{registry.axis}={name!r}" in record["message"], record
            return
    for rank, record in enumerate(records):
        where = f"{entry['name']} on rank {rank}"
        assert "error" not in record, f"{where}: {record.get('traceback')}"
        assert record["logits_shape"][0] == record["logits_shape"][1], where
        # fp32; measured differences are ~1e-7 (the all-reduce sums the heads' partial outputs in another order), the
        # bounds the worker derives from the model (`tolerances.model_tolerance`, `gradient_tolerance`)
        assert record["max_abs_diff"] <= record["atol"], (where, record["max_abs_diff"], record["atol"])
        if entry["generate"]:
            assert record["generated"] == record["generated_reference"], where
        if entry["train"]:
            assert record["loss_diff"] <= record["loss_atol"], (where, record["loss_diff"], record["loss_atol"])
            worst = max(record["grad_diff"].items(), key=lambda item: item[1])
            assert worst[1] <= record["grad_atol"], (where, worst, record["grad_atol"])
        for name, full_shape in entry["parameters"].items():
            dim = sharded_dim(name)
            if dim is not None:
                local_shape = list(full_shape)
                local_shape[dim] //= TP_SIZE
                assert record["sharded"].get(name) == [local_shape, full_shape], (where, name)


def test_every_score_and_position_scheme_matches_one_process(measured):
    """Causal LM, each score and each scheme at least once (`CAUSAL_DEFAULT`): logits and greedy tokens equal the
    one-process model's; the per-head score parameters and bias tables hold this rank's heads only."""
    for score, scheme in sorted(CAUSAL_DEFAULT):
        assert_equal_to_one_process(*measured[f"PlugformerForCausalLM-{score}-{scheme}"])
    sharded = measured["PlugformerForCausalLM-multiplicative-t5_bias"][1][0]["sharded"]
    assert sharded["model.layers.0.self_attn.score.weight"] == [[2, 8, 8], [4, 8, 8]]
    assert sharded["model.positions.relative_attention_bias.weight"] == [[8, 2], [8, 4]]


@pytest.mark.slow
def test_the_whole_score_and_scheme_product_matches_one_process(measured_product):
    """The causal LM's score x scheme pairs outside `CAUSAL_DEFAULT`, as above."""
    for entry, records in measured_product.values():
        assert_equal_to_one_process(entry, records)
    assert len(measured_product) == len(SCORES) * len(SCHEMES) - len(CAUSAL_DEFAULT)


def test_every_head_class_matches_one_process(measured):
    """Masked LM, sequence and token classification, seq2seq (cross-attention sharded too; greedy tokens equal):
    each score the head takes and each scheme at least once."""
    for head in HEAD_CONFIGS:
        for score, scheme in HEAD_PAIRS[head]:
            assert_equal_to_one_process(*measured[f"{head}-{score}-{scheme}"])
    score, scheme = HEAD_PAIRS["PlugformerForConditionalGeneration"][0]
    seq2seq = measured[f"PlugformerForConditionalGeneration-{score}-{scheme}"][1][0]["sharded"]
    assert seq2seq["decoder.layers.0.cross_attn.k_proj.weight"] == [[8, 32], [16, 32]]


def test_eager_kernel_and_multi_head_attention_match_one_process(measured):
    for score, scheme in EAGER_PAIRS:
        assert_equal_to_one_process(*measured[f"eager-{score}-{scheme}"])
    entry, records = measured["multi-head-additive-t5_bias"]
    assert_equal_to_one_process(entry, records)
    assert records[0]["sharded"]["model.layers.0.self_attn.score.key_weight"][0][0] == 2  # 4 key/value heads over 2


def test_fewer_key_value_heads_than_ranks_is_refused(measured):
    """One key/value head (MQA) cannot be split over 2 ranks: `from_pretrained` raises a ValueError naming the field,
    its value and the TP size, before any weight is loaded."""
    for record in measured["mqa"][1]:
        assert record["error"] == "ValueError", record
        assert "num_key_value_heads=1" in record["message"] and "tp_size=2" in record["message"], record["message"]


@pytest.mark.parametrize("name", list(MODIFIERS))
def test_attention_modifiers_match_one_process(measured, name):
    assert_equal_to_one_process(*measured[name])


def test_learned_value_residual_is_refused(measured):
    for record in measured["value-residual-learned"][1]:
        assert record["error"] == "ValueError", record
        assert "value_residual='learned'" in record["message"] and "tp_size=2" in record["message"], record


def test_refusal_needs_no_process_group():
    config = tiny(num_key_value_heads=1)
    config.distributed_config = DistributedConfig(tp_size=TP_SIZE)  # what from_pretrained sets before building
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 cannot be split over tp_size=2"):
        plugformer.PlugformerForCausalLM(config)
    config = tiny()  # 2 key/value heads: one per rank
    config.distributed_config = DistributedConfig(tp_size=TP_SIZE)
    plugformer.PlugformerForCausalLM(config)


def unmatched_rules(model) -> set[str]:
    """The rules of the model's TP plan that name no module or parameter (transformers warns and skips them)."""
    names = {replace_layer_number_by_wildcard(name) for name, _ in (*model.named_modules(), *model.named_parameters())}
    return set(model.tp_plan) - names


@pytest.mark.parametrize("head", list(HEAD_CONFIGS))
def test_every_plan_rule_names_a_module_or_parameter(head):
    for score, scheme in HEAD_PAIRS[head]:
        model = getattr(plugformer, head)(tiny(score, scheme, **HEAD_CONFIGS[head]))
        assert not unmatched_rules(model), (score, scheme, sorted(unmatched_rules(model)))


def test_seq2seq_plan_shards_cross_attention_and_both_stacks():
    model = plugformer.PlugformerForConditionalGeneration(tiny("multiplicative", "t5_bias", **SEQ2SEQ))
    for rule in ("q_proj", "k_proj", "v_proj", "o_proj", "score"):
        assert f"decoder.layers.*.cross_attn.{rule}" in model.tp_plan
    for stack in ("encoder", "decoder"):
        assert f"{stack}.layers.*.self_attn.score" in model.tp_plan
        assert f"{stack}.positions.relative_attention_bias.weight" in model.tp_plan
    # no stack rule at the top (the head is its own base model; each stack brings the plan under its prefix), and the
    # decoder's embedding is a module of its own (its weight tied to the encoder's)
    assert not unmatched_rules(model) and "decoder.embed_tokens" in model.tp_plan


@pytest.mark.parametrize("score", SCORES)
def test_score_parameters_are_per_head(score):
    """The contract the plan's `layers.*.self_attn.score` rule relies on: every score parameter is split on dim 0
    into heads; out of tensor parallelism `local` hands the parameter itself back."""
    config = tiny(score)
    if not ATTENTION_SCORES.get(score).tensor_parallel:  # refused under tp_plan instead (see the next test)
        return
    module = ATTENTION_SCORES.get(score)(config)
    for name, param in module.named_parameters():
        assert param.shape[0] in (config.num_attention_heads, config.num_key_value_heads), (name, param.shape)
        assert module.local(param) is param


@pytest.mark.parametrize("registry", VARIANT_REGISTRIES, ids=lambda registry: registry.axis)
def test_variants_declaring_no_tensor_parallelism_are_refused_under_it(registry, monkeypatch):
    """A score, scheme or attention projection that says `tensor_parallel = False` is refused, naming its field, once
    `from_pretrained` has set a tensor-parallel `distributed_config`; without one it builds."""
    name = getattr(tiny(), registry.axis)
    monkeypatch.setattr(registry.get(name), "tensor_parallel", False)
    plugformer.PlugformerForCausalLM(tiny())
    config = tiny()
    config.distributed_config = DistributedConfig(tp_size=TP_SIZE)
    with pytest.raises(ValueError, match=rf"{registry.axis}={name!r} cannot run with tensor parallelism \(tp_size=2\)"):
        plugformer.PlugformerForCausalLM(config)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("is_causal", [True, False])
def test_position_scheme_plans_name_their_own_parameters(scheme, is_causal):
    module = POSITION_SCHEMES.get(scheme)(tiny(scheme=scheme, is_causal=is_causal))
    names = {name for name, _ in (*module.named_modules(), *module.named_parameters())}
    assert set(module.tp_plan) <= names
    assert set(tiny(scheme=scheme).base_model_tp_plan) >= {f"positions.{rule}" for rule in module.tp_plan}
