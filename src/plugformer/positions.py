"""Position schemes: one registered class per `config.position_scheme`.

The taxonomy follows where a scheme acts (x-transformers): added to the token embeddings (`sinusoidal`,
`learned`), rotating queries and keys (`rope`), or an additive bias on the attention scores (`alibi`, `t5_bias`,
`clamped_bias`, `kerple_log`, `fire`; `forgetting`, computed in each layer from its input). Every scheme answers the
same three hooks and returns `None` where it has nothing to add, so the model runs one code path:

- `embed(position_ids, dtype)` -> `(B, T, hidden)` added to the token embeddings, or `None`;
- `rotary(hidden_states, position_ids)` -> `(cos, sin)` each `(B, T, head_dim)`, or `None`;
- `bias_values(query_offset, Q, key_offset, K, position_ids)` -> the values of the scheme's `bias_type` object,
  or `None`. A bias of key slot − query slot only (`distance_bias(distances)` -> float `(H, M)`) reaches the kernels
  as a `RelativeBias`: (H, Q + K − 1) numbers standing for the (1, H, Q, K) bias, which a kernel expands one block
  of query rows at a time; FIRE's, which depends on the query's position too, as a `QueryPositionBias` per batch
  row (`bias(query_slots, key_slots)` gives the dense tensor of either). A `per_layer` scheme (forgetting attention,
  a `DecayBias`) is computed by each attention layer from its input instead (`build_layer`, `token_states`,
  `layer_bias`), its per-token states kept in the KV cache beside the values (`TokenStates`).

Relative biases are indexed by cache *slots* (query slot = tokens already cached + offset in the chunk, key
slot = index in the cache). With left padding the padding is masked, so slot differences are the true relative
distances; with a static cache the unused slots are masked the same way.

One module per family: `positions_base` (the table, the base class, `none`), `positions_absolute`,
`positions_rotary`, `positions_bias` and `positions_gate`. Importing this module registers every scheme: import them
from here.
"""

# isort: off
# Import order is registration order, the order of `POSITION_SCHEMES.names()` (docs, CLI, combination tables):
# none, sinusoidal, learned, rope, alibi, t5_bias, clamped_bias, kerple_log, fire, forgetting.
from .positions_base import POSITION_SCHEMES, NoPositions, PositionScheme, TokenStates, relative_distances
from .positions_absolute import LearnedPositions, SinusoidalPositions, sinusoidal_table
from .positions_rotary import RotaryPositions, apply_rotary, rotate_half
from .positions_bias import (
    HEAD_TABLE_TP_PLAN,
    AlibiPositions,
    ClampedDistanceBias,
    FireBias,
    KerpleLogBias,
    T5BucketBias,
    alibi_slopes,
    t5_relative_position_bucket,
)
from .positions_gate import ForgettingAttention

# isort: on


__all__ = [
    "HEAD_TABLE_TP_PLAN",
    "POSITION_SCHEMES",
    "AlibiPositions",
    "ClampedDistanceBias",
    "FireBias",
    "ForgettingAttention",
    "KerpleLogBias",
    "LearnedPositions",
    "NoPositions",
    "PositionScheme",
    "RotaryPositions",
    "SinusoidalPositions",
    "T5BucketBias",
    "TokenStates",
    "alibi_slopes",
    "apply_rotary",
    "relative_distances",
    "rotate_half",
    "sinusoidal_table",
    "t5_relative_position_bucket",
]
