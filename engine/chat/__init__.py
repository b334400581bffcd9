"""`python -m engine.chat` (chapter 12): the terminal chat, on a local engine.LLM or on a server.
"""
