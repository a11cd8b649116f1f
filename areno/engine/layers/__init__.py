"""What the runner puts into the model's layers: paged caches, attention and linear-attention paths, fused and packed linears, LoRA."""
