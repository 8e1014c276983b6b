"""The network and its layers: the Llama family (`llama.py`), projections on quantized weights
(`quant_layers.py`) and the native all-layers decode step (`fused_decode.py`).

A model takes a `KVCache` and `AttentionMetadata` and never builds either.
"""
