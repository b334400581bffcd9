"""Stop strings: the streaming matcher agrees with truncating the whole text, however it is split."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.runtime.sampling_params import SamplingParams
from engine.text.stop_strings import StopStringMatcher, truncate_at_stop

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


# ---- in the engine: LLM.generate and streamed handles ---------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_chat_dir, both_schedulings):
    from engine.runtime.llm import LLM
    return LLM(tiny_chat_dir, backend="numpy", max_context=128)


def test_generate_ends_at_a_stop_string(llm):
    full = llm.generate("Stop strings end", SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    cut = llm.generate("Stop strings end", SamplingParams(max_new_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
    handle = llm.submit("Stop strings end", SamplingParams(max_new_tokens=20, ignore_eos=True, stop=stop))
    events = list(handle.stream())
    assert "".join(e.text for e in events) == cut.text and events[-1].finish_reason == "stop"
    assert llm.stats()["pages_used"] == 0


def test_stop_strings_need_a_tokenizer(tmp_path):
    from engine.model.random_model import write_random_model
    from engine.runtime.llm import LLM
    bare = LLM(write_random_model(tmp_path / "m", "tiny"), backend="numpy", max_context=64)
    with pytest.raises(ValueError, match="stop strings need text"):
        bare.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, stop="x"))


def test_events_are_made_when_read_and_every_reader_sees_the_same(llm):
    """The loop hands a handle bare token ids; events and their text are made by whoever reads them
    first (after the end here, and by two threads at once), and they add up to the final output."""
    import threading
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    handle = llm.submit("Events are made late", params)
    output = handle.result()                      # nobody streamed while it ran
    seen = [None, None]

    def read(k):
        seen[k] = list(handle.stream())
    readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert seen[0] == seen[1] and seen[0][-1].finished and seen[0][-1].finish_reason == "length"
    assert [t for e in seen[0] for t in e.token_ids] == output.token_ids
    assert "".join(e.text for e in seen[0]) == output.text
    assert list(handle.stream()) == seen[0]       # a third read: the same events again


@pytest.mark.slow
def test_host_bench_runs_and_its_digest_is_stable(capsys):
    import json

    from engine.bench.host import main, workload
    records = []
    for _ in range(2):
        main(["--requests", "6", "--min-len", "4", "--max-len", "12", "--repeat", "1"])
        records.append(json.loads(capsys.readouterr().out))
    assert records[0]["outputs_sha256"] == records[1]["outputs_sha256"]
    assert records[0]["output_tokens"] == sum(p.max_new_tokens for p in workload(6, 4, 12)[1])   # ignore_eos
    assert records[0]["text_chars"] > 0 and records[0]["host_ms_per_step"] > 0
