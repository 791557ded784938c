"""The OpenAI-compatible HTTP server: FastAPI app, OpenAI protocol models, Prometheus metrics.

`create_app(async_engine, model_name, ...)` builds the app over a running `AsyncLLMEngine`;
`launch.serve(...)` runs it under uvicorn with a graceful drain (what `tandem serve` calls).
This package turns HTTP into engine requests and back; it makes no scheduling decisions.
"""

from tandem.server.app import create_app

__all__ = ["create_app"]
