"""The OpenAI-compatible HTTP server: app factory, protocol models, errors, metrics, auth.

Modules:

  options.py         ServerConfig: the server's options (flags), declared once
  app.py             FastAPI factory: routes, lifespan
  auth.py            API keys: which routes need one, key files, per-key cache salts
  limits.py          request-body limits (413 before the body is read; 408 for a slow one)
  request_limits.py  RequestLimits: prompts, stop strings, generated tokens per request
  timeouts.py        uvicorn's protocol with a deadline for each request's head
  drain.py           the SIGTERM drain: running requests, the deadline, expiry
  completions.py     /v1/completions: choices, echo, prompt_logprobs, the stream
  lora_routes.py     /v1/load_lora_adapter, /v1/unload_lora_adapter (a flag turns them on)
  openai_routes.py   /v1/chat/completions
  context.py         ServingContext: what every route of one server shares
  http_run.py        one HTTP request's engine requests: submit under server-made ids (the
                     client's request_id only a label), merge, abort, SSE
  protocol.py        pydantic request models
  body.py            their building blocks: strict bodies, encodable text
  constraints.py     response_format, structured_outputs, tools, tool_choice; the OpenAI and
                     vLLM fields refused with a 400 rather than ignored
  tools.py           tools and tool_choice: the call grammar, tool_calls replies, stream deltas
  responses.py       response bodies, SSE chunks, usage, logprobs
  errors.py          OpenAI-shaped errors (400 for validation, never 422); a missing route's
                     404 names the routes served
  vllm_surface.py    vLLM's flags and routes blockserve lacks, named as such when asked for
  metrics.py         Prometheus collector and histograms, periodic stats line
  serve.py           run uvicorn; the first SIGTERM drains before it shuts down
"""
