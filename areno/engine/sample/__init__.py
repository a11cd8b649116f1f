"""Sampling on the device: filters, penalties, grammar masks, logprobs."""
