"""``lowlat serve``: an OpenAI-compatible HTTP server over one engine loop.

Modules: ``engine_loop`` (the thread that owns the Engine, the request queue, abort), ``streams`` (requests,
deltas and the per-request streams that carry them),
``app`` (FastAPI routes), ``schemas`` (request models), ``openai_format`` (response bodies and SSE chunks),
``detokenizer`` (incremental text and stop strings), ``chat_template``, ``metrics`` (Prometheus), ``hf_cache``
(``--model`` as an HF repo id in the local cache). Importing this package imports none of the HTTP libraries;
``lowlat.serve.app`` needs the ``serve`` extra (``pip install 'lowlat[serve]'``; from a checkout
``pip install -e 'core[serve]'``).
"""
