"""Llama-family model definitions, weight loading (HF directories and GGUF), and the sampler."""
