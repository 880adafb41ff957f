"""OpenAI's shapes over docproc's engine: `docproc run-batch` (batch files; batch.py) and the
request and response bodies (protocol.py)."""
