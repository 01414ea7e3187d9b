"""The engine: the synchronous step loop, the async engine, detokenization, and the offline
`LLM` class."""
