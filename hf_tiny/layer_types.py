"""Attention layer types, shared by the causal and the encoder configs (a saved folder of either family carries
this file, not the other family's configuration)."""

from __future__ import annotations

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_layer_types(owner: str, layer_types, num_hidden_layers: int, sliding_window) -> list[str]:
    """layer_types filled in (every layer sliding when sliding_window is set, else full) and checked."""
    if layer_types is None:
        return ["sliding_attention" if sliding_window is not None else "full_attention"] * num_hidden_layers
    if not isinstance(layer_types, (list, tuple)):
        raise TypeError(f"{owner}: layer_types must be a list of {list(LAYER_TYPES)}, got {layer_types!r}")
    layer_types = list(layer_types)
    if len(layer_types) != num_hidden_layers:
        raise ValueError(
            f"{owner}: layer_types has {len(layer_types)} entries but num_hidden_layers={num_hidden_layers}"
        )
    for index, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ValueError(f"{owner}: layer_types[{index}]={kind!r} is not a layer type hf_tiny knows; choose one of {list(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError(
            f"{owner}: layer_types has 'sliding_attention' layers (first: {layer_types.index('sliding_attention')}) "
            "but sliding_window is None; set sliding_window"
        )
    return layer_types
