"""The Worker (device, weights, LoRA, pool sizing) and the executors that run workers, tensor parallel included."""
