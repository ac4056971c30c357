"""The nli stage: the decomposable attention model (Parikh et al. 2016) trained from scratch on sentence pairs (the
embedded inference grammar, or your own csv), `plugformer eval` and `compare` on it, and the model facts the stage
relies on (the separator belongs to neither sentence, no word order without intra-sentence attention, the
initialisation)."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter

import pytest
import torch
from tolerances import model_tolerance
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from plugformer import (
    DecomposableAttentionConfig,
    DecomposableAttentionForSequenceClassification,
    PlugformerConfig,
    PlugformerForCausalLM,
    train_tokenizer,
)
from plugformer.data.nli import HYPOTHESES, PEOPLE, PLACES, nli_rows, premises
from plugformer.data.sources import load_stage_dataset, split_of_key
from plugformer.evaluation.held_out import held_out_rows, recorded_source
from plugformer.evaluation.scoring import main as eval_main
from plugformer.experiments.compare import CompareArguments, run
from plugformer.runtime.arguments import override_flags
from plugformer.training import parse_stage_arguments, run_stage


FLAGS = ["--config", "configs/nli/tiny.yaml", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0"]


def nli(output_dir, *extra: str) -> dict:
    return run_stage("nli", override_flags(["--output_dir", str(output_dir)], FLAGS, list(extra)))


def test_the_inference_grammar_by_hand():
    rng = random.Random(0)
    hypotheses = {
        label: [template("the man", "helping", "the woman", "park", rng) for template in templates]
        for label, templates in HYPOTHESES.items()
    }
    assert hypotheses["entailment"] == [
        "the man is helping the woman in the park",
        "the man is in the park",
        "the woman is in the park",
        "someone is helping the woman",
        "the man is helping someone",
    ]
    swapped, extra, other_object, other_subject, other_person = hypotheses["neutral"]
    assert swapped == "the woman is helping the man in the park"  # the premise's words, in another order
    assert sorted(swapped.split()) == sorted(hypotheses["entailment"][0].split())
    assert extra.startswith("the man is helping the woman ") and len(extra.split()) > 5
    for person in (
        other_object.split(" is helping ")[1],
        other_subject.split(" is helping ")[0],
        other_person.split(" is in ")[0],
    ):
        assert person in PEOPLE and person not in ("the man", "the woman")
    negated, not_there, nobody, elsewhere, object_elsewhere = hypotheses["contradiction"]
    assert (negated, not_there, nobody) == (
        "the man is not helping the woman",
        "the man is not in the park",
        "nobody is helping the woman",
    )
    for sentence, person in ((elsewhere, "the man"), (object_elsewhere, "the woman")):
        place = sentence.removeprefix(f"{person} is in the ")
        assert place in PLACES and place != "park"


def test_rows_are_split_by_premise_balanced_and_deterministic():
    data = load_stage_dataset("sentence_pair", sizes={"train": 3000, "dev": 300, "test": 300}, seed=2)
    premises_of = {split: set(rows["text"]) for split, rows in data.items()}
    assert not premises_of["train"] & premises_of["dev"] and not premises_of["train"] & premises_of["test"]
    assert all(split_of_key(row["text"]) == split for split, rows in data.items() for row in rows)
    assert Counter(data["test"]["label"]) == {"entailment": 100, "neutral": 100, "contradiction": 100}
    assert len({(row["text"], row["text_pair"]) for row in data["train"]}) == 3000  # distinct pairs
    assert nli_rows(50, "dev", seed=2) == nli_rows(50, "dev", seed=2) != nli_rows(50, "dev", seed=3)
    assert sum(len(premises(split)) for split in ("train", "dev", "test")) == 10 * 9 * 8 * 8


def tiny_model(intra_attention: bool, **fields) -> DecomposableAttentionForSequenceClassification:
    torch.manual_seed(0)
    fields = {"vocab_size": 64, "sep_token_id": 3, **fields}
    config = DecomposableAttentionConfig(
        embedding_size=8, hidden_size=8, hidden_dropout=0.0, pad_token_id=0, intra_attention=intra_attention, **fields
    )
    return DecomposableAttentionForSequenceClassification(config).eval()


def test_without_intra_attention_swapped_roles_read_alike_and_with_it_they_do_not():
    """Without intra-sentence attention each sentence is a bag of words: a hypothesis with its words reordered gives
    the same logits, whatever the weights; the distance bias of intra-sentence attention tells them apart."""
    premise, entailed, swapped = [10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15], [10, 15, 12, 13, 14, 11]
    for intra, equal in ((False, True), (True, False)):
        model = tiny_model(intra)
        with torch.no_grad():
            logits = model(torch.tensor([[*premise, 3, *entailed], [*premise, 3, *swapped]])).logits
        # reordered words sum in another order: equal within fp32's rounding through the model (`model_tolerance`)
        atol = model_tolerance(model.config, logits[None])
        assert torch.allclose(logits[0], logits[1], atol=atol, rtol=0) == equal, intra


def test_the_separator_belongs_to_neither_sentence():
    """A tokenizer's pair marks its separator as the premise's (token type 0); the model leaves it out of both
    sentences, so the logits equal those of the pair split at the separator, and of token types without it."""
    tokenizer = train_tokenizer(["the man is helping the woman in the park"], vocab_size=300)
    model = tiny_model(True, vocab_size=len(tokenizer), sep_token_id=tokenizer.sep_token_id)
    encoded = tokenizer(
        ["the man is helping the woman"], ["the woman is here"], return_tensors="pt", return_token_type_ids=True
    )
    ids, types = encoded["input_ids"], encoded["token_type_ids"]
    sep = int((ids[0] == tokenizer.sep_token_id).nonzero())
    assert types[0, sep] == 0 and types[0, sep + 1] == 1
    with torch.no_grad():
        typed = model(ids, token_type_ids=types).logits
        split_at_sep = model(ids).logits
        without_sep = model(
            torch.cat([ids[:, :sep], ids[:, sep + 1 :]], 1),
            token_type_ids=torch.cat([types[:, :sep], types[:, sep + 1 :]], 1),
        ).logits
    torch.testing.assert_close(typed, split_at_sep)
    torch.testing.assert_close(typed, without_sep)


def test_initialisation_unit_embeddings_and_pytorch_linear_layers():
    config = DecomposableAttentionConfig(vocab_size=4000, embedding_size=64, hidden_size=32, pad_token_id=0)
    torch.manual_seed(0)
    model = DecomposableAttentionForSequenceClassification(config)
    embeddings = model.embed_tokens.weight.detach()
    assert embeddings[0].abs().sum() == 0  # the padding row
    assert embeddings[1:].std().item() == pytest.approx(1.0, abs=0.01) and abs(embeddings[1:].mean().item()) < 0.01
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):  # uniform(±1/sqrt(fan_in)): variance 1/(3 fan_in)
            bound = 1 / math.sqrt(module.in_features)
            assert module.weight.abs().max().item() <= bound, name
            assert module.weight.var().item() == pytest.approx(bound**2 / 3, rel=0.1), name
            if module.bias is not None:
                assert module.bias.abs().max().item() <= bound, name


def predictions_one_by_one(model_dir, rows) -> list[int]:
    """1/0 per row: each pair alone through transformers' Auto classes (no padding), argmax against the saved
    `label2id`."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    correct = []
    with torch.no_grad():
        for row in rows:
            logits = model(**tokenizer(row["text"], row["text_pair"], return_tensors="pt")).logits
            correct.append(int(logits.argmax(-1).item() == model.config.label2id[str(row["label"])]))
    return correct


def test_nli_learns_the_grammar_and_eval_scores_its_test_split(tmp_path):
    info = nli(
        tmp_path / "nli",
        "--max_steps",
        "300",
        "--train_examples",
        "9600",
        "--dev_examples",
        "150",
        "--test_examples",
        "60",
    )
    assert info["labels"] == ["contradiction", "entailment", "neutral"]
    assert info["metrics"]["eval_accuracy"] >= 0.7  # chance 1/3; 300 steps measured 0.78-0.84 with seeds 0-3
    config = json.loads((tmp_path / "nli/config.json").read_text())
    assert config["model_type"] == "decomposable_attention" and config["id2label"]["2"] == "neutral"
    card = (tmp_path / "nli/README.md").read_text()
    assert "plugformer-nli" in card and "AutoModelForSequenceClassification" in card
    assert "intra_attention:false" in card and "bag of words" in card and "attention_score" not in card
    results = eval_main(["--model", str(tmp_path / "nli"), "--examples", "60"])
    rows = load_stage_dataset("sentence_pair", sizes={"test": 60})["test"]
    assert results["correct"] == predictions_one_by_one(tmp_path / "nli", rows)
    assert results["accuracy"] == sum(results["correct"]) / 60


def pairs_csv(path, count: int = 240) -> None:
    """Sentence pairs under column names of their own, integer labels (0 entailment, 1 neutral, 2 contradiction)."""
    names = {"entailment": 0, "neutral": 1, "contradiction": 2}
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["premise", "hypothesis", "gold"])
        for row in nli_rows(count, "train", seed=5):
            writer.writerow([row["text"], row["text_pair"], names[row["label"]]])


def test_nli_on_your_csv_then_continued_and_eval_on_the_rows_it_held_out(tmp_path):
    pairs_csv(tmp_path / "pairs.csv")
    data = [
        "--dataset_name",
        "csv",
        "--data_files",
        str(tmp_path / "pairs.csv"),
        "--dev_examples",
        "20",
        "--test_examples",
        "30",
        "--held_out_fraction",
        "1",
        "--rename_columns",
        "premise=text,hypothesis=text_pair,gold=label",
    ]
    info = nli(tmp_path / "mine", *data, "--max_steps", "20", "--vocab_size", "300", "--intra_attention", "true")
    assert info["labels"] == ["0", "1", "2"] and info["data"]["test_examples"] == 30
    results = eval_main(["--model", str(tmp_path / "mine")])
    rows = held_out_rows(recorded_source(str(tmp_path / "mine")), "test", 300)
    assert results["examples"] == len(rows) == 30
    assert results["correct"] == predictions_one_by_one(tmp_path / "mine", rows)
    assert "pairs.csv" in (tmp_path / "mine/README.md").read_text()
    # continued: the saved model and its tokenizer, trained further (the config's architecture flags match it)
    nli(
        tmp_path / "more",
        *data,
        "--model_name_or_path",
        str(tmp_path / "mine"),
        "--max_steps",
        "5",
        "--intra_attention",
        "true",
    )
    first = AutoModelForSequenceClassification.from_pretrained(tmp_path / "mine")
    more = AutoModelForSequenceClassification.from_pretrained(tmp_path / "more")
    assert more.config.intra_attention and more.config.vocab_size == first.config.vocab_size
    assert not torch.equal(more.classifier.weight, first.classifier.weight)
    with pytest.raises(ValueError, match=r"classifies into \['0', '1', '2'\]; the data's labels are \['contradiction'"):
        nli(
            tmp_path / "other",
            "--model_name_or_path",
            str(tmp_path / "mine"),
            "--max_steps",
            "5",
            "--intra_attention",
            "true",
            "--train_examples",
            "300",
        )  # the grammar's labels are names


def test_what_the_nli_stage_refuses(tmp_path):
    with pytest.raises(ValueError, match=r"--direct_answer_fraction 0.5: the nli stage's data has no worked"):
        parse_stage_arguments("nli", ["--direct_answer_fraction", "0.5"])
    with pytest.raises(ValueError, match=r"--hidden_dropout 1.5: expected a number in \[0, 1\)"):
        parse_stage_arguments("nli", ["--hidden_dropout", "1.5"])
    with pytest.raises(ValueError, match=r"hidden_act='swishy' is not one of"):
        nli(tmp_path / "act", "--hidden_act", "swishy")
    with pytest.raises(ValueError, match=r"--use_peft true: the nli stage trains every weight"):
        nli(tmp_path / "lora", "--use_peft", "true")
    causal = tmp_path / "causal"
    PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", pad_token_id=0)).save_pretrained(causal)
    with pytest.raises(ValueError, match=r"is a 'plugformer' model; the nli stage trains a decomposable"):
        nli(tmp_path / "x", "--model_name_or_path", str(causal))
    saved = tmp_path / "saved"
    shipped = {"embedding_size": 64, "hidden_act": "gelu", "hidden_dropout": 0.1}  # configs/nli/tiny.yaml's
    DecomposableAttentionForSequenceClassification(
        DecomposableAttentionConfig(vocab_size=30, **shipped)
    ).save_pretrained(saved)
    with pytest.raises(ValueError, match=r"--hidden_size 32 \(saved: 128\), --intra_attention True \(saved: False\)"):
        nli(tmp_path / "y", "--model_name_or_path", str(saved), "--hidden_size", "32", "--intra_attention", "true")
    (tmp_path / "single.csv").write_text("text,label\na,b\nc,d\n")
    with pytest.raises(ValueError, match=r"lacks the columns \['text_pair'\] of the 'sentence_pair' format"):
        nli(tmp_path / "bad", "--dataset_name", "csv", "--data_files", str(tmp_path / "single.csv"))
    from plugformer.experiments.grid import route

    # a PlugformerConfig field has no model to go to here (nli builds a decomposable model): refused, not passed on
    with pytest.raises(ValueError, match=r"attention_score=dot: no stage in \['nli'\] has an option"):
        route({"attention_score": "dot"}, ["nli"])
    assert route({"intra_attention": "true"}, ["nli"]) == {"nli": ["--intra_attention", "true"]}
    with pytest.raises(ValueError, match=r"accuracy scores a classifier .* end --stages with classify or nli"):
        CompareArguments(stages=["nli"], metric="perplexity")


def test_compare_nli_variants_scores_the_held_out_pairs_as_eval_does(tmp_path):
    """A planted difference (learning rate 0: the untrained model) is found by accuracy on the grammar's test pairs,
    and compare's 1/0 per pair are `plugformer eval`'s."""
    flags = [f"{FLAGS[i][2:]}={FLAGS[i + 1]}" for i in range(2, len(FLAGS), 2) if FLAGS[i] != "--seed"]
    args = CompareArguments(
        stages=["nli"],
        metric="accuracy",
        output_dir=str(tmp_path / "cmp"),
        seeds=[0],
        grid=["learning_rate=0,5e-3"],
        dev_examples=30,
        test_examples=90,
        set=[*flags, "max_steps=150", "train_examples=4800"],
    )
    summary = run(args)
    rows = summary["variants"]
    assert summary["best"] == "learning_rate=5e-3" and rows["learning_rate=0"]["versus_best"]["significant"]
    trained = next((tmp_path / "cmp/runs").glob("learning_rate=5e-3-*")) / "seed0/nli"
    scored = json.loads((trained / "compare_accuracy_test.json").read_text())
    assert scored["scores"] == eval_main(["--model", str(trained), "--examples", "90"])["correct"]


def test_attention_map_draws_the_alignment_of_a_sentence_pair(tmp_path):
    """`plugformer attention-map --text_pair` of the decomposable model: softmax_j(F(a_i)·F(b_j)) computed here from
    its F and embeddings, premise tokens on the rows and hypothesis tokens on the columns (no separator)."""
    from safetensors.torch import load_file

    from plugformer.evaluation.attention_maps import main as attention_map

    premise, hypothesis = "the man is helping the woman in the park", "the woman is here"
    tokenizer = train_tokenizer([premise, hypothesis], vocab_size=300)
    model = tiny_model(False, vocab_size=len(tokenizer), sep_token_id=tokenizer.sep_token_id)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    attention_map(
        [
            "--model",
            str(tmp_path / "m"),
            "--text",
            premise,
            "--text_pair",
            hypothesis,
            "--output",
            str(tmp_path / "a.png"),
        ]
    )
    weights = load_file(tmp_path / "a.safetensors")["alignment.layer0"][0]  # (premise tokens, hypothesis tokens)
    a_ids, b_ids = (torch.tensor(tokenizer(text)["input_ids"]) for text in (premise, hypothesis))
    with torch.no_grad():
        f_a, f_b = (model.attend_ff(model.input_proj(model.embed_tokens(ids))) for ids in (a_ids, b_ids))
    torch.testing.assert_close(weights, (f_a @ f_b.T).softmax(-1))
    described = json.loads((tmp_path / "a.json").read_text())["maps"]["alignment"]
    assert "".join(described["query_tokens"]) == premise and "".join(described["key_tokens"]) == hypothesis
    assert (tmp_path / "a.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"give the hypothesis as --text_pair"):
        attention_map(["--model", str(tmp_path / "m"), "--text", premise])
    causal = tmp_path / "causal"
    PlugformerForCausalLM(PlugformerConfig.from_preset("tiny", vocab_size=len(tokenizer))).save_pretrained(causal)
    tokenizer.save_pretrained(causal)
    with pytest.raises(ValueError, match=r"only the decomposable attention model reads sentence pairs"):
        attention_map(["--model", str(causal), "--text", premise, "--text_pair", hypothesis])
