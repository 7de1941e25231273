"""maxtext.layers: the building blocks of the decoder, and the mixer of every built-in layer kind.

Importing the package registers the built-in mixers (attention for full_attention and sliding_attention, Gated
DeltaNet for linear_attention, Mamba2 for mamba) with `maxtext.layers.mixer`.
"""

from maxtext.layers import attention, gated_delta_net, mamba2  # noqa: F401  # pylint: disable=unused-import  # registers the built-in mixers
