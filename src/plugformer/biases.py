"""Score biases as kernels consume them: the contract between the position schemes that make a bias and the kernels
that add it, below both.

A position scheme with a bias names the kind it makes (`PositionScheme.bias_type`), and the model hands the kernels
an object of that kind. Every kind answers the same questions: the rows of the query block a kernel works on
(`rows`), one score at a time (`bias[b, h, i, j]`, as transformers' flex `score_mod` reads it), or, for a kernel
whose record says it takes only a dense bias, the whole tensor (`dense`).

| kind | class | depends on | stored as |
|---|---|---|---|
| `relative` | `RelativeBias` | key slot − query slot only (ALiBi, T5, clamped, KERPLE) | `(H, Q + K − 1)`, shared by the batch |
| `query_position` | `QueryPositionBias` | also the query's position (FIRE) | `(B or 1, H, Q, K)`, per batch row |
| `decay` | `DecayBias` | each row's tokens between key and query (forgetting attention's gates) | `(B, H, K + Q)`, per batch row |

A kernel record (`capabilities.KernelSpec.bias_kinds`) lists the kinds it takes; the others are refused for it.
"""

from __future__ import annotations

import torch
from torch import nn


class RelativeBias:
    """A score bias that depends on key slot − query slot only (a Toeplitz matrix per head), stored per distance.

    Class attributes (as every bias kind's):
        kind (`str`): the name kernel records list in `bias_kinds`.
        head_axis (`int`): the axis of the values that runs over the heads (tensor parallelism slices it).
        folds_gradient (`bool`): whether `fold_rows` reduces a block's score gradient into the values, so the sdpa
            kernel's `LearnedBiasAttention` may recompute a block in its backward instead of autograd keeping it.

    `values[h, j − i + Q − 1]` is the bias of query i on key j: (H, Q + K − 1) numbers stand for the (1, H, Q, K)
    tensor. Kernels expand the query rows they work on (`rows`), so a blockwise kernel never holds the whole matrix
    and the gradient of a learned bias flows back through `values` to the small table it was looked up from.

    Args:
        values (`torch.Tensor` of shape `(H, Q + K - 1)`): the bias at distances from 1 − Q (the last query to the
            first key) to K − 1 (the first query to the last key), relative to the slot offsets.
        query_length (`int`): Q.
        key_length (`int`): K.
        constant_beyond (`int`, *optional*): a distance W from which the bias is one value per head on each side
            (T5's last bucket, the clamp of `clamped_bias`), declared by the scheme
            (`PositionScheme.constant_bias_distance`): the sdpa kernel then computes the bias gradient of the keys
            less than W slots behind a causal query alone, explicitly (`kernels_banded`).
        linear (`bool`, *optional*, defaults to `False`): whether the bias is m_h · (j − i) for every key j at or
            before query i (ALiBi), declared by the scheme (`PositionScheme.linear_bias_slopes`): the sdpa kernel then
            folds the bias of a causal block into a mask of its keys alone (`kernels_alibi`).
    """

    kind = "relative"
    head_axis = 0
    folds_gradient = True

    def __init__(
        self,
        values: torch.Tensor,
        query_length: int,
        key_length: int,
        constant_beyond: int | None = None,
        linear: bool = False,
    ):
        if values.shape[-1] != query_length + key_length - 1:
            raise ValueError(
                f"values of shape {tuple(values.shape)} do not cover {query_length} queries x "
                f"{key_length} keys (expected {query_length + key_length - 1} distances)"
            )
        self.values = values
        self.query_length = query_length
        self.key_length = key_length
        self.constant_beyond = constant_beyond
        self.linear = linear

    def rows(self, start: int, stop: int, keys: int | None = None) -> torch.Tensor:
        """The bias `(1, H, stop − start, keys)` of queries `start..stop-1` over the first `keys` keys (all by
        default)."""
        keys = self.key_length if keys is None else keys
        if isinstance(keys, torch.SymInt) or isinstance(self.query_length, torch.SymInt):
            # traced with dynamic shapes: `unfold` would specialise its window to the traced length; a gather of
            # value index j − i + Q − 1 stays symbolic
            index = torch.arange(keys, device=self.values.device)[None, :] + self.query_length - 1
            index = index - torch.arange(start, stop, device=self.values.device)[:, None]  # (r, keys)
            return self.values[:, index][None]  # (1, H, r, keys)
        # Window m of length `keys` starts at distance index m; query i's row is window Q − 1 − i, so the block's
        # rows are windows Q − stop .. Q − 1 − start in reverse (unfold is a view; the flip copies just the block).
        windows = self.values.unfold(-1, keys, 1)  # (H, Q + K − keys, keys)
        block = windows[:, self.query_length - stop : self.query_length - start].flip(1)  # (H, r, keys)
        return block[None]  # (1, H, r, keys)

    def fold_rows(self, grad: torch.Tensor, start: int) -> torch.Tensor:
        """The adjoint of `rows`: a gradient `(H, r, keys)` of query rows `start..` summed along its diagonals into
        the `(H, Q + K − 1)` values (each diagonal is one distance), without the (H, r, keys) index that autograd's
        unfold backward would scatter through.
        """
        heads, rows, keys = grad.shape
        # Left-pad each row by r and re-read the rows with one more column: row i shifts left by i, so the entry of
        # (i, j) lands in column j − i + r, one distance per column (the skew trick of Transformer-XL's shift).
        skewed = nn.functional.pad(grad, (rows, 0)).flatten(1)  # (H, r·(keys + r))
        skewed = nn.functional.pad(skewed, (0, rows)).view(heads, rows, keys + rows + 1)  # (H, r, keys + r + 1)
        sums = skewed.sum(dim=1)[:, 1:]  # (H, keys + r): distances j − i from 1 − r to keys − 1
        folded = grad.new_zeros(self.values.shape)
        first = self.query_length - start - rows  # value index of distance 1 − r for rows starting at `start`
        folded[:, first : first + keys + rows - 1] = sums[:, : keys + rows - 1]
        return folded

    def dense(self) -> torch.Tensor:
        """The whole `(1, H, Q, K)` bias."""
        return self.rows(0, self.query_length)

    def __getitem__(self, index: tuple) -> torch.Tensor:
        """`bias[b, h, i, j]`, the bias of query i on key j in head h (any batch b): how transformers' flex attention
        reads `position_bias` in its `score_mod`, one score at a time, so no `(H, Q, K)` tensor is ever built."""
        _, head, query, key = index
        return self.values[head, key - query + self.query_length - 1]


class QueryPositionBias:
    """A score bias that depends on the query's position as well as on the distance (FIRE's normalisation by the query
    position), so a left-padded row, whose positions start later in its slots, has its own: stored dense per batch
    row, `(B or 1, H, Q, K)` (1 when every row has the same positions).

    The values are computed once per forward by the position scheme (shared by the layers, as T5's bias is); kernels
    take rows of them as they take a `RelativeBias`'s, and the gradient reaches the scheme's parameters through
    autograd (`folds_gradient` is false: a block's bias gradient is its score gradient, nothing to fold).

    Args:
        values (`torch.Tensor` of shape `(B or 1, H, Q, K)`): the bias of query i on key j of each row.
        query_length (`int`): Q.
        key_length (`int`): K.
    """

    kind = "query_position"
    head_axis = 1
    folds_gradient = False

    def __init__(self, values: torch.Tensor | QueryBiasRecipe, query_length: int, key_length: int):
        if values.ndim != 4 or tuple(values.shape[-2:]) != (query_length, key_length):
            raise ValueError(
                f"values of shape {tuple(values.shape)} are not (B, H, {query_length} queries, {key_length} keys)"
            )
        self.values = values
        self.query_length = query_length
        self.key_length = key_length

    @property
    def recipe(self) -> QueryBiasRecipe | None:
        """The `QueryBiasRecipe` the values are computed from block by block, or `None` for stored values."""
        return self.values if isinstance(self.values, QueryBiasRecipe) else None

    def rows(self, start: int, stop: int, keys: int | None = None) -> torch.Tensor:
        """The bias `(B or 1, H, stop − start, keys)` of queries `start..stop-1` over the first `keys` keys (all by
        default): a view of the values, or those rows computed by the recipe (with autograd, when it is on)."""
        keys = self.key_length if keys is None else keys
        if self.recipe is not None:
            return self.recipe.rows(start, stop, keys)
        return self.values[:, :, start:stop, :keys]

    def dense(self) -> torch.Tensor:
        """The whole `(B or 1, H, Q, K)` bias."""
        return self.rows(0, self.query_length) if self.recipe is not None else self.values

    def __getitem__(self, index: tuple) -> torch.Tensor:
        """`bias[b, h, i, j]` (flex attention's `score_mod`); values shared by the batch are read at row 0 (indexing
        a size-1 batch axis with b > 0 would read out of bounds)."""
        if self.recipe is not None:  # the stack makes a recipe only for kernels whose record computes blocks
            raise TypeError(
                "a QueryPositionBias computed from a QueryBiasRecipe has no stored values to read one "
                "score at a time; give this kernel the scheme's bias_values()"
            )
        batch, head, query, key = index
        if self.values.shape[0] == 1:
            return self.values[0, head, query, key]
        return self.values[batch, head, query, key]


class QueryBiasRecipe:
    """How to compute a `QueryPositionBias` a block of query rows at a time, standing in for its values: the queries'
    positions and slots, the keys' slots, and the scheme's function of its parameters.

    The stack hands it instead of the `(B or 1, H, Q, K)` values to a kernel whose record computes the bias per block
    (`capabilities.KernelSpec.bias_recipe`), in training: that bias then never exists whole, and the sdpa kernel
    (`kernels_query_bias`) computes each block's rows again in its backward from `parameters` to send their gradient
    to them. A block's rows equal the same rows of the scheme's
    `bias_values`: the same function on the same inputs, cast to the same `dtype`.

    Args:
        function (`Callable`): `(query_positions (B or 1, r), behind (r, keys), parameters) -> (B or 1, H, r, keys)`,
            `behind` being query slot − key slot; `parameters` `None` for the scheme's own, else tensors standing in
            for `parameters` (the kernel's detached copies in its backward).
        parameters (`tuple[torch.Tensor, ...]`): the tensors `function` reads (the scheme's parameters).
        query_positions (`torch.Tensor` of shape `(B or 1, Q)`): the queries' positions (`position_ids`).
        query_slots (`torch.Tensor` of shape `(Q,)`), key_slots (`torch.Tensor` of shape `(K,)`): their cache slots.
        num_heads (`int`): H.
        dtype (`torch.dtype`): the dtype of the values (the stack's; `bias_values(...).to(dtype)`).
        width (`int`, *optional*, defaults to 1): numbers `function` holds per score at once besides the H of its
            result (FIRE's input, its piece and the slopes and intercepts looked up), for sizing blocks.
        tables (`Callable`, *optional*): `(query_positions, length) -> (psi, inv_norm, kinks, slope, intercept)`
            for a bias f(psi[i − j]·inv_norm[b, i]) piecewise linear per head over causal self-attention from slot
            0 (FIRE's, `FireBias.piecewise_tables`), which `kernels_fire_native` evaluates per score; `None` where
            the bias has no such form.
    """

    ndim = 4

    def __init__(
        self,
        function,
        parameters,
        query_positions,
        query_slots,
        key_slots,
        num_heads: int,
        dtype: torch.dtype,
        width: int = 1,
        tables=None,
    ):
        self.function, self.parameters = function, tuple(parameters)
        self.query_positions, self.query_slots, self.key_slots = query_positions, query_slots, key_slots
        self.num_heads, self.dtype, self.width, self.tables = num_heads, dtype, width, tables

    @property
    def shape(self) -> torch.Size:
        """`(B or 1, H, Q, K)`, the shape of the values it stands for."""
        return torch.Size((self.query_positions.shape[0], self.num_heads, len(self.query_slots), len(self.key_slots)))

    @property
    def requires_grad(self) -> bool:
        """Whether the values it stands for would require grad (autograd on and a parameter requiring it)."""
        return torch.is_grad_enabled() and any(parameter.requires_grad for parameter in self.parameters)

    def rows(self, start: int, stop: int, keys: int, parameters: tuple[torch.Tensor, ...] | None = None):
        """The bias `(B or 1, H, stop − start, keys)` of queries `start..stop-1` over the first `keys` keys, from
        `parameters` (by default the scheme's own)."""
        behind = self.query_slots[start:stop, None] - self.key_slots[None, :keys]  # (r, keys)
        positions = self.query_positions[:, start:stop]  # (B or 1, r)
        return self.function(positions, behind, parameters).to(self.dtype)

    def piecewise_tables(self) -> tuple[torch.Tensor, ...]:
        """`tables` of the queries' positions and length, under autograd from the scheme's parameters."""
        if self.tables is None:
            raise ValueError("this bias recipe has no piecewise tables (tables=None)")
        return self.tables(self.query_positions, len(self.query_slots))


class DecayBias:
    """A score bias accumulated between key and query from a number per token: with F the running sum of each row's
    per-token log decays along its slots (forgetting attention's F_t = Σ_{l ≤ t} log f_l, Lin et al. 2025), the bias
    of query i on key j is −|F_i − F_j|. F never increases (log f ≤ 0, and a float sum of non-positive terms never
    increases either), so for a key at or before the query this is F_i − F_j = Σ_{j < l ≤ i} log f_l exactly, the
    paper's D_ij; for a later key (an encoder's) the decay of the tokens between them the other way.

    Stored as the (B, H, K + Q) numbers F of the K key slots then of the Q queries, for the (B, H, Q, K) bias: the
    queries' own F is kept beside the keys' although the softmax ignores a constant per row, because F grows without
    bound along a sequence, and a key-only bias −F_j (the ALiBi kernel's split, `kernels_alibi`) would carry numbers
    as large as the sequence is long into every score; each block of rows here takes the difference, whose size is the
    decay between the two tokens, in the values' dtype (fp32 at least) before a kernel casts it. A kernel computes any
    block of rows from the values (`rows`), so the sdpa kernel does in training (`kernels_query_bias`, where this
    object is its own recipe: the gradient of a block's rows reaches `values` by autograd), and flex reads one score at
    a time (`__getitem__`).

    Args:
        values (`torch.Tensor` of shape `(B, H, K + Q)`): F at the K key slots, then at the Q query slots.
        query_length (`int`): Q.
        key_length (`int`): K.
    """

    kind = "decay"
    head_axis = 1
    folds_gradient = False
    ndim = 4  # as a `QueryBiasRecipe`: the (B, H, Q, K) bias it stands for
    width = 1  # numbers held per score besides the bias, for sizing the sdpa kernel's blocks

    def __init__(self, values: torch.Tensor, query_length: int, key_length: int):
        if values.ndim != 3 or values.shape[-1] != key_length + query_length:
            raise ValueError(
                f"values of shape {tuple(values.shape)} are not (B, H, {key_length} keys + {query_length} queries)"
            )
        self.values = values
        self.query_length = query_length
        self.key_length = key_length
        self.num_heads = values.shape[1]

    @property
    def shape(self) -> torch.Size:
        """`(B, H, Q, K)`, the shape of the bias."""
        return torch.Size((self.values.shape[0], self.num_heads, self.query_length, self.key_length))

    @property
    def recipe(self) -> DecayBias:
        """Itself: it computes any block of rows from `parameters` (the values), as a `QueryBiasRecipe` does."""
        return self

    @property
    def parameters(self) -> tuple[torch.Tensor]:
        """The tensors the rows are a function of: the values."""
        return (self.values,)

    @property
    def requires_grad(self) -> bool:
        """Whether the rows would require grad (autograd on and the values requiring it)."""
        return torch.is_grad_enabled() and self.values.requires_grad

    def rows(self, start: int, stop: int, keys: int | None = None, parameters: tuple[torch.Tensor] | None = None):
        """The bias `(B, H, stop − start, keys)` of queries `start..stop-1` over the first `keys` keys (all by default),
        in the values' dtype, from `parameters` (by default the values; the sdpa kernel's detached copy in its
        backward)."""
        keys = self.key_length if keys is None else keys
        values = self.values if parameters is None else parameters[0]
        queries = values[:, :, self.key_length + start : self.key_length + stop]  # (B, H, r)
        return -(queries[..., None] - values[:, :, None, :keys]).abs()  # (B, H, r, keys)

    def dense(self) -> torch.Tensor:
        """The whole `(B, H, Q, K)` bias."""
        return self.rows(0, self.query_length)

    def __getitem__(self, index: tuple) -> torch.Tensor:
        """`bias[b, h, i, j]` (flex attention's `score_mod`), from the row's F at the query and at the key."""
        batch, head, query, key = index
        return -(self.values[batch, head, self.key_length + query] - self.values[batch, head, key]).abs()


# The bias kinds by the name kernel records list (`capabilities.KernelSpec.bias_kinds`).
BIAS_KINDS = {bias.kind: bias for bias in (RelativeBias, QueryPositionBias, DecayBias)}
