"""Llama-family model definitions, weight loading (HF directories and GGUF), and the sampler.

Modules:

  arch.py          LlamaArchConfig from config.json (transformers 4 and 5 layouts; a SmolVLM /
                   Idefics3 checkpoint's text half)
  rope.py          rotary embeddings: inverse frequencies (llama3 scaling), cos/sin tables
  llama.py         Llama-family decoder over a flat batch (fused qkv / gate-up)
  vision.py        SmolVLM / Idefics3's vision half: a SigLIP transformer over whole tiles
                   and the pixel-shuffle connector (not yet on an engine path)
  loader.py        HF directory, hub id or GGUF (dequantized once, cached as safetensors);
                   TokenizerSources (--tokenizer, --chat-template); a vision-language
                   checkpoint's text half as the decoder
  hub.py           hub ids through huggingface_hub's cache, as vLLM resolves them; --tokenizer's
                   directory
  gguf_llama.py    a plain Llama GGUF file to config.json + safetensors in one pass
  gguf_weights.py  --quantization gguf: the file's Q4_0 / Q4_1 / Q8_0 blocks for each fused
                   linear layer, handed to its PackedLinear
  tokenizer.py     Tokenizer: tokenizers + jinja2 chat templates, loaded from a snapshot of what
                   transformers built (no transformers import on a warm start);
                   --chat-template's text
  packed.py        PackedLinear: weights reordered once for oneDNN (blockserve::packed_linear),
                   each product dispatched by its rows to our kernels over the weight's copies
  weight_copies.py those copies, made once the kernels are loaded: tile order (AMX), panels
                   (few rows), half precision (AVX512-FP16) or widened to float32, and a GGUF
                   file's blocks for decode-sized products (--quantization gguf)
  attention_op.py  blockserve::attention: attention as one opaque operator for a compiled graph,
                   the step's backend and plan passed as an AttentionStep
  compile.py       --compile: the whole forward as one torch.compile graph (token dimension
                   dynamic), warmed at start-up, inductor's cache under the cache dir
  sampler.py       batched greedy / temperature / top-k / top-p / min-p / penalties / seeds /
                   logprobs; takes the LM head's logits in the model's dtype (a greedy-only
                   batch: their argmax as they are; others widen them to float32)
"""
