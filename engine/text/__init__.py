"""Text (chapter 02): the byte-level BPE tokenizer, chat templates in a bounded sandbox, stop strings.
"""
