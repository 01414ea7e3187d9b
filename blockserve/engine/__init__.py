"""The engine: the synchronous step loop, the async engine, detokenization, and the offline
`LLM` class.

Modules:

  args.py              EngineArgs: every engine option once; create_configs()
  arg_checks.py        the checks of the options EngineArgs declares itself

  request.py           RequestSpec, ValidatedRequest, SampleId, EngineCoreRequest
  input_processor.py   InputProcessor: the one place a request is checked and tokenized
  chat.py              chat template → prompt ids; special-token text in messages stays text
  tokenizer_pool.py    TokenizerPool: tokenizing off the event loop and the engine thread
  core.py              EngineCore: scheduler + runner + KV events, one step at a time or
                       (--async-scheduling) one step ahead
  core_step.py         ScheduledStep; a step run, launched or finished, failures its own
  reports.py           the KV cache report and the miss-ratio report the core answers with
  tier_feed.py         the engine's side of the KV tiers: built from the config, fed each step's
                       filled blocks, their state reported
  output_processor.py  OutputProcessor: n fan-out/in, detokenizing, stop strings, counters
  detokenizer.py       incremental detokenization with stop strings
  outputs.py           RequestOutput, CompletionOutput, EngineStats, KVCacheReport,
                       EngineCoreOutputs
  llm_engine.py        LLMEngine (the three joined) and build_engine(config)
                       generation_config.py default sampling parameters from
                       generation_config.json
  client.py            EngineClient protocol, ModelInfo
  async_engine.py      AsyncEngine: the engine on its own thread; the server's client
  llm.py               the offline LLM class (keywords = EngineArgs fields)
"""
