"""`python -m engine.serve` (chapter 12): the OpenAI-compatible HTTP server, its metrics and dashboard.
"""
