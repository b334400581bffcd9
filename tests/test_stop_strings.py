"""Stop strings: the streaming matcher agrees with truncating the whole text, however it is split."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.sampling import SamplingParams
from engine.stop_strings import StopStringMatcher, truncate_at_stop

ALPHABET = "ab \né"      # few characters, so that stop strings actually occur and overlap


def stream(pieces, stop):
    m = StopStringMatcher(stop)
    shown = [m.push(p) for p in pieces]
    return "".join(shown) + m.flush(), m.stopped, shown


@given(st.lists(st.text(ALPHABET, max_size=6), max_size=12),
       st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3))
def test_streamed_equals_whole_text(pieces, stop):
    text, stopped, _ = stream(pieces, stop)
    assert (text, stopped) == truncate_at_stop("".join(pieces), stop)


def test_earliest_occurrence_wins_and_the_stop_string_is_dropped():
    assert truncate_at_stop("one END two STOP", ["STOP", " END"]) == ("one", True)
    assert stream(["one E", "N", "D two"], [" END"])[:2] == ("one", True)


def test_ambiguous_tail_is_held_back_until_resolved():
    _, stopped, shown = stream(["say E", "NOUGH", "!"], [" END"])
    assert shown == ["say", " ENOUGH", "!"] and not stopped


def test_no_stop_strings_passes_everything_through():
    assert stream(["a", "b"], [])[2] == ["a", "b"]


def test_sampling_params_stop_is_validated_and_normalized():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop == ("x", "yz")
    assert SamplingParams().stop == ()
    for bad in ("", [""], [1], 3, ["a", None]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
