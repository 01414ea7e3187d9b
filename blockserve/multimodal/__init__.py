"""Images as the prefix cache keys them (no engine path serves them yet).

Modules:

  hasher.py   an item's identifier, byte for byte vLLM 0.32's (MultiModalHasher): what is
              hashed for a decoded image, for the bytes it arrived as, for a client's uuid
  idefics3.py SmolVLM / Idefics3 image processing (tiles, pixel values) with Pillow and
              numpy, equal to transformers', and the prompt text an image becomes
"""
