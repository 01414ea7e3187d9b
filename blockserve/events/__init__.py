"""KV event publishers (null, ZMQ) and a subscriber; core/ decides when events happen."""
