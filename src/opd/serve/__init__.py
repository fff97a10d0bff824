"""``opd serve``: a small teacher server speaking the parts of the vLLM and SGLang APIs opd uses.

For CPU development and tests; a real deployment points the same client at vLLM or SGLang.

- ``POST /v1/completions`` (vLLM OpenAI-compatible): ``prompt`` is a list of token ids or a
  list of such lists; ``prompt_logprobs: k`` returns, for every prompt position, the
  prompt token's log-prob and the top-k (``null`` at position 0); ``max_tokens`` 0 or 1,
  ``echo`` accepted. ``k`` above ``--max-logprobs`` is refused, as vLLM does. Without
  ``prompt_logprobs`` it samples (a teacher writing completions): ``max_tokens``,
  ``temperature`` (0: greedy), ``seed``, ``stop_token_ids``, ``stop``, ``ignore_eos``,
  ``logprobs: 0`` and ``return_token_ids`` as vLLM reads them, from ``softmax(logits /
  temperature)`` only (other sampling settings at their neutral values).
- ``POST /generate`` (SGLang): ``input_ids``, ``return_logprob``, ``logprob_start_len``,
  ``top_logprobs_num``; answers ``meta_info.input_token_logprobs``.
- ``GET /v1/models``, ``GET /health``.

Malformed requests get a 4xx JSON error and the server keeps serving; :class:`ServerLimits` caps
what one client may cost (body size, time to send it, connections at once), ``max_tokens`` is
capped by the context and ``--max-tokens-per-request``, and a sampling request hands the model to
waiting requests between its decode steps.

Three rooms: :mod:`opd.serve.model` (the model that scores and samples, one forward at a time),
:mod:`opd.serve.wire` (the vLLM and SGLang request and answer formats), :mod:`opd.serve.http`
(the HTTP server and what one client may cost it).
"""
