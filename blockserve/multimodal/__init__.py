"""Images as the engine takes them and the prefix cache keys them.

Modules:

  hasher.py   an item's identifier, byte for byte vLLM 0.32's (MultiModalHasher): what is
              hashed for a decoded image, for the bytes it arrived as, for a client's uuid
  idefics3.py SmolVLM / Idefics3 image processing (tiles, pixel values) with Pillow and
              numpy, equal to transformers', and the prompt text an image becomes
  prompts.py  ImagePrompts: a prompt's `<image>`s into tokens, identifiers and spans
  inputs.py   ImageInput: one image as the engine core and the runner take it
  media.py    an image URL (data:, http(s), file://) fetched within its bounds and decoded as
              vLLM decodes it
  processor_cache.py  ProcessorCache: processed images (tiles) by identifier, bounded in bytes

ALGORITHMS is here, free of numpy, for the configuration's --mm-hasher-algorithm.
"""

ALGORITHMS = ("blake3", "sha256", "sha512")  # vLLM's --mm-hasher-algorithm; blake3 its default
