"""`blockserve bench offline|serve|vs-vllm|replay`: the main benchmarks as commands, each
printing one JSON document stamped by the same harness (harness.py) with the host it ran on."""
