"""Fused linear cross-entropy: the language-model loss from the hidden states and the head's weight, row chunk by row
chunk, without the `(B, T, V)` logits or their gradient.

The unfused loss keeps the logits, their float copy, the log-softmax and then its gradient, each `(B·T, V)`: at vocab
32k and 16k tokens a step, 2 GiB apiece in float32. Here each chunk of rows is projected, reduced to its loss, and
turned into its gradient at once (`softmax - one_hot`), which is multiplied back into the gradients of the hidden
states and of the weight; only those two (the sizes of the inputs) outlive the chunk. The gradients are computed in
the forward, so the backward only scales them: three matrix products per chunk, as the unfused loss does (Liger's
fused linear cross-entropy makes the same choice; this is a plain-PyTorch version that runs on any device).
"""

from __future__ import annotations

import torch
from torch import nn

from .inputs import IGNORE_INDEX, check_labels


# Logit elements per chunk (32 MiB in float32): rows per chunk = this // vocab_size. Large enough that each chunk's
# products run near the matmul peak, small enough that the chunk is noise beside the activations.
CHUNK_ELEMENTS = 1 << 23


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Sum over rows of `cross_entropy(cap(hidden @ weight.T), labels)`; every label must be a class (no ignored rows).

    Args of `forward`: `hidden` `(N, H)`, `weight` `(V, H)`, `labels` `(N,)`, `rows` per chunk, `compute_dtype` of
    the products (the autocast dtype, else the inputs'), `grad_hidden`/`grad_weight` whether to compute them,
    `softcap` c: the logits z are capped as c·tanh(z / c) (`final_logit_softcapping`), or not for `None`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, rows, compute_dtype, need_hidden, need_weight, softcap=None):
        exact = torch.promote_types(compute_dtype, torch.float32)  # softmax and sums: float32 at least
        total = torch.zeros((), dtype=exact, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=exact) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)  # (V, H)
            for start in range(0, hidden.shape[0], rows):
                h = hidden[start : start + rows].to(compute_dtype)  # (n, H)
                y = labels[start : start + rows]
                logits = (h @ w.T).to(exact)  # (n, V)
                if softcap is not None:
                    tanh = torch.tanh(logits / softcap)  # (n, V)
                    logits = tanh * softcap
                lse = torch.logsumexp(logits, dim=-1)  # (n,)
                total += (lse - logits.gather(1, y[:, None]).squeeze(1)).sum()
                if not (need_hidden or need_weight):
                    continue
                grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place: (n, V)
                grad[torch.arange(len(y), device=y.device), y] -= 1.0  # d(lse - z_y)/dz
                if softcap is not None:
                    grad.mul_(1.0 - tanh.square_())  # d(c·tanh(z / c))/dz = 1 - tanh²
                grad = grad.to(compute_dtype)
                if need_hidden:
                    grad_hidden[start : start + rows] = grad @ w
                if need_weight and grad_weight.dtype == grad.dtype:
                    grad_weight.addmm_(grad.T, h)  # in place: no (V, H) temporary per chunk
                elif need_weight:
                    grad_weight += grad.T @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_elements: int = CHUNK_ELEMENTS,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden_states @ weight.T` against `labels`, never holding the logits of more than one chunk.

    Equals transformers' `fixed_cross_entropy(logits.float(), labels, num_items_in_batch)` (its mean over the
    non-ignored labels, or their sum divided by `num_items_in_batch`); differs where no label counts: 0, not NaN.

    Args:
        hidden_states (`torch.Tensor` of shape `(..., hidden_size)`): The head's input.
        weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`): The head's weight (no bias).
        labels (`torch.LongTensor` of shape `(...)`): The class of each row, `ignore_index` where none (already
            aligned with `hidden_states`: see `causal_targets` for the next-token shift).
        num_items_in_batch (`torch.Tensor` or `int`, *optional*): The divisor (the labelled tokens of the whole
            accumulated batch, as `Trainer` passes it); defaults to this call's labelled tokens.
        ignore_index (`int`, *optional*, defaults to -100): The label of rows without a target.
        chunk_elements (`int`, *optional*, defaults to `CHUNK_ELEMENTS`): Logit elements computed at a time (by
            default, at least `hidden_size` rows' worth).
        softcap (`float`, *optional*): Caps the logits as c·tanh(logits / c) first (`final_logit_softcapping`).
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements!r}: expected a positive number of logits per chunk")
    labels = labels.reshape(-1).to(hidden_states.device)
    keep = labels != ignore_index
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])[keep]  # (N, H): only the rows with a target
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grad = torch.is_grad_enabled()
    # each chunk adds a (V, H) update to the weight's gradient: with at least H rows a chunk its logits cost as much
    # memory traffic as that update (64 rows a chunk at vocab 128k ran at half Llama's speed, 384 at parity)
    min_rows = weight.shape[1] if chunk_elements == CHUNK_ELEMENTS else 1
    total = LinearCrossEntropyFunction.apply(
        hidden,
        weight,
        labels[keep],
        max(1, chunk_elements // weight.shape[0], min_rows),
        compute_dtype,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        softcap,
    )
    if num_items_in_batch is None:
        return total / keep.sum().clamp(min=1)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def head_logits(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`module.lm_head(hidden_states)`, capped as c·tanh(logits / c) by the config's `final_logit_softcapping` c
    (Gemma 2's; TRL's fused head reads the same field)."""
    logits = module.lm_head(hidden_states)
    cap = module.config.final_logit_softcapping
    return logits if cap is None else cap * torch.tanh(logits / cap)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Cross-entropy of `logits` (..., V) against `labels` (...) in float32, -100 ignored: the mean over the labelled
    positions, or their sum divided by `num_items_in_batch` (`Trainer` passes the labelled tokens of the whole
    accumulated batch, so that gradient accumulation weighs every token alike and the loss keeps its scale)."""
    labels = labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels)
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The next-token target of each position, as transformers' `ForCausalLMLoss` aligns them: `labels` shifted one
    left with `ignore_index` appended, or `shift_labels` as given (already shifted, e.g. under context parallelism).

    >>> causal_targets(torch.tensor([[5, 6, 7]]))
    tensor([[   6,    7, -100]])
    """
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def unsharded_class(module: nn.Module | None) -> type:
    """The class of `module`, or the class FSDP2's `fully_shard` swapped for `FSDP<class>` (bases `(FSDPModule,
    class)`): accelerate's FSDP2 shards the head with the final norm (and the tied embeddings), so in the model's
    forward the head is an `FSDPLinear` whose weight is already gathered (a still sharded one is refused below)."""
    bases = type(module).__bases__
    return bases[1] if len(bases) == 2 and bases[0].__name__ == "FSDPModule" else type(module)


def fused_head_loss(
    module: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    logits_to_keep: int | torch.Tensor = 0,
    shift: bool = False,
    **kwargs,
) -> torch.Tensor | None:
    """The loss of a head's forward computed by `linear_cross_entropy`, or `None` where the head computes its logits.

    Fused when `labels` are given, `module.fused_loss` is set (`plugformer train pretrain` sets it; off by default),
    the module is training, every logit is asked for (`logits_to_keep=0`) and `module.lm_head` is a plain bias-free
    `nn.Linear` (or FSDP2's `FSDPLinear` of one: `unsharded_class`) with a plain weight (not a PEFT adapter, whose
    update the weight alone would miss; nor a weight sharded by tensor parallelism, FSDP2 or DeepSpeed ZeRO-3, which
    only the head's own call gathers). The forward then returns `logits=None`, as Liger's and TRL's fused heads do;
    evaluation and generation keep the logits.

    `shift=True` (causal LM): next-token targets as `ForCausalLMLoss` (`shift_labels`, `num_items_in_batch` and
    `ignore_index` from `kwargs`). `shift=False` (masked LM): as its unfused loss (`token_cross_entropy`, with
    `num_items_in_batch` from `kwargs`).
    """
    if labels is None or not getattr(module, "fused_loss", False) or not module.training:
        return None
    head = getattr(module, "lm_head", None)
    if (
        unsharded_class(head) is not nn.Linear
        or head.bias is not None
        or not (isinstance(logits_to_keep, int) and not logits_to_keep)
        or hasattr(head.weight, "placements")  # a DTensor (tensor parallel, or an FSDP2 shard not gathered)
        or hasattr(head.weight, "ds_id")  # a DeepSpeed ZeRO-3 partition
    ):
        return None
    check_labels(labels, module.config.vocab_size)
    cap = module.config.final_logit_softcapping
    if not shift:
        return linear_cross_entropy(hidden_states, head.weight, labels, kwargs.get("num_items_in_batch"), softcap=cap)
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
    targets = causal_targets(labels, kwargs.get("shift_labels"), ignore_index)
    return linear_cross_entropy(
        hidden_states, head.weight, targets, kwargs.get("num_items_in_batch"), ignore_index, softcap=cap
    )
