"""nvg: compress a Llama-family model into binary low-rank (BLR) weights in CMF v2 and heal it by
distillation against its teacher. One step module per pipeline stage; see README.md."""

__version__ = "0.1.0"
