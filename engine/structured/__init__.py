"""Structured output (constrained decoding): a regex, a list of choices, a JSON schema or "any JSON
object" becomes a per-request automaton that says which token ids may come next.

  regex_dfa.py    regex (a practical subset) -> minimal DFA over UTF-8 bytes, with hard size limits
  json_schema.py  JSON schema (a subset) / any JSON object -> a regex over the JSON text
  token_mask.py   the vocabulary as a byte trie, per-state token masks (cached), TokenMatcher

    from engine.structured.token_mask import TokenMatcher, TokenVocabulary, compile_constraint
    vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size=config.vocab_size, eos_token_ids={2})
    compiled = compile_constraint("json_schema", schema, vocab)     # once per (kind, spec)
    m = TokenMatcher(compiled)                                     # per request
    logits[~m.allowed_mask()] = -inf; ...; m.advance(token)        # per step

Everything here is CPU-only Python + NumPy; refusals are StructuredError (a ValueError).
"""
