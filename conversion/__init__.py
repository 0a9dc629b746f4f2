"""Convert a pretrained Transformer into an Aaren model."""
