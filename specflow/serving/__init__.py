"""`specflow serve`: the pipeline behind an OpenAI-compatible HTTP API (pip install 'specflow[serve]').

worker.py runs the engine's round loop in one thread and hands each request's output to the HTTP
side; protocol.py turns OpenAI request bodies into engine requests and results into response
bodies (and refuses bad ones with OpenAI-style errors); prometheus.py renders /metrics; app.py is
the FastAPI app and the uvicorn server with its graceful shutdown.
"""
