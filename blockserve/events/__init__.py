"""KV event publishers (null, ZMQ) and a subscriber; core/ decides when events happen.

Modules:

  config.py         KVEventsConfig (vLLM's --kv-events-config keys)
  publisher.py      EventPublisher protocol, null publisher, factory
  zmq_publisher.py  PUB + ROUTER replay, bounded queue, sender thread
  subscriber.py     in-order subscriber with gap filling, CacheMirror, line format
"""
