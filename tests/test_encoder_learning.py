"""Encoder heads learn, and work in transformers' pipelines after `import plugformer`."""

from __future__ import annotations

import pytest
import torch
from transformers import pipeline

from plugformer import PlugformerConfig, PlugformerForSequenceClassification, train_tokenizer
from plugformer.data.corpus import SENTIMENT_LABELS, sentiment_examples


@pytest.fixture(scope="module")
def sentiment_model(tmp_path_factory):
    """A 2-layer bidirectional encoder (additive attention, T5 bias) trained for 250 steps on the grammar, the
    learning rate decayed linearly to 0. At a constant 3e-3 for 150 steps held-out accuracy swung with the step and
    the machine's thread count (seed 0: 0.90 and "not good" called positive on 1 thread, 1.00 on 2); decayed over 250
    steps it read 1.00 for seeds 0-2 on 1 and 2 threads."""
    train, test = sentiment_examples(2000, seed=0), sentiment_examples(300, seed=1)
    tokenizer = train_tokenizer([text for text, _ in train], vocab_size=300)
    config = PlugformerConfig.from_preset(
        "tiny",
        is_causal=False,
        attention_score="additive",
        position_scheme="t5_bias",
        hidden_size=64,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        num_labels=2,
        id2label=SENTIMENT_LABELS,
        label2id={v: k for k, v in SENTIMENT_LABELS.items()},
    )
    torch.manual_seed(0)
    model = PlugformerForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = 250
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = [train[i] for i in torch.randint(len(train), (32,), generator=generator)]
        inputs = tokenizer([t for t, _ in batch], padding=True, return_tensors="pt")
        loss = model(**inputs, labels=torch.tensor([label for _, label in batch])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    model.eval()
    directory = tmp_path_factory.mktemp("sentiment")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer, test


def test_sentiment_accuracy_on_held_out_sentences(sentiment_model):
    _, model, tokenizer, test = sentiment_model
    inputs = tokenizer([text for text, _ in test], padding=True, return_tensors="pt")
    with torch.no_grad():
        predictions = model(**inputs).logits.argmax(-1)
    accuracy = (predictions == torch.tensor([label for _, label in test])).float().mean().item()
    # chance is 50%; negation makes a bag of adjectives alone score ≈ 60% (it is wrong on the 40% negated)
    assert accuracy > 0.9, accuracy


def test_sentiment_analysis_pipeline(sentiment_model):
    directory, model, tokenizer, _ = sentiment_model
    classifier = pipeline("sentiment-analysis", model=str(directory))
    results = classifier(["the movie was great", "the food was not good", "my day was really awful"])
    assert [r["label"] for r in results] == ["POSITIVE", "NEGATIVE", "NEGATIVE"]
    with torch.no_grad():
        probabilities = model(**tokenizer("the movie was great", return_tensors="pt")).logits.softmax(-1)
    assert results[0]["score"] == pytest.approx(probabilities[0, 1].item(), abs=1e-5)


@pytest.fixture(scope="module")
def saved_encoder(tmp_path_factory):
    """Masked-LM, token-classification and base checkpoints of one encoder, each with the tokenizer."""
    from plugformer import PlugformerForMaskedLM, PlugformerForTokenClassification, PlugformerModel

    tokenizer = train_tokenizer([text for text, _ in sentiment_examples(500)], vocab_size=300)
    labels = {0: "O", 1: "ADJ", 2: "NEG"}
    config = PlugformerConfig.from_preset(
        "tiny",
        is_causal=False,
        position_scheme="alibi",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    directories = {}
    for head in (PlugformerForMaskedLM, PlugformerForTokenClassification, PlugformerModel):
        torch.manual_seed(0)
        directories[head.__name__] = directory = tmp_path_factory.mktemp(head.__name__)
        head(config).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directories, tokenizer


def test_fill_mask_pipeline_ranks_the_models_predictions(saved_encoder):
    directories, tokenizer = saved_encoder
    fill = pipeline("fill-mask", model=str(directories["PlugformerForMaskedLM"]))
    text = f"the movie was {tokenizer.mask_token}"
    results = fill(text, top_k=3)
    inputs = tokenizer(text, return_tensors="pt")
    position = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero().item()
    with torch.no_grad():
        probabilities = fill.model(**inputs).logits[0, position].softmax(-1)
    top = probabilities.topk(3)
    assert [r["token"] for r in results] == top.indices.tolist()
    assert [r["score"] for r in results] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_token_classification_pipeline_labels_each_token(saved_encoder):
    directories, tokenizer = saved_encoder
    tagger = pipeline("token-classification", model=str(directories["PlugformerForTokenClassification"]))
    text = "the food was not good"
    entities = tagger(text, ignore_labels=[])
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        predicted = tagger.model(**inputs).logits[0].argmax(-1)
    assert [e["entity"] for e in entities] == [tagger.model.config.id2label[i] for i in predicted.tolist()]


def test_feature_extraction_pipeline_returns_the_hidden_states(saved_encoder):
    directories, tokenizer = saved_encoder
    extract = pipeline("feature-extraction", model=str(directories["PlugformerModel"]))
    features = torch.tensor(extract("this book was lovely"))
    with torch.no_grad():
        expected = extract.model(**tokenizer("this book was lovely", return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(features, expected)
