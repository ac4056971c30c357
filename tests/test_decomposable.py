"""The decomposable attention model (Parikh et al. 2016): reference computation, learning, Auto classes, pipeline."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, pipeline

from plugformer import DecomposableAttentionConfig, DecomposableAttentionForSequenceClassification, train_tokenizer
from plugformer.data.corpus import NLI_LABELS, nli_examples


SEP = 3


def softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [x / sum(exps) for x in exps]


def test_attend_compare_aggregate_match_hand_computation():
    """With F, G, H set to identities the model is the paper's equations alone; compare with Python floats.

    Premise a = (a1, a2), hypothesis b = (b1, b2), 2-d vectors. e_ij = a_i·b_j; β_i = Σ_j softmax_j(e_ij) b_j;
    α_j = Σ_i softmax_i(e_ij) a_i; v1 = Σ_i [a_i, β_i]; v2 = Σ_j [b_j, α_j]; logits = W [v1, v2].
    """
    config = DecomposableAttentionConfig(
        vocab_size=8, embedding_size=2, hidden_size=2, sep_token_id=SEP, hidden_dropout=0.0
    )
    model = DecomposableAttentionForSequenceClassification(config).eval()
    vectors = {4: [1.0, 0.5], 5: [-0.5, 2.0], 6: [0.3, -1.0], 7: [1.5, 1.0]}
    with torch.no_grad():
        for token, vector in vectors.items():
            model.embed_tokens.weight[token] = torch.tensor(vector)
        model.input_proj.weight.copy_(torch.eye(2))
        model.classifier = nn.Linear(8, 3, bias=False)
        weights = torch.arange(24, dtype=torch.float32).reshape(3, 8) / 10 - 1
        model.classifier.weight.copy_(weights)
    model.attend_ff = model.compare_ff = model.aggregate_ff = nn.Identity()
    a, b = [vectors[4], vectors[5]], [vectors[6], vectors[7]]
    e = [[sum(x * y for x, y in zip(ai, bj, strict=True)) for bj in b] for ai in a]
    beta = [[sum(w * bj[k] for w, bj in zip(softmax(e[i]), b, strict=True)) for k in range(2)] for i in range(2)]
    column = [softmax([e[0][j], e[1][j]]) for j in range(2)]
    alpha = [[sum(w * ai[k] for w, ai in zip(column[j], a, strict=True)) for k in range(2)] for j in range(2)]
    v1 = [sum(values) for values in zip(*[a[i] + beta[i] for i in range(2)], strict=True)]
    v2 = [sum(values) for values in zip(*[b[j] + alpha[j] for j in range(2)], strict=True)]
    expected = weights @ torch.tensor(v1 + v2)
    # padding after the pair must not change anything
    ids = torch.tensor([[4, 5, SEP, 6, 7, 0]])
    out = model(ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]]), output_attentions=True)
    torch.testing.assert_close(out.logits[0], expected)
    torch.testing.assert_close(out.attentions[0][0, :2, 3:5], torch.tensor([softmax(row) for row in e]))
    same = model(torch.tensor([[4, 5, 6, 7]]), token_type_ids=torch.tensor([[0, 0, 1, 1]])).logits
    torch.testing.assert_close(same[0], expected)


def test_intra_sentence_attention_uses_distance_biases():
    torch.manual_seed(0)  # 4 ReLU units: some initialisations leave the alignment network dead for these tokens
    config = DecomposableAttentionConfig(
        vocab_size=16, embedding_size=4, hidden_size=4, sep_token_id=SEP, intra_attention=True, max_intra_distance=2
    )
    model = DecomposableAttentionForSequenceClassification(config).eval()
    assert model.distance_bias.weight.shape == (5, 1)  # distances -2..2
    ids = torch.tensor([[4, 5, 6, 7, 8, SEP, 9, 10, 11]])
    model(ids, labels=torch.tensor([1])).loss.backward()
    assert model.distance_bias.weight.grad.abs().min() > 0  # every clamped distance is used
    assert model.intra_ff[1].weight.grad.abs().sum() > 0


def test_rows_without_a_separator_are_refused():
    model = DecomposableAttentionForSequenceClassification(DecomposableAttentionConfig(vocab_size=16, sep_token_id=SEP))
    with pytest.raises(ValueError, match="separator token 3"):
        model(torch.tensor([[4, 5, 6]]))


@pytest.fixture(scope="module")
def trained_nli(tmp_path_factory):
    train, test = nli_examples(3000, seed=0), nli_examples(300, seed=1)
    tokenizer = train_tokenizer([p + " " + h for p, h, _ in train], vocab_size=300)
    config = DecomposableAttentionConfig(
        vocab_size=len(tokenizer),
        embedding_size=64,
        hidden_size=64,
        intra_attention=True,
        hidden_dropout=0.1,
        pad_token_id=tokenizer.pad_token_id,
        sep_token_id=tokenizer.sep_token_id,
        id2label=NLI_LABELS,
        label2id={v: k for k, v in NLI_LABELS.items()},
    )
    torch.manual_seed(0)
    model = DecomposableAttentionForSequenceClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = [train[i] for i in torch.randint(len(train), (32,), generator=generator)]
        inputs = tokenizer([p for p, _, _ in batch], [h for _, h, _ in batch], padding=True, return_tensors="pt")
        model(**inputs, labels=torch.tensor([label for *_, label in batch])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    directory = tmp_path_factory.mktemp("nli")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model, tokenizer, test


def test_learns_the_generated_nli_task(trained_nli):
    _, model, tokenizer, test = trained_nli
    inputs = tokenizer([p for p, _, _ in test], [h for _, h, _ in test], padding=True, return_tensors="pt")
    with torch.no_grad():
        predictions = model(**inputs).logits.argmax(-1)
    accuracy = (predictions == torch.tensor([label for *_, label in test])).float().mean().item()
    assert accuracy > 0.85, accuracy  # chance: 1/3


def test_auto_class_and_text_classification_pipeline_on_pairs(trained_nli):
    directory, model, tokenizer, _ = trained_nli
    loaded = AutoModelForSequenceClassification.from_pretrained(directory)
    assert type(loaded) is DecomposableAttentionForSequenceClassification
    classifier = pipeline("text-classification", model=str(directory))
    pairs = [
        {"text": "the man is running in the park", "text_pair": "the man is not running"},
        {"text": "a doctor is reading in the library", "text_pair": "a doctor is in the library"},
    ]
    results = classifier(pairs)
    inputs = tokenizer([p["text"] for p in pairs], [p["text_pair"] for p in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**inputs).logits.softmax(-1)
    for result, row in zip(results, probabilities, strict=True):
        assert result["label"] == NLI_LABELS[row.argmax().item()]
        assert result["score"] == pytest.approx(row.max().item(), abs=1e-5)
    assert [r["label"] for r in results] == ["contradiction", "entailment"]
