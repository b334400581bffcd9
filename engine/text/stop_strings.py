"""Stop strings: end a request's text at the first occurrence of any of them (chapter 12).

The scheduler decides "stop" (an eos token) and "length" from token ids alone. A stop string is
different: it lives in the text, and one string may span several tokens (" END" may be " E" + "ND"),
or one token may hold the stop string and more ("ND.\\n"). So the check runs on the detokenized text,
as OpenAI and vLLM do:

* the returned text ends just before the stop string (the stop string itself is not included);
* while streaming, text that could still turn into a stop string is held back (the tail "...E" is
  not shown until the next token says whether it became " END"), so the streamed pieces always join
  to exactly the final text;
* the earliest occurrence wins, whichever stop string it is.

    matcher = StopStringMatcher([" END", "\\n\\n"])
    shown = matcher.push(piece)      # for each decoded piece; empty while the tail is ambiguous
    if matcher.stopped: ...          # finish the request with finish_reason "stop"
    shown += matcher.flush()         # at the end: the held-back tail (when no stop string came)
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop):
        self.stop = tuple(stop)
        self.text = ""          # the text so far, truncated at the stop string once one appeared
        self.stopped = False
        self._shown = 0         # characters of self.text already returned by push()
        self._longest = max((len(s) for s in self.stop), default=0)

    def push(self, piece: str) -> str:
        """Add newly decoded text; return the part that is safe to show now."""
        if self.stopped:
            return ""
        # A stop string that ends inside `piece` starts at most len(stop) - 1 characters before it.
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        """End of the stream without a stop string: the held-back tail is ordinary text after all."""
        return self._take(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the unshown text that is a proper prefix of a stop string."""
        unshown = len(self.text) - self._shown
        for k in range(min(self._longest - 1, unshown), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def _take(self, end: int) -> str:
        out = self.text[self._shown:end]
        self._shown = max(self._shown, end)
        return out


def truncate_at_stop(text: str, stop) -> tuple[str, bool]:
    """The whole-text version: (text before the earliest stop string, whether one was found)."""
    hits = [i for s in stop if (i := text.find(s)) >= 0]
    return (text[:min(hits)], True) if hits else (text, False)
