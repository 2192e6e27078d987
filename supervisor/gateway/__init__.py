"""The HTTP side of the supervisor: the Starlette app (app.py), the OpenAI request and response
shapes (openai_api.py), one request's life from lease to close (call.py), and the Prometheus metrics
(metrics.py). The only package that knows HTTP; the lifecycle core beside it knows none."""
